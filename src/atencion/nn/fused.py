"""A generation step of a Llama-style decoder through all its layers in one call.

Generating a token at batch 1 reads every weight once (about 20 ms for SmolLM-135M's 540 MB on the
machines of docs/results.md), and the layer-by-layer path adds dozens of PyTorch calls per layer
around its products (norms, views, the cache's bookkeeping, residual sums), a few microseconds each:
for 30 layers, a quarter of the step. ``matvec.cpp``'s ``decoder_step`` runs the same products and
kernels (dot products or panels, RMSNorm, RoPE, attention over the cache) for every layer in one call,
writing each new key and value into the cache's buffers (nn/cache.py ``KVCache.room``).

It applies to the step of up to ``PANEL_ROWS`` rows, one new token each, of a decoder-only model whose
every layer is Llama's (pre-norm RMSNorm, self-attention with RoPE and any number of key/value heads,
SwiGLU feed-forward; biases allowed, as Qwen2's on q/k/v), in inference, on a CPU where the kernels
compiled (AVX-512 or AVX2), with float32 weights or nn/quantize.py's int8 ones (every layer's: the
rows of x quantized before each product as ``matvec.int8_linear`` does, the same int32 sums).
Everything else takes the layer-by-layer path, and so does everything with ``ATENCION_FUSED=0`` in
the environment. The two compute the same products in the same order; SiLU's exponential may differ
in the last bit."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..allocator import to_huge_pages
from . import matvec
from .attention import RelativeTerms
from .cache import DecoderState, KVCache
from .layers import ACTIVATIONS, GatedFeedForward
from .positional import rotates
from .quantize import Int8Linear

_NO_BIAS = torch.empty(0)


class Product(NamedTuple):
    """One product of a layer for ``decoder_step``: its weight (float32 or int8, as rows or in panels), its
    bias (empty where none), and an int8 weight's scales and int32 row sums (empty for float32)."""

    weight: Tensor
    bias: Tensor
    scales: Tensor = _NO_BIAS
    sums: Tensor = _NO_BIAS


class LayerParams(NamedTuple):
    """A Llama block's parameters by name, as matvec.cpp's ``Layer`` holds them."""

    attn_norm: Tensor  # RMSNorm before attention
    qkv: Product  # W^QKV (q heads, then k, then v)
    out: Product  # W^O
    ffn_norm: Tensor  # RMSNorm before the feed-forward layer
    gate: Product  # W1 of SwiGLU
    up: Product  # W3
    down: Product  # W2


PRODUCTS = ("qkv", "out", "gate", "up", "down")  # LayerParams' products, in the order of _layer_params' linears


def _layer_params(layer: nn.Module) -> tuple[LayerParams, list[nn.Module]] | None:
    """One block's parameters, its weights as they are, and its 5 linear layers; or None if it is not
    a Llama block."""
    attn, ffn = layer.self_attn, layer.ffn
    linears = (attn.in_proj, attn.out_proj) + ((ffn.linear1, ffn.linear3, ffn.linear2)
                                               if isinstance(ffn, GatedFeedForward) else ())
    if not (len(linears) == 5 and (all(type(m) is matvec.Linear for m in linears)  # not LoRA
                                   or all(type(m) is Int8Linear for m in linears))
            and ffn.activation is ACTIVATIONS["swiglu"] and layer.cross_attn is None and attn.kind is None
            and layer.res_self.norm_first and type(layer.res_self.norm) is matvec.RMSNorm
            and type(layer.res_ffn.norm) is matvec.RMSNorm and layer.res_self.norm.eps == layer.res_ffn.norm.eps):
        return None

    def product(m: nn.Module) -> Product:
        return Product(m.weight, _NO_BIAS if m.bias is None else m.bias)

    w_qkv, w_o, w1, w3, w2 = linears
    return LayerParams(layer.res_self.norm.weight, product(w_qkv), product(w_o), layer.res_ffn.norm.weight,
                       product(w1), product(w3), product(w2)), list(linears)


def tensors_of(params: LayerParams) -> list[Tensor]:
    """Every tensor of a layer's parameters."""
    return [params.attn_norm, params.ffn_norm] + [t for name in PRODUCTS for t in getattr(params, name)]


def for_kernel(planned: list[LayerParams]) -> list:
    """``plan``'s layers as matvec.cpp's ``Layer`` objects (made once per decoding), ``decoder_step``'s input."""
    module = matvec.KERNELS.module
    return [module.Layer(attn_norm=p.attn_norm, ffn_norm=p.ffn_norm,
                         **{name: module.Product(*getattr(p, name)) for name in PRODUCTS}) for p in planned]


def layout(rows: int) -> tuple[bool, bool]:
    """Whether ``rows`` rows take the float32 weights in panels (past ``MAX_ROWS``) and the int8 ones
    in int8 panels (from ``KERNELS.int8_panels_from``): where each beats the dot products."""
    kernels = matvec.KERNELS
    return rows > matvec.MAX_ROWS, kernels.matmul_int8_panels is not None and rows >= kernels.int8_panels_from


def plan(decoder: nn.Module, rows: int) -> list[LayerParams] | None:
    """Every layer's parameters for ``rows`` rows, each weight laid out as ``layout`` says
    (``matvec.panels`` and ``int8_panels``: a second copy, made once), an int8 one with its scales and
    sums; or None where the step cannot run there (another kind of block or positions, virtual tokens,
    training, gradients, not float32 or int8 on a CPU)."""
    if (os.environ.get("ATENCION_FUSED", "1") == "0" or decoder.training or decoder.positions is not None
            or not rotates(decoder.relative) or decoder.embed_norm is not None
            or decoder.prefix is not None or decoder.prompt is not None or matvec.kernel() is None
            or matvec.KERNELS.decoder_step is None):
        return None
    layers = [_layer_params(layer) for layer in decoder.layers]
    if any(own is None for own in layers) or len({type(linears[0]) for _, linears in layers}) > 1:
        return None  # another kind of block, or int8 and float32 layers mixed
    attn = decoder.layers[0].self_attn
    tensors = [t for own, _ in layers for t in tensors_of(own)]
    if not (attn.d_k % 16 == 0 and attn.d_k <= 256 and matvec._inference(*tensors)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)):
        return None
    floats, int8_panels = layout(rows)
    quantized = type(layers[0][1][0]) is Int8Linear  # (the checks above read its float32 copy of W)
    if quantized and rows > matvec.MAX_ROWS and not int8_panels:
        return None
    planned = []
    for own, linears in layers:
        laid_out = {}
        for name, m in zip(PRODUCTS, linears):
            bias = getattr(own, name).bias
            if quantized:
                laid_out[name] = Product(matvec.int8_panels(m._int8) if int8_panels else m._int8, bias, m._scales,
                                         m._sums)
            else:
                laid_out[name] = Product(matvec.panels(m.weight) if floats else m.weight, bias)
        planned.append(own._replace(**laid_out))
    to_huge_pages(t for own in planned for t in tensors_of(own))  # the panels' copies (the model's weights are there)
    return planned


def step(decoder: nn.Module, x: Tensor, mask: Tensor | None, state: DecoderState | None,
         positions: RelativeTerms | None) -> Tensor | None:
    """The residual stream after every layer for ``x`` (rows, 1, d_model), the new tokens embedded,
    extending ``state``'s caches; None where the whole-step kernel does not apply (the caller then
    runs the layers one by one): among others, a step given a self-attention ``mask`` (the kernel
    has none: every new token sees its whole cache)."""
    if (mask is not None or state is None or state.group != 1 or x.size(1) != 1
            or not 0 < x.size(0) <= matvec.PANEL_ROWS
            or not matvec._inference(x) or x.device.type != "cpu" or positions is None
            or positions.rotary is None or not matvec.eager()):
        return None
    caches = state.self_caches
    if not (all(type(c) is KVCache and len(c) for c in caches) and caches[0].rows == x.size(0)):
        return None  # (a state's caches hold the same rows)
    rows = x.size(0)
    if state.fused is None or (state.fused and state.fused[0] != layout(rows)):  # once per decoding and layout:
        planned = plan(decoder, rows)                                            # the model does not change
        state.fused = False if planned is None else (layout(rows), for_kernel(planned))  # while it decodes
        if state.fused and not _whole_step_wins(decoder, rows, planned, state.fused):
            state.fused = False
    if state.fused is False:
        return None
    start = len(caches[0])
    rooms = [cache.room(start + 1) for cache in caches]
    cos, sin = positions.rotary
    _, layers = state.fused
    starts = torch.full((rows,), start, dtype=torch.long)
    out = run_step(decoder, x.reshape(rows, -1), layers, [r[0] for r in rooms], [r[1] for r in rooms], starts,
                   cos.expand(rows, -1).contiguous(), sin.expand(rows, -1).contiguous())
    for cache in caches:
        cache.written(start + 1)
    return out.view_as(x)


def run_step(decoder: nn.Module, x: Tensor, layers: list, keys: list[Tensor], values: list[Tensor], starts: Tensor,
             cos: Tensor, sin: Tensor) -> Tensor:
    """matvec.cpp's ``decoder_step``: ``x`` (rows, d_model) the new tokens embedded, ``layers`` a plan's
    (``for_kernel``), per layer the key and value buffers (rows, kv heads, capacity, d_k), row r's new key
    written at ``starts[r]`` and its query seeing the keys before it too, ``cos``, ``sin`` (rows, d_k) each
    row's angles; the residual stream after every layer."""
    attn = decoder.layers[0].self_attn
    return matvec.KERNELS.decoder_step(x, layers, keys, values, starts, cos, sin, attn.h, attn.g,
                                       decoder.layers[0].res_self.norm.eps or torch.finfo(torch.float32).eps,
                                       attn.d_k ** -0.5 if attn.scale is None else attn.scale)


def warm(model: nn.Module, rows: tuple[int, ...] = (1,)) -> list[tuple[int, bool]]:
    """Make the whole-step choice of a decoder-only ``model`` (``_whole_step_wins``: timed once per shape,
    recorded) at each number of ``rows``, as its first decoding step would: (rows, whether the whole step
    is used) where it applies. The server calls it before it listens (serve/run.py), with ``matvec.warm``."""
    decoder = getattr(model, "decoder", None)
    if decoder is None or getattr(model.cfg, "arch", None) != "decoder":
        return []
    made = []
    with torch.no_grad():
        for r in rows:
            planned = plan(decoder, r)
            if planned is not None:
                made.append((r, _whole_step_wins(decoder, r, planned, (layout(r), for_kernel(planned)))))
    return made


def _whole_step_wins(decoder: nn.Module, rows: int, planned: list[LayerParams], fused: tuple) -> bool:
    """Whether the whole-step kernel is the faster way to decode ``rows`` rows of ``decoder`` here
    (``matvec.Kernels.whole_step_wins``, measured once per shape and recorded); int8 layers take it
    wherever it applies (their products are not measured)."""
    if planned[0].qkv.scales.numel():  # int8
        return True
    attn = decoder.layers[0].self_attn
    shapes = " ".join(f"{n}x{k}" for n, k in matvec.shapes_of(decoder.layers[0]))
    key = (f"{len(planned)} layers of {shapes}, heads {attn.h}/{attn.g} of {attn.d_k}, rows {rows}, threads "
           f"{torch.get_num_threads()}")
    return matvec.KERNELS.whole_step_wins(key, lambda: _time_whole_step(decoder, rows, fused))


def _time_whole_step(decoder: nn.Module, rows: int, fused: tuple, steps: int = 8,
                     rounds: int = 3) -> tuple[float, float]:
    """The median seconds of a decoding step of ``rows`` rows of ``decoder``, by the whole-step kernel
    (``fused``, as ``DecoderState.fused`` holds it) and layer by layer, rounds interleaved, each from a
    fresh cache of one token (token 0, which every vocabulary has)."""
    import statistics
    import time

    ids = torch.zeros(rows, 1, dtype=torch.long)

    def seconds(whole: bool) -> float:
        n = len(decoder.layers)
        state = DecoderState(None, [KVCache() for _ in range(n)], [KVCache() for _ in range(n)])
        state.fused = fused if whole else False
        with torch.inference_mode():
            decoder(ids, None, None, None, state, first=False)  # the first token: an empty cache, layer by layer
            start = time.perf_counter()
            for _ in range(steps):
                decoder(ids, None, None, None, state, first=False)
        return (time.perf_counter() - start) / steps

    seconds(True), seconds(False)  # warming up (and the products' own choices, made once)
    times = [(seconds(True), seconds(False)) for _ in range(rounds)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

