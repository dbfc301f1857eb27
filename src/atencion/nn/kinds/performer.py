"""Performer's FAVOR+ (Choromanski et al. 2021, "Rethinking Attention with Performers"): eq. (1)'s
softmax kernel exp(q·k · scale) estimated with m positive orthogonal random features (Lemma 1, §2.4),

    φ(x) = exp(ωᵢᵀx − |x|²/2)ᵢ₌₁…ₘ / √m,        E[φ(x)·φ(y)] = exp(xᵀy),   x = q·scale^½, y = k·scale^½,

so that attention is φ(Q) (φ(K)ᵀ V) / (φ(Q) (φ(K)ᵀ 1)): O(n·m·d) time and no n × n tensor. Causal
(unidirectional) attention keeps the prefix sums S = Σⱼ φ(kⱼ) vⱼᵀ and z = Σⱼ φ(kⱼ) instead, computed
chunk by chunk; decoding carries them from step to step in a ``PerformerState``.

The exponentials are kept in range by subtracting constants that cancel in the ratio: per query, the
largest of its m exponents; for keys, the largest key exponent — over all keys in the bidirectional
case (as the reference implementations do), but in the causal case the largest over the keys seen so
far, with the running sums rescaled whenever it grows (as online softmax does), so that no output
depends, even through rounding, on a later key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...errors import AtencionError
from ..attention import causal_mask, check_mask

CHUNK = 128  # positions per step of the causal prefix sums: the (chunk × chunk) block is the only quadratic term
SPAN = 1024  # positions per step of the bidirectional sums: each step's (span × features) tensors stay small


def orthogonal_gaussian(d_k: int, features: int, generator: torch.Generator) -> Tensor:
    """§2.4's orthogonal random features: ω (features, d_k) as blocks of d_k exactly orthogonal rows (the Q of
    a gaussian matrix's QR, made Haar-distributed by the signs of R's diagonal), each row then given the norm
    of a d_k-dimensional gaussian vector (chi-distributed), so that every row is marginally N(0, I)."""
    blocks = []
    for _ in range(math.ceil(features / d_k)):
        q, r = torch.linalg.qr(torch.randn(d_k, d_k, generator=generator, dtype=torch.float64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)
    norms = torch.randn(features, d_k, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (torch.cat(blocks)[:features] * norms).float()


class PerformerFeatures(nn.Module):
    """The random projection ω of FAVOR+ (Lemma 1, §2.4) and its redraw schedule.

    ω is a persistent buffer drawn from ``seed``, so a saved and reloaded model computes the same outputs.
    With ``redraw`` > 0 a fresh ω is drawn after every ``redraw`` training calls (``performer_attention`` in
    training mode counts them; evaluation never redraws). The generator's state and the call count are
    buffers too, so a resumed run redraws what the uninterrupted one would have.
    """

    def __init__(self, d_k: int, features: int, redraw: int = 0, seed: int = 0):
        super().__init__()
        for name, value, least in (("features", features, 1), ("redraw", redraw, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise AtencionError(f"model.attention.{name} must be an integer >= {least}, got {value!r}")
        self.d_k, self.features, self.redraw, self.seed = d_k, features, redraw, seed
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("omega", orthogonal_gaussian(d_k, features, generator))
        self.register_buffer("generator_state", generator.get_state())
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def exponents(self, x: Tensor, scale: float) -> Tensor:
        """ωᵢᵀx' − |x'|²/2 for x' = x·scale^½: the exponents of φ, (..., d_k) → (..., features)."""
        x = x * scale ** 0.5
        return x @ self.omega.to(x.dtype).T - x.square().sum(-1, keepdim=True) / 2

    def count_training_call(self) -> None:
        """One more training call; after every ``redraw`` of them, draw a new ω from the generator."""
        if not self.redraw:
            return
        self.calls += 1
        if self.calls % self.redraw == 0:
            generator = torch.Generator()
            generator.set_state(self.generator_state.cpu())
            # assigned, not copied in place: the graph of the call just made still holds the old ω
            self.omega = orthogonal_gaussian(self.d_k, self.features, generator).to(self.omega)
            self.generator_state = generator.get_state().to(self.generator_state.device)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, features={self.features}, redraw={self.redraw}, seed={self.seed}"


@dataclass
class PerformerState:
    """Unidirectional FAVOR+'s running sums over the keys seen so far, for decoding: S = Σⱼ φ(kⱼ) vⱼᵀ
    (batch, heads, features, d_v) and z = Σⱼ φ(kⱼ) (batch, heads, features), both stored divided by
    exp(``stabiliser``) (batch, heads, 1), the largest key exponent seen so far. Empty until the first step."""

    S: Tensor | None = None
    z: Tensor | None = None
    stabiliser: Tensor | None = None
    length: int = 0


def performer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    features: PerformerFeatures,
    causal: bool = False,
    mask: Tensor | None = None,
    scale: float | None = None,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """FAVOR+: φ(Q) (φ(K)ᵀ V) / (φ(Q) φ(K)ᵀ 1) over tensors of shape (batch, heads, length, d_k).

    ``causal``: query i (the queries are the last q_len positions) sees keys up to its position, through
    prefix sums. ``mask``: a key-padding mask (True = a real position) of shape (batch, 1, 1, keys) or
    (batch, heads, 1, keys); masked keys contribute nothing (their φ is zero), and a query with no visible
    key gets a zero output. With ``need_weights`` the implied weights φ(q)·φ(k) normalised over the visible
    keys come back as (batch, heads, queries, keys), built only then; the output is the same either way.
    The features are computed in float32 at least.
    """
    q_len, k_len = q.size(-2), k.size(-2)
    if mask is not None:
        check_mask(mask, "performer's mask", q.size(0), q_len, k_len)
        if mask.size(-2) != 1:
            raise AtencionError("performer takes a key-padding mask (batch, 1, 1, keys) only, and causal=True "
                                f"for a decoder; got a mask of shape {tuple(mask.shape)}")
    if causal and q_len > k_len:
        raise AtencionError(f"causal performer attention needs at least as many keys as queries; got {q_len} "
                            f"queries and {k_len} keys")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    work = torch.promote_types(q.dtype, torch.float32)
    q, k, v_work = q.to(work), k.to(work), v.to(work)
    if causal or need_weights:  # whole (length × features) tensors: the bidirectional sums go span by span
        phi_q, key_exp = _query_features(q, features, scale), _key_exponents(k, features, scale, mask)
    if causal:
        state, offset = PerformerState(), k_len - q_len
        if offset:  # keys before the first query: every query sees them
            _causal(None, key_exp[..., :offset, :], v_work[..., :offset, :], state)
        out = _causal(phi_q, key_exp[..., offset:, :], v_work[..., offset:, :], state)
    else:
        out = _bidirectional(q, k, v_work, features, scale, mask)
    weights = _implied_weights(phi_q, key_exp, causal).to(v.dtype) if need_weights else None
    if features.training:
        features.count_training_call()
    return out.to(v.dtype), weights


def performer_step(q: Tensor, k: Tensor, v: Tensor, features: PerformerFeatures, state: PerformerState,
                   scale: float | None = None) -> Tensor:
    """Causal FAVOR+ for the next positions while decoding: q, k, v (batch, heads, new, d_k) are the new
    queries, keys and values; ``state`` takes in the new keys and values. Equals the causal full pass over
    everything so far at those positions."""
    if q.size(-2) != k.size(-2):
        raise AtencionError(f"performer_step takes one query per new key; got {q.size(-2)} queries and "
                            f"{k.size(-2)} keys")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    work = torch.promote_types(q.dtype, torch.float32)
    out = _causal(_query_features(q.to(work), features, scale), _key_exponents(k.to(work), features, scale, None),
                  v.to(work), state)
    return out.to(v.dtype)


def _query_features(q: Tensor, features: PerformerFeatures, scale: float) -> Tensor:
    """φ(q)·exp(−c_q), c_q the largest of the query's own exponents: a constant of its row, which cancels."""
    exponents = features.exponents(q, scale)
    return torch.exp(exponents - exponents.detach().amax(-1, keepdim=True)) / math.sqrt(features.features)


def _key_exponents(k: Tensor, features: PerformerFeatures, scale: float, mask: Tensor | None) -> Tensor:
    """The exponents of φ(k), −∞ at masked keys (so that their φ is exactly zero)."""
    exponents = features.exponents(k, scale)
    return exponents if mask is None else exponents.masked_fill(~mask[..., 0, :, None], float("-inf"))


def _bidirectional(q: Tensor, k: Tensor, v: Tensor, features: PerformerFeatures, scale: float,
                   mask: Tensor | None) -> Tensor:
    """φ(Q) (φ(K)ᵀ V) / (φ(Q) φ(K)ᵀ 1), the keys' φ divided by exp of their largest exponent (a constant
    of the whole head, which cancels; the lowest finite number where no key is visible). Computed ``SPAN``
    positions at a time, the sums rescaled when a later span's largest exponent is larger, so that no step
    touches more than a span's features: the time stays linear in the length where whole (length × features)
    tensors would outgrow the caches and the allocator's reuse."""
    lowest = torch.finfo(k.dtype).min
    stabiliser, kv, key_sum = None, 0, 0
    spans_mask = [None] * math.ceil(k.size(-2) / SPAN) if mask is None else mask.split(SPAN, dim=-1)
    for span, span_v, span_mask in zip(k.split(SPAN, dim=-2), v.split(SPAN, dim=-2), spans_mask):
        exponents = _key_exponents(span, features, scale, span_mask)
        largest = exponents.detach().amax(dim=(-2, -1), keepdim=True).clamp_min(lowest)
        if stabiliser is not None:  # the largest so far grew: rescale the sums to it, as online softmax does
            largest = torch.maximum(largest, stabiliser)
            carry = torch.exp(stabiliser - largest)
            kv, key_sum = kv * carry, key_sum * carry[..., 0]
        stabiliser = largest
        phi_k = torch.exp(exponents - stabiliser) / math.sqrt(features.features)
        kv = kv + phi_k.transpose(-1, -2) @ span_v
        key_sum = key_sum + phi_k.sum(-2)
    outputs = []
    for span in q.split(SPAN, dim=-2):
        phi_q = _query_features(span, features, scale)
        outputs.append(_ratio(phi_q @ kv, phi_q @ key_sum[..., None]))
    return torch.cat(outputs, dim=-2)


def _causal(phi_q: Tensor | None, key_exp: Tensor, v: Tensor, state: PerformerState) -> Tensor | None:
    """The prefix sums of unidirectional FAVOR+ over the positions of ``key_exp``, continuing ``state``
    and leaving it at the last of them; the outputs at those positions, or None without queries."""
    batch, heads, n, m = key_exp.shape
    if state.S is None:
        state.S = key_exp.new_zeros(batch, heads, m, v.size(-1))
        state.z = key_exp.new_zeros(batch, heads, m)
        state.stabiliser = key_exp.new_full((batch, heads, 1), torch.finfo(key_exp.dtype).min)
    # split, not sliced chunk by chunk: the gradient of a slice is a zero tensor of the whole length
    chunks_q = [None] * math.ceil(n / CHUNK) if phi_q is None else phi_q.split(CHUNK, dim=-2)
    outputs = [_causal_chunk(chunk_q, chunk_k, chunk_v, state)
               for chunk_q, chunk_k, chunk_v in zip(chunks_q, key_exp.split(CHUNK, dim=-2), v.split(CHUNK, dim=-2))]
    state.length += n
    return None if phi_q is None else torch.cat(outputs, dim=-2)


def _causal_chunk(phi_q: Tensor | None, key_exp: Tensor, v: Tensor, state: PerformerState) -> Tensor | None:
    """One chunk of the prefix sums. Position t of the chunk divides its sums by exp(c_t), c_t the largest key
    exponent up to t (a running max, never below the state's): the state's part is rescaled by
    exp(c_prev − c_t), key j's part within the chunk by exp(c_j − c_t) ≤ 1, so no factor can overflow and
    none depends on a key after t."""
    n = key_exp.size(-2)
    running = torch.cummax(torch.maximum(key_exp.detach().amax(-1), state.stabiliser), dim=-1).values  # c_t
    phi_k = torch.exp(key_exp - running[..., None]) / math.sqrt(key_exp.size(-1))  # φ(k_j)·exp(−c_j)
    later = torch.ones(n, n, dtype=torch.bool, device=key_exp.device).triu(1)
    decay = torch.exp((running[..., None, :] - running[..., :, None]).masked_fill(later, float("-inf")))  # [t, j]
    carry = torch.exp(state.stabiliser - running)  # exp(c_prev − c_t): the state's part at t
    out = None
    if phi_q is not None:
        scores = (phi_q @ phi_k.transpose(-1, -2)) * decay  # φ(q_t)·φ(k_j)·exp(−c_t), zero for j > t
        numerator = carry[..., None] * (phi_q @ state.S) + scores @ v
        denominator = carry * (phi_q @ state.z[..., None])[..., 0] + scores.sum(-1)
        out = _ratio(numerator, denominator[..., None])
    phi_k_last = phi_k * decay[..., -1, :, None]  # φ(k_j)·exp(−c_last)
    state.S = carry[..., -1:, None] * state.S + phi_k_last.transpose(-1, -2) @ v
    state.z = carry[..., -1:] * state.z + phi_k_last.sum(-2)
    state.stabiliser = running[..., -1:]
    return out


def _implied_weights(phi_q: Tensor, key_exp: Tensor, causal: bool) -> Tensor:
    """The (batch, heads, queries, keys) weights FAVOR+ implies: φ(q)·φ(k) over the visible keys, normalised.
    Quadratic: built only when asked, for inspection."""
    lowest = torch.finfo(key_exp.dtype).min
    phi_k = torch.exp(key_exp - key_exp.detach().amax(dim=(-2, -1), keepdim=True).clamp_min(lowest))
    weights = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        q_len, k_len = weights.shape[-2:]
        weights = weights.masked_fill(~causal_mask(q_len, k_len - q_len, weights.device), 0.0)
    return _ratio(weights, weights.sum(-1, keepdim=True))


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator, where a zero denominator (a query with no visible key, whose numerator is zero
    too) gives zero: never NaN, in the values or in their gradients."""
    return numerator / denominator.masked_fill(denominator == 0, 1.0)
