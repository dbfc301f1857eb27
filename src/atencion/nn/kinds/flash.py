"""FlashAttention (Dao et al. 2022): exact attention, eq. (1), computed in tiles with the online
softmax, so that the n × n matrix of scores is never held — only one tile of it at a time.

Forward (the paper's Algorithms 1–2, with the loops in FlashAttention-2's order: query tiles
outer). A query tile Q_i walks over the key tiles K_j, V_j keeping, per query row, the running
maximum m of its scores, the running sum ℓ of exp(S − m) and the unnormalised output; when a new
tile raises the maximum, what was summed is rescaled by exp(m_old − m_new). At the end the output
is divided by ℓ, and one log-sum-exp L = m + log ℓ per row is kept (as FlashAttention-2 does).

Backward (Algorithm 4: key tiles outer). Every tile's weights are recomputed from the saved L,
P_ij = exp(S_ij − L_i), and with D_i = rowsum(dO_i ∘ O_i):
dV_j += P_ijᵀ dO_i,  dP_ij = dO_i V_jᵀ,  dS_ij = P_ij ∘ (dP_ij − D_i),  dQ_i += scale · dS_ij K_j,
dK_j += scale · dS_ijᵀ Q_i. Dropout multiplies P_ij by a keep-mask Z_ij / (1 − p) that each tile
regenerates from a seed and its index, in forward and backward alike.

Memory is O(n · tile) instead of O(n²): the inputs, the output, their gradients and L are O(n),
and a few tiles of (batch, heads, q_tile, k_tile) are alive at a time. With ``causal``, the tiles
entirely in the future are skipped, about half of them. The loops over tiles are Python loops, so
this is a readable reference for the algorithm, not a fused kernel: its gain is memory, not speed.

Measured on one thread of this project's shared 2-core CPU (batch 1, 4 heads, n = 4,096, d_k = 64,
tiles of 128, one forward + backward, median of 5 after a warm-up, two runs): 1.07–2.05 s against
0.95–1.42 s for torch's fused F.scaled_dot_product_attention, 1.1–1.45× its time; with causal=True
0.82–1.04 s against 0.65–0.87 s (1.2–1.3×). Peak memory of one forward + backward at n = 8,192,
d_k = 64, one head (the measurement of tests/test_flash.py): 17 MB, against 817 MB for eq. (1)
computed explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import AtencionError

BiasFn = Callable[[Tensor, Tensor], Tensor]  # (q_index (Lq,), k_index (Lk,)) -> (heads, Lq, Lk)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
                    bias: Tensor | BiasFn | None = None, bias_params: Sequence[Tensor] = (),
                    dropout_p: float = 0.0, scale: float | None = None, q_tile: int = 128,
                    k_tile: int = 128) -> Tensor:
    """Eq. (1), softmax(scale · Q Kᵀ + B) V over (batch, heads, length, d_k), computed in tiles of
    ``q_tile`` queries × ``k_tile`` keys (FlashAttention); returns (batch, heads, q_len, d_v).

    ``mask`` (bool, True = may attend) broadcasts to (batch, heads, q_len, k_len); ``causal`` lets
    query i, at position k_len − q_len + i, see keys j ≤ that position. A query that sees no key
    gets a zero output and zero gradients. ``bias`` is a tensor broadcastable to the scores, or a
    callable giving the (heads, Lq, Lk) bias of query and key indices, computed per tile, whose
    learnable tensors are ``bias_params``. ``dropout_p`` drops attention weights as F.dropout does.
    """
    for name, value in (("q_tile", q_tile), ("k_tile", k_tile)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AtencionError(f"model.attention.{name} must be an integer >= 1, got {value!r}")
    if not 0.0 <= dropout_p <= 1.0:
        raise AtencionError(f"attention dropout must be a probability in [0, 1], got {dropout_p}")
    tensor_bias = _as_4d(bias) if isinstance(bias, Tensor) else None
    tiles = Tiles(
        q_len=q.size(-2), k_len=k.size(-2), q_tile=q_tile, k_tile=k_tile,
        scale=1 / math.sqrt(q.size(-1)) if scale is None else scale, causal=causal,
        mask=None if mask is None else _as_4d(mask), bias=tensor_bias,
        bias_fn=None if bias is None or isinstance(bias, Tensor) else bias,
        dropout_p=dropout_p, seed=draw_dropout_seed() if dropout_p > 0 else 0,
    )
    bias_params = tuple(bias_params)
    inputs = (q, k, v, tensor_bias, *bias_params)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return _FlashAttention.apply(q, k, v, tensor_bias, tiles, *bias_params)
    return _forward(q, k, v, tiles)[0]  # inference: nothing is saved for a backward pass


# --------------------------------------------------------------------------- the tiles

@dataclass
class Tiles:
    """What every tile of one call shares, and the score tile S_ij = scale · Q_i K_jᵀ + B_ij it
    defines (−∞ where a key is masked or in the future)."""

    q_len: int
    k_len: int
    q_tile: int
    k_tile: int
    scale: float
    causal: bool
    mask: Tensor | None   # bool, 4-D, broadcastable to (batch, heads, q_len, k_len)
    bias: Tensor | None   # float, 4-D, broadcastable likewise
    bias_fn: BiasFn | None
    dropout_p: float
    seed: int

    @property
    def n_q(self) -> int:
        return -(-self.q_len // self.q_tile)

    @property
    def n_k(self) -> int:
        return -(-self.k_len // self.k_tile)

    def q_range(self, i: int) -> tuple[int, int]:
        return i * self.q_tile, min((i + 1) * self.q_tile, self.q_len)

    def k_range(self, j: int) -> tuple[int, int]:
        return j * self.k_tile, min((j + 1) * self.k_tile, self.k_len)

    def sees(self, i: int, j: int) -> bool:
        """False when causal and every key of tile j is in the future of every query of tile i."""
        return not self.causal or self.k_range(j)[0] <= self.k_len - self.q_len + self.q_range(i)[1] - 1

    def fn_bias(self, i: int, j: int, device) -> Tensor:
        """The callable bias of tile (i, j), (heads, Lq, Lk)."""
        (qs, qe), (ks, ke) = self.q_range(i), self.k_range(j)
        return self.bias_fn(torch.arange(qs, qe, device=device), torch.arange(ks, ke, device=device))

    def scores(self, qi: Tensor, kj: Tensor, i: int, j: int, fn_bias: Tensor | None = None) -> Tensor:
        """S_ij, (batch, heads, Lq, Lk); ``fn_bias`` is the callable's tile when already computed."""
        (qs, qe), (ks, ke) = self.q_range(i), self.k_range(j)
        s = (qi @ kj.transpose(-2, -1)) * self.scale
        if self.bias is not None:
            s = s + _tile_of(self.bias, qs, qe, ks, ke).to(s.dtype)
        if self.bias_fn is not None:
            s = s + (self.fn_bias(i, j, s.device) if fn_bias is None else fn_bias).to(s.dtype)
        visible = None if self.mask is None else _tile_of(self.mask, qs, qe, ks, ke)
        offset = self.k_len - self.q_len
        if self.causal and ke - 1 > offset + qs:  # some key of the tile is in some query's future
            positions = torch.arange(offset + qs, offset + qe, device=s.device)
            past = torch.arange(ks, ke, device=s.device)[None, :] <= positions[:, None]
            visible = past if visible is None else visible & past
        return s if visible is None else s.masked_fill(~visible, float("-inf"))

    def dropped(self, p: Tensor, i: int, j: int) -> Tensor:
        """P_ij ∘ Z_ij / (1 − p): the weights of tile (i, j) after dropout, as F.dropout scales them."""
        if self.dropout_p == 0:
            return p
        keep = tile_keep_mask(self.seed, i * self.n_k + j, p.shape, self.dropout_p, p.device)
        return p * keep.to(p.dtype) * (1 / (1 - self.dropout_p) if self.dropout_p < 1 else 0.0)


def draw_dropout_seed() -> int:
    """The seed of one call's dropout masks, drawn from torch's default generator."""
    return int(torch.randint(0, 2 ** 62, ()).item())


def tile_keep_mask(seed: int, tile: int, shape: Sequence[int], p: float, device=None) -> Tensor:
    """Dropout's keep-mask Z of one tile (True = kept, probability 1 − p), the same every time it is
    drawn: from a generator seeded with the call's seed plus the tile's index i · n_k + j."""
    generator = torch.Generator(device=device).manual_seed(seed + tile)
    return torch.rand(tuple(shape), generator=generator, device=device) >= p


def dropout_keep_mask(seed: int, batch: int, heads: int, q_len: int, k_len: int, p: float,
                      q_tile: int = 128, k_tile: int = 128, device=None) -> Tensor:
    """The whole (batch, heads, q_len, k_len) keep-mask that flash_attention drew with ``seed``,
    assembled from its tiles (for tests: it is n × n)."""
    n_q, n_k = -(-q_len // q_tile), -(-k_len // k_tile)
    rows = []
    for i in range(n_q):
        tq = min(q_tile, q_len - i * q_tile)
        rows.append(torch.cat([
            tile_keep_mask(seed, i * n_k + j, (batch, heads, tq, min(k_tile, k_len - j * k_tile)), p, device)
            for j in range(n_k)
        ], dim=-1))
    return torch.cat(rows, dim=-2)


def _as_4d(x: Tensor) -> Tensor:
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _tile_of(x: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """The view of the query rows qs:qe and key columns ks:ke of a 4-D tensor that broadcasts to
    the scores (a dimension of size 1 stays 1, so a key-padding mask costs nothing n × n)."""
    rows = slice(qs, qe) if x.size(-2) > 1 else slice(None)
    columns = slice(ks, ke) if x.size(-1) > 1 else slice(None)
    return x[:, :, rows, columns]


def _sum_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    """``x`` summed over the dimensions where ``shape`` (of the same rank) has 1: the gradient of a
    tensor that was broadcast to ``x``'s shape."""
    dims = [d for d, (want, have) in enumerate(zip(shape, x.shape)) if want == 1 and have != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precisions (the running statistics need its range), the input's otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# --------------------------------------------------------------------------- forward and backward

def _forward(q: Tensor, k: Tensor, v: Tensor, t: Tiles) -> tuple[Tensor, Tensor]:
    """Algorithms 1–2: the output (batch, heads, q_len, d_v) and each row's log-sum-exp L
    (batch, heads, q_len), +∞ for a row that sees no key (so that every exp(S − L) is 0)."""
    acc = _accumulation_dtype(q.dtype)
    batch, heads = q.shape[:2]
    out = q.new_empty(batch, heads, t.q_len, v.size(-1))
    lse = torch.empty(batch, heads, t.q_len, dtype=acc, device=q.device)
    for i in range(t.n_q):
        qs, qe = t.q_range(i)
        qi = q[:, :, qs:qe].to(acc)
        m = torch.full((batch, heads, qe - qs), float("-inf"), dtype=acc, device=q.device)  # running maximum
        ell = torch.zeros_like(m)                                                              # running sum
        o = torch.zeros(batch, heads, qe - qs, v.size(-1), dtype=acc, device=q.device)        # unnormalised
        for j in range(t.n_k):
            if not t.sees(i, j):
                break  # this tile and all later ones are in the future
            ks, ke = t.k_range(j)
            s = t.scores(qi, k[:, :, ks:ke].to(acc), i, j)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_ref = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that sees nothing yet: exp(−∞) = 0
            p = torch.exp(s - m_ref[..., None])
            rescale = torch.exp(m - m_ref)
            ell = rescale * ell + p.sum(dim=-1)
            o = rescale[..., None] * o + t.dropped(p, i, j) @ v[:, :, ks:ke].to(acc)
            m = m_new
        seen = ell > 0
        out[:, :, qs:qe] = (o / torch.where(seen, ell, 1.0)[..., None]).to(out.dtype)
        lse[:, :, qs:qe] = torch.where(seen, m + torch.log(ell), float("inf"))
    return out, lse


def _backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor, t: Tiles,
              need_bias: bool, bias_params: tuple[Tensor, ...], need_params: Sequence[bool]):
    """Algorithm 4: dQ, dK, dV, the tensor bias's gradient (or None) and the bias parameters'."""
    acc = _accumulation_dtype(q.dtype)
    d_out = d_out.to(acc)
    d_rows = (d_out * out.to(acc)).sum(dim=-1)  # D_i = rowsum(dO_i ∘ O_i)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    d_bias = torch.zeros(t.bias.shape, dtype=acc, device=q.device) if need_bias else None
    learnable = [p for p, need in zip(bias_params, need_params) if need]
    d_learnable = [torch.zeros_like(p) for p in learnable]
    for j in range(t.n_k):
        ks, ke = t.k_range(j)
        kj, vj = k[:, :, ks:ke].to(acc), v[:, :, ks:ke].to(acc)
        for i in range(t.n_q):
            if not t.sees(i, j):
                continue  # a tile entirely in the future
            qs, qe = t.q_range(i)
            qi, d_oi = q[:, :, qs:qe].to(acc), d_out[:, :, qs:qe]
            fn_bias = None
            if learnable and t.bias_fn is not None:
                with torch.enable_grad():
                    fn_bias = t.fn_bias(i, j, q.device)
            s = t.scores(qi, kj, i, j, None if fn_bias is None else fn_bias.detach())
            p = torch.exp(s - lse[:, :, qs:qe, None])  # P_ij, recomputed from L
            dv[:, :, ks:ke] += t.dropped(p, i, j).transpose(-2, -1) @ d_oi
            dp = t.dropped(d_oi @ vj.transpose(-2, -1), i, j)
            ds = p * (dp - d_rows[:, :, qs:qe, None])
            dq[:, :, qs:qe] += (ds @ kj) * t.scale
            dk[:, :, ks:ke] += (ds.transpose(-2, -1) @ qi) * t.scale
            if d_bias is not None:
                _tile_of(d_bias, qs, qe, ks, ke).add_(_sum_to(ds, d_bias.shape))
            if fn_bias is not None and fn_bias.requires_grad:
                grad_tile = _sum_to(ds, _as_4d(fn_bias).shape).reshape(fn_bias.shape).to(fn_bias.dtype)
                grads = torch.autograd.grad(fn_bias, learnable, grad_outputs=grad_tile, allow_unused=True)
                for total, grad in zip(d_learnable, grads):
                    if grad is not None:
                        total += grad
    d_params = iter(d_learnable)
    d_bias_params = [next(d_params) if need else None for need in need_params]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_bias, d_bias_params


class _FlashAttention(torch.autograd.Function):
    """Algorithms 1–2 forward and 4 backward as one autograd node. The tensor bias and the bias
    parameters are ``tiles``' own, passed again so that autograd routes their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, bias, tiles, *bias_params):
        out, lse = _forward(q, k, v, tiles)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles, ctx.bias_params = tiles, bias_params
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        bias = ctx.tiles.bias
        dq, dk, dv, d_bias, d_params = _backward(
            q, k, v, out, lse, d_out, ctx.tiles, ctx.needs_input_grad[3], ctx.bias_params,
            ctx.needs_input_grad[5:],
        )
        return dq, dk, dv, None if d_bias is None else d_bias.to(bias.dtype), None, *d_params
