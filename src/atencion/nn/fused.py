"""A generation step of a Llama-style decoder through all its layers in one call.

Generating a token at batch 1 reads every weight once (about 20 ms for SmolLM-135M's 540 MB on the
machines of docs/results.md), and the layer-by-layer path adds dozens of PyTorch calls per layer
around its products (norms, views, the cache's bookkeeping, residual sums), a few microseconds each:
for 30 layers, a quarter of the step. ``matvec.cpp``'s ``decoder_step`` runs the same products and
kernels (dot products or panels, RMSNorm, RoPE, attention over the cache) for every layer in one call,
writing each new key and value into the cache's buffers (nn/cache.py ``KVCache.room``).

It applies to the step of up to ``PANEL_ROWS`` rows, one new token each, of a decoder-only model whose
every layer is Llama's (pre-norm RMSNorm, self-attention with RoPE and any number of key/value heads,
SwiGLU feed-forward; biases allowed, as Qwen2's on q/k/v), in inference, float32 on a CPU where the
kernels compiled with AVX-512. Everything else takes the layer-by-layer path, and so does everything
with ``ATENCION_FUSED=0`` in the environment. The two compute the same products in the same order;
SiLU's exponential may differ in the last bit."""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from . import matvec
from .attention import RelativeTerms
from .cache import DecoderState, KVCache
from .layers import ACTIVATIONS, GatedFeedForward
from .positional import RotaryPositions

_NO_BIAS = torch.empty(0)


def _layer_params(layer: nn.Module) -> list[Tensor] | None:
    """One block's 12 tensors in ``decoder_step``'s order, or None if it is not a Llama block."""
    attn, ffn = layer.self_attn, layer.ffn
    linears = (attn.in_proj, attn.out_proj) + ((ffn.linear1, ffn.linear3, ffn.linear2)
                                               if isinstance(ffn, GatedFeedForward) else ())
    if not (len(linears) == 5 and all(type(m) is matvec.Linear for m in linears)  # not LoRA, not int8
            and ffn.activation is ACTIVATIONS["swiglu"] and layer.cross_attn is None and attn.kind is None
            and layer.res_self.norm_first and type(layer.res_self.norm) is matvec.RMSNorm
            and type(layer.res_ffn.norm) is matvec.RMSNorm and layer.res_self.norm.eps == layer.res_ffn.norm.eps):
        return None

    def bias(m: nn.Linear) -> Tensor:
        return _NO_BIAS if m.bias is None else m.bias

    return [layer.res_self.norm.weight, attn.in_proj.weight, bias(attn.in_proj), attn.out_proj.weight,
            bias(attn.out_proj), layer.res_ffn.norm.weight, ffn.linear1.weight, bias(ffn.linear1),
            ffn.linear3.weight, bias(ffn.linear3), ffn.linear2.weight, bias(ffn.linear2)]


def plan(decoder: nn.Module, rows: int) -> list[Tensor] | None:
    """Every layer's parameters in ``decoder_step``'s order for ``rows`` rows, the weights as they are
    for up to ``MAX_ROWS`` (dot products) and in panels for more (``matvec.panels``: a second copy of
    each, made once), or None where the step cannot run there (another kind of block or positions,
    virtual tokens, training, gradients, not float32 on a CPU)."""
    if (os.environ.get("ATENCION_FUSED", "1") == "0" or decoder.training or decoder.positions is not None
            or not isinstance(decoder.relative, RotaryPositions) or decoder.embed_norm is not None
            or decoder.prefix is not None or decoder.prompt is not None or matvec.kernel() is None
            or matvec._decoder_step is None):
        return None
    params = []
    for layer in decoder.layers:
        own = _layer_params(layer)
        if own is None:
            return None
        params += own
    attn = decoder.layers[0].self_attn
    if not (attn.d_k % 16 == 0 and attn.d_k <= 256 and matvec._inference(*params)
            and all(p.device.type == "cpu" and p.is_contiguous() for p in params)):
        return None
    if rows > matvec.MAX_ROWS:
        params = [matvec.panels(p) if i % 12 in (1, 3, 6, 8, 10) else p for i, p in enumerate(params)]
    return params


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
    if not all(type(c) is KVCache and c.k is not None and c.k.size(0) == x.size(0) for c in caches):
        return None
    rows = x.size(0)
    panelled = rows > matvec.MAX_ROWS
    if state.fused is None or (state.fused and state.fused[0] != panelled):  # once per decoding and layout:
        params = plan(decoder, rows)                                         # the model does not change
        state.fused = False if params is None else (panelled, params)        # while it decodes
    if state.fused is False:
        return None
    start = len(caches[0])
    rooms = [cache.room(start + 1) for cache in caches]
    attn = decoder.layers[0].self_attn
    cos, sin = positions.rotary
    out = matvec._decoder_step(x.reshape(rows, -1), state.fused[1], [r[0] for r in rooms], [r[1] for r in rooms],
                               start, cos.contiguous(), sin.contiguous(), attn.h, attn.g,
                               decoder.layers[0].res_self.norm.eps or torch.finfo(torch.float32).eps,
                               attn.d_k ** -0.5 if attn.scale is None else attn.scale)
    for cache in caches:
        cache.written(start + 1)
    return out.view_as(x)
