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

import torch
from torch import Tensor, nn

from . import matvec
from .attention import RelativeTerms
from .cache import DecoderState, KVCache
from .layers import ACTIVATIONS, GatedFeedForward
from .positional import RotaryPositions
from .quantize import Int8Linear

_NO_BIAS = torch.empty(0)
_WEIGHTS = (1, 3, 6, 8, 10)  # W^QKV, W^O, W1, W3, W2 among a layer's 12 tensors


def _layer_params(layer: nn.Module) -> tuple[list[Tensor], list[nn.Module]] | None:
    """One block's 12 tensors in ``decoder_step``'s order, its weights as they are, and its 5 linear
    layers; or None if it is not a Llama block."""
    attn, ffn = layer.self_attn, layer.ffn
    linears = (attn.in_proj, attn.out_proj) + ((ffn.linear1, ffn.linear3, ffn.linear2)
                                               if isinstance(ffn, GatedFeedForward) else ())
    if not (len(linears) == 5 and (all(type(m) is matvec.Linear for m in linears)  # not LoRA
                                   or all(type(m) is Int8Linear for m in linears))
            and ffn.activation is ACTIVATIONS["swiglu"] and layer.cross_attn is None and attn.kind is None
            and layer.res_self.norm_first and type(layer.res_self.norm) is matvec.RMSNorm
            and type(layer.res_ffn.norm) is matvec.RMSNorm and layer.res_self.norm.eps == layer.res_ffn.norm.eps):
        return None

    def bias(m: nn.Module) -> Tensor:
        return _NO_BIAS if m.bias is None else m.bias

    w_qkv, w_o, w1, w3, w2 = linears
    return [layer.res_self.norm.weight, w_qkv.weight, bias(w_qkv), w_o.weight, bias(w_o),
            layer.res_ffn.norm.weight, w1.weight, bias(w1), w3.weight, bias(w3), w2.weight, bias(w2)], list(linears)


def layout(rows: int) -> tuple[bool, bool]:
    """Whether ``rows`` rows take the float32 weights in panels (past ``MAX_ROWS``) and the int8 ones
    in int8 panels (from ``matvec._int8_panels_from``): where each beats the dot products."""
    return rows > matvec.MAX_ROWS, matvec._int8_panels_kernel is not None and rows >= matvec._int8_panels_from


def plan(decoder: nn.Module, rows: int) -> tuple[list[Tensor], list[Tensor]] | None:
    """Every layer's parameters in ``decoder_step``'s order for ``rows`` rows, and its int8 weights'
    scales and sums (empty tensors for float32 ones); each weight laid out as ``layout`` says
    (``matvec.panels`` and ``int8_panels``: a second copy, made once); or None where the step
    cannot run there (another kind of block or positions, virtual tokens, training, gradients, not
    float32 or int8 on a CPU)."""
    if (os.environ.get("ATENCION_FUSED", "1") == "0" or decoder.training or decoder.positions is not None
            or not isinstance(decoder.relative, RotaryPositions) or decoder.embed_norm is not None
            or decoder.prefix is not None or decoder.prompt is not None or matvec.kernel() is None
            or matvec._decoder_step is None):
        return None
    layers = [_layer_params(layer) for layer in decoder.layers]
    if any(own is None for own in layers) or len({type(linears[0]) for _, linears in layers}) > 1:
        return None  # another kind of block, or int8 and float32 layers mixed
    attn = decoder.layers[0].self_attn
    tensors = [t for own, _ in layers for t in own]
    if not (attn.d_k % 16 == 0 and attn.d_k <= 256 and matvec._inference(*tensors)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)):
        return None
    floats, int8_panels = layout(rows)
    quantized = type(layers[0][1][0]) is Int8Linear  # (the checks above read its float32 copy of W)
    if quantized and rows > matvec.MAX_ROWS and not int8_panels:
        return None
    params, int8 = [], []
    for own, linears in layers:
        if quantized:
            for i, m in zip(_WEIGHTS, linears):
                own[i] = matvec.int8_panels(m._int8) if int8_panels else m._int8
                int8 += [m._scales, m._sums]
        else:
            own = [matvec.panels(p) if floats and i in _WEIGHTS else p for i, p in enumerate(own)]
            int8 += [_NO_BIAS] * 10
        params += own
    return params, int8


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
        state.fused = False if planned is None else (layout(rows), *planned)     # while it decodes
    if state.fused is False:
        return None
    start = len(caches[0])
    rooms = [cache.room(start + 1) for cache in caches]
    attn = decoder.layers[0].self_attn
    cos, sin = positions.rotary
    _, params, int8 = state.fused
    out = matvec._decoder_step(x.reshape(rows, -1), params, int8, [r[0] for r in rooms], [r[1] for r in rooms],
                               start, cos.contiguous(), sin.contiguous(), attn.h, attn.g,
                               decoder.layers[0].res_self.norm.eps or torch.finfo(torch.float32).eps,
                               attn.d_k ** -0.5 if attn.scale is None else attn.scale)
    for cache in caches:
        cache.written(start + 1)
    return out.view_as(x)
