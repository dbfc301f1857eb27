"""Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity"): eq. (1) over keys
and values shortened along the length from n to k = ``proj_len`` by learned projections E and F,

    head_i = softmax(Q W_i^Q (E_i K W_i^K)ᵀ / √d_k) · F_i V W_i^V            (§4, eq. 7)

so the scores are (n × k), not (n × n). E and F have ``max_len`` columns; a shorter input uses the
first n of them, which is what the paper's zero-padding of K and V to ``max_len`` computes. The
keys of one position mix with every other position's, so Linformer is an encoder's attention only:
it cannot be causal. The sharing options of §4 ("parameter sharing") choose how many E, F there are.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ...errors import AtencionError
from ..attention import check_mask, scaled_dot_product_attention

SHARING = ("none", "headwise", "kv", "layerwise")
CAUSAL_REFUSED = ("model.attention.kind: linformer projects keys along the whole length, so it cannot be "
                  "causal (a decoder); use window, performer or flash")


class LinformerProjection(nn.Module):
    """§4's projections E, F ∈ R^(k × max_len), shared as the paper's options say.

    ``sharing``: ``none`` — a pair E_i, F_i per head, shape (heads, proj_len, max_len); ``headwise``
    (the default) — one pair per layer, shared across heads, (proj_len, max_len) each; ``kv`` — one
    matrix E = F per layer, shared across heads; ``layerwise`` — one E = F for the whole model: this
    module holds it like ``kv`` does, and the model passes the same instance to every layer, so its
    parameter is one tensor whose gradient sums the layers'. The entries start i.i.d. N(0, 1/k), the
    random projection of the paper's Theorem 1 (the Johnson–Lindenstrauss argument), then are learned.
    """

    def __init__(self, n_heads: int, max_len: int, proj_len: int, sharing: str = "headwise",
                 causal: bool = False):
        super().__init__()
        if causal:
            raise AtencionError(CAUSAL_REFUSED)
        for name, value in (("proj_len", proj_len), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AtencionError(f"model.attention.{name} must be an integer >= 1, got {value!r}")
        if sharing not in SHARING:
            raise AtencionError(f"model.attention.sharing must be one of {', '.join(SHARING)}; got {sharing!r}")
        self.n_heads, self.max_len, self.proj_len, self.sharing = n_heads, max_len, proj_len, sharing
        shape = (n_heads, proj_len, max_len) if sharing == "none" else (proj_len, max_len)
        self.E = nn.Parameter(torch.randn(shape) / math.sqrt(proj_len))
        self.F = nn.Parameter(torch.randn(shape) / math.sqrt(proj_len)) if sharing in ("none", "headwise") else None

    def forward(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """(E K, F V): keys and values (batch, heads, n, d_k) shortened to (batch, heads, proj_len, d_k)."""
        n = k.size(-2)
        if n > self.max_len:
            raise AtencionError(f"linformer got an input of {n} positions, but E and F cover "
                                f"max_len = {self.max_len}; shorten the input or raise max_len")
        e = self.E[..., :n].to(k.dtype)  # the first n columns: K zero-padded to max_len, as the paper pads
        f = e if self.F is None else self.F[..., :n].to(v.dtype)
        return e @ k, f @ v  # (k × n) @ (batch, heads, n, d_k); per head when sharing is "none"

    def extra_repr(self) -> str:
        return f"heads={self.n_heads}, max_len={self.max_len}, proj_len={self.proj_len}, sharing={self.sharing}"


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: LinformerProjection,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Linformer's eq. (7): softmax(Q (E K)ᵀ · scale) (F V) over tensors of shape (batch, heads, length, d_k).

    ``mask``: a key-padding mask (True = a real position) of shape (batch, 1, 1, n) or (batch, heads,
    1, n); the masked keys and values are zeroed before E and F mix them, as the reference
    implementations do, so padding has no effect on the result. A mask that differs by query (a causal
    one) cannot pass through the projection and is refused. With ``need_weights`` the weights come back
    as (batch, heads, queries, proj_len): over the projected keys, not the positions.
    """
    if causal:
        raise AtencionError(CAUSAL_REFUSED)
    if mask is not None:
        check_mask(mask, "linformer's mask", q.size(0), q.size(-2), k.size(-2))
        if mask.size(-2) != 1:
            raise AtencionError("linformer takes a key-padding mask (batch, 1, 1, keys) only: a mask that "
                                f"differs by query cannot pass through E and F; got shape {tuple(mask.shape)}")
        real = mask[..., 0, :, None]  # (batch, heads or 1, n, 1)
        k, v = k.masked_fill(~real, 0.0), v.masked_fill(~real, 0.0)
    k, v = projection(k, v)
    return scaled_dot_product_attention(q, k, v, None, dropout_p, need_weights, None, scale)
