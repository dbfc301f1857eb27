"""Scaled dot-product attention (eq. 1) and multi-head attention (§3.2.2).

Masks follow torch's convention for boolean ``attn_mask``: ``True`` means *may attend*.
A mask has four dimensions that broadcast to (batch, heads, queries, keys). The caches it reads
and writes while decoding, and the packing of an encoder's real positions, are speed machinery
that is not the paper: they live in cache.py.

Self-attention of another kind (``model.attention: {kind: ...}``) is a module of nn/kinds/ that
``MultiHeadAttention`` calls in place of ``scaled_dot_product_attention``, with the same queries,
keys and values; ``Block`` (layers.py) builds it once per layer from the kind's entry in the
registry ``ATTENTION_KINDS`` (nn/kinds/__init__.py says how to add one). Cross-attention is
always eq. (1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import AtencionError
from .cache import KVCache, Packing
from .matvec import Linear, attend_one, linear, rotate_
from .positional import rotate_half


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Eq. (1): softmax(Q Kᵀ / √d_k + B) V over tensors of shape (batch, heads, length, d_k).

    ``bias`` B, a float tensor broadcastable to (batch, heads, queries, keys), is a relative
    position term (ALiBi, T5); None for the paper's attention. Masked keys get exactly zero
    weight; a query whose keys are all masked gets zero weights and a zero output (never NaN).
    With ``need_weights`` the explicit path runs and returns the weights (batch, heads, queries,
    keys); otherwise torch's fused kernel runs and the weights are ``None``. Both paths compute
    the same function. ``scale`` replaces 1/√d_k (T5 uses 1: it folds the scaling into its
    initialisation). ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention:
    :func:`repeat_kv`); the fused kernel reads them shared, without copying.
    """
    if need_weights:
        return _explicit_attention(q, k, v, mask, dropout_p, bias, scale)
    grouped = k.size(1) != q.size(1)
    if mask is None and bias is None and dropout_p == 0.0 and (out := attend_one(q, k, v, scale)) is not None:
        return out, None  # a generation step on the CPU: one query per head
    if mask is None:
        attn_mask = None if bias is None else bias.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=grouped), None
    # A row with no visible key would be NaN in the fused kernel: let it see every key, then
    # zero its output, which is what the explicit path gives.
    visible = mask.any(dim=-1, keepdim=True)
    allowed = mask | ~visible
    if bias is not None:  # the fused kernel takes one float mask: the bias, -inf where not allowed
        allowed = bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=grouped)
    return out * visible, None


def repeat_kv(x: Tensor, heads: int) -> Tensor:
    """Grouped-query attention (Ainslie et al. 2023): keys or values of g heads (batch, g, length,
    d_k) as ``heads`` heads, key/value head j serving query heads j·heads/g … (j+1)·heads/g − 1
    (Hugging Face's ``repeat_kv``); as they are when g = heads."""
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


def _explicit_attention(q, k, v, mask, dropout_p, bias=None, scale=None):
    k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
    scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)  # also turns all-masked rows (NaN) into zeros
    attended = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return attended @ v, weights


def causal_mask(length: int, offset: int = 0, device=None) -> Tensor:
    """(1, 1, length, offset+length): query i (at position offset+i) sees keys 0 … offset+i."""
    keys = torch.arange(offset + length, device=device)
    queries = torch.arange(offset, offset + length, device=device)
    return (keys[None, :] <= queries[:, None])[None, None]


def check_mask(mask: Tensor | None, name: str, batch: int, queries: int, keys: int) -> None:
    """Raise a ValueError unless ``mask`` is a boolean tensor that broadcasts to (batch, h, q, k)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise AtencionError(f"{name} must be a torch.bool tensor (True = may attend), got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)}")
    expected = (batch, None, queries, keys)
    ok = mask.dim() == 4 and all(
        size == 1 or want is None or size == want for size, want in zip(mask.shape, expected)
    )
    if not ok:
        raise AtencionError(
            f"{name} has shape {tuple(mask.shape)}; expected 4 dimensions broadcastable to "
            f"(batch={batch}, heads, queries={queries}, keys={keys}), each 1 or that size"
        )


def project_rows(layer: nn.Module, x: Tensor, start: int, stop: int) -> Tensor:
    """Output features ``start:stop`` of the linear layer ``layer`` at ``x``, computing only those:
    cross-attention takes its queries from the first third of ``in_proj`` and its keys and
    values from the rest. A layer with a ``rows`` method (LoRA, int8) computes them its own way;
    any other wrapper computes all outputs and slices them."""
    if type(layer) in (nn.Linear, Linear):
        bias = None if layer.bias is None else layer.bias[start:stop]
        return linear(x, layer.weight[start:stop], bias)
    if hasattr(layer, "rows"):
        return layer.rows(x, start, stop)
    return layer(x)[..., start:stop]


@dataclass
class RelativeTerms:
    """Where one self-attention call's queries and keys are, and what relative positions add to it:
    RoPE's angles of the new positions (``rotary``: cos, sin, (new, d_k)) and the score bias of
    ``relative`` (ALiBi, T5: its ``bias(q_pos, k_pos, causal)``). A stack builds them once per
    forward pass, and every layer uses them: eq. (1) reads the bias in the layout of the scores
    (1, heads, queries, keys), computed once; a kind that never builds the scores (nn/kinds/)
    reads it per tile through :meth:`bias_fn`. ``q_pos``/``k_pos``: the positions of the queries
    and keys in the order the layer sees them (a beam's rows: stacked by slot, interleaved)."""

    rotary: tuple[Tensor, Tensor] | None = None
    relative: nn.Module | None = None
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    causal: bool = False
    _bias: Tensor | None = field(default=None, repr=False)

    def rotate(self, x: Tensor) -> Tensor:
        """(x · cos) + (rotate_half(x) · sin): x turned by the angles of its positions."""
        cos, sin = self.rotary
        return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)

    @property
    def bias(self) -> Tensor | None:
        """The score bias (1, heads, queries, keys), or None."""
        if self.relative is None:
            return None
        if self._bias is None:
            self._bias = self.relative.bias(self.q_pos, self.k_pos, self.causal)[None]
        return self._bias

    def bias_fn(self, k_len: int):
        """The bias as a function of query and key indices, ``(q_index, k_index) → (heads, Lq, Lk)``,
        for ``k_len`` keys that are the last ``k_len`` of ``k_pos`` (a rolling cache keeps the last
        ones); None without a bias."""
        if self.relative is None:
            return None
        q_pos, k_pos = self.q_pos, self.k_pos[-k_len:]
        return lambda q_index, k_index: self.relative.bias(q_pos[q_index], k_pos[k_index], self.causal)

    def bias_params(self) -> tuple[Tensor, ...]:
        """The learned tensors the bias is made of (T5's table), for kinds that compute their own
        gradients."""
        return () if self.relative is None else tuple(p for p in self.relative.parameters() if p.requires_grad)


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1, …, head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    ``in_proj`` holds W^Q, W^K and W^V of all heads stacked as [Q; K; V] (the layout of
    torch.nn.MultiheadAttention), so self-attention projects once. With ``cross=True`` this is
    encoder-decoder attention: queries come from ``x`` (the decoder), keys and values from
    ``memory`` (the encoder).

    With ``n_kv_heads`` g < h (self-attention only), grouped-query attention (Ainslie et al. 2023):
    ``in_proj`` stacks [W^Q (h·d_k rows); W^K (g·d_k); W^V (g·d_k)], still one layer, and each
    key/value head serves h / g query heads; the cache keeps g heads. ``qkv_bias`` gives ``in_proj``
    a bias whatever ``bias`` says (Qwen2).
    """

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0,
                 bias: bool = True, cross: bool = False, scale: bool = True, kind: nn.Module | None = None,
                 n_kv_heads: int | None = None, qkv_bias: bool = False):
        super().__init__()
        if d_model % n_heads != 0:
            raise AtencionError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.h, self.d_k = d_model, n_heads, d_model // n_heads
        self.g = n_heads if n_kv_heads is None else n_kv_heads
        if cross and self.g != n_heads:
            raise AtencionError("cross-attention has n_heads key/value heads: grouped-query attention is for "
                                "self-attention")
        self.attention_dropout = attention_dropout
        self.scale = None if scale else 1.0  # None: eq. (1)'s 1/√d_k
        self.cross = cross
        self.kind = kind  # nn/kinds/: how self-attention is computed, if not by eq. (1) itself
        self.in_proj = Linear(d_model, (n_heads + 2 * self.g) * self.d_k, bias=bias or qkv_bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
        packing: Packing | None = None,
        positions: RelativeTerms | None = None,
        prefix: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` (batch, q_len, d_model) to itself, or to ``memory`` (cross).

        With a ``cache``, self-attention appends the new keys/values to it; cross-attention
        fills an empty cache from ``memory`` once and then reuses it (``memory`` may be None).
        With a ``packing`` (self-attention without a cache), ``x`` holds the real positions only,
        (n, d_model), and so does the result. ``positions``: relative positions of self-attention
        (RoPE turns the new queries and keys before they are cached; ALiBi and T5 add a bias).
        ``prefix``: keys and values (1, h, P, d_k) put before the new ones, unturned (prefix-tuning,
        nn/prefix.py); with a cache they enter it, at the first step.
        """
        if self.cross:
            (q, k, v), bias = self._cross_qkv(x, memory, cache), None
        else:
            q, k, v, bias = self._self_qkv(x, packing, positions, prefix)
            if self.kind is not None:
                return self._kind_attention(q, k, v, mask, cache, need_weights, packing, positions)
            if cache is not None:
                k, v = cache.append(k, v)
        dropout_p = self.attention_dropout if self.training else 0.0
        group = q.size(0) // k.size(0)  # several query rows per key row (beams of one sentence)
        out, weights = scaled_dot_product_attention(stack_beams(q, group), k, v, mask, dropout_p, need_weights,
                                                    bias, self.scale)
        return self._output(unstack_beams(out, group), packing), unstack_beams(weights, group)

    def _self_qkv(self, x, packing, positions, prefix):
        """Self-attention's queries, keys and values from ``x`` (the positions turned, a prefix's keys
        first), and the score bias of the relative positions (or None)."""
        projected = self.in_proj(x)
        if packing is not None:
            projected = packing.unpack(projected)
        # RoPE: the queries' and keys' heads turned in place in one call where the kernel applies
        turned = positions is not None and positions.rotary is not None and \
            rotate_(projected, self.h + self.g, self.d_k, *positions.rotary)
        q, k, v = self._split(projected)
        bias = None
        if positions is not None:
            if positions.rotary is not None and not turned:
                q, k = positions.rotate(q), positions.rotate(k)
            bias = positions.bias
        if prefix is not None:
            rows = k.size(0)
            k, v = (torch.cat([before.expand(rows, -1, -1, -1).to(now.dtype), now], dim=2)
                    for before, now in zip(prefix, (k, v)))
        return q, k, v, bias

    def _cross_qkv(self, x, memory, cache):
        """Cross-attention's queries from ``x``, keys and values from ``memory`` or, once filled, the cache."""
        q = self._heads(project_rows(self.in_proj, x, 0, self.d_model), 1)[0]
        if cache is not None and len(cache):
            return q, cache.k, cache.v
        if memory is None:
            raise AtencionError("cross-attention needs the encoder output `memory` or a filled cache")
        k, v = self._heads(project_rows(self.in_proj, memory, self.d_model, 3 * self.d_model), 2).unbind(0)
        if cache is not None:
            cache.append(k, v)
        return q, k, v

    def _kind_attention(self, q, k, v, mask, cache, need_weights, packing, positions):
        """Self-attention computed by ``self.kind`` (nn/kinds/), with its own cache when decoding."""
        if cache is not None:
            out, weights = self.kind.decode(q, k, v, mask, cache, positions, self.scale), None
        else:
            if mask is not None and mask.size(-2) != 1 and not self.kind.general_masks:
                raise AtencionError(f"attention.kind {self.kind.name} takes a key-padding mask (batch, 1, 1, keys) "
                                    f"and the causal mask it builds itself, got a mask of shape {tuple(mask.shape)}")
            dropout_p = self.attention_dropout if self.training else 0.0
            k, v = repeat_kv(k, self.h), repeat_kv(v, self.h)
            out, weights = self.kind(q, k, v, mask, positions, dropout_p, self.scale, need_weights)
        return self._output(out, packing), weights

    def _output(self, out: Tensor, packing: Packing | None) -> Tensor:
        """The heads concatenated (batch, length, d_model) and projected by W^O."""
        out = out.transpose(1, 2).reshape(out.size(0), out.size(2), self.d_model)
        if packing is not None:
            out = packing.pack(out)
        return self.out_proj(out)

    def _split(self, projected: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``in_proj``'s output (batch, length, (h + 2g)·d_k) → q (batch, h, length, d_k), k and v
        (batch, g, length, d_k): views, laid out as :meth:`_heads` lays them out when g = h (every
        head at once, then one split: three calls, which a decoding step makes in every layer; and one
        gradient, as the split's)."""
        b, t, _ = projected.shape
        heads = projected.view(b, t, self.h + 2 * self.g, self.d_k).transpose(1, 2)
        return heads.split_with_sizes([self.h, self.g, self.g], dim=1)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        """(batch, length, n·d_model) → (n, batch, h, length, d_k)."""
        b, t, _ = x.shape
        return x.view(b, t, n, self.h, self.d_k).permute(2, 0, 3, 1, 4)


def stack_beams(q: Tensor, group: int) -> Tensor:
    """(b · group, h, t, d) → (b, h, group · t, d): the queries of a beam's ``group`` rows, which
    share one row of keys, stacked as the rows of one sentence (query ``slot · t + l``)."""
    if group == 1:
        return q
    rows, h, t, d = q.shape
    return q.view(rows // group, group, h, t, d).transpose(1, 2).reshape(rows // group, h, group * t, d)


def unstack_beams(x: Tensor | None, group: int) -> Tensor | None:
    """The inverse of :func:`stack_beams`, for outputs (…, d) and weights (…, keys) alike."""
    if x is None or group == 1:
        return x
    b, h, _, last = x.shape
    return x.view(b, h, group, -1, last).transpose(1, 2).reshape(b * group, h, -1, last)
