"""Attention kinds beside eq. (1) (``model.attention: {kind: ...}``, config.ATTENTION_KINDS): exact
attention computed in tiles (FlashAttention, flash.py), local and sparse patterns (a sliding
window, Longformer, BigBird: sparse.py), and low-rank and kernel approximations (Linformer,
Performer: linformer.py, performer.py).

Each kind is a module that a self-attention layer (attention.MultiHeadAttention) calls in place of
``scaled_dot_product_attention`` with the same queries, keys and values (batch, heads, length,
d_k): :meth:`AttentionKind.forward` over a whole sequence (training, encoding, a prompt), and
:meth:`AttentionKind.decode` for the new positions of incremental decoding, with the cache the
kind keeps (:meth:`AttentionKind.new_cache`: a window keeps its last ``window`` keys, the causal
Performer a running sum). Cross-attention is always eq. (1). A kind's masks are structural:
``causal`` and a key-padding mask (batch, 1, 1, keys), never an n × n tensor. Under grouped-query
attention the caches keep the n_kv_heads key/value heads and a kind sees them repeated to the
query heads (attention.repeat_kv), after the cache.

``ATTENTION_KINDS`` (config.py keeps the table, empty until this module fills it: config.py does not
import torch) names every kind once, as a :class:`KindSpec`: its settings and their defaults, the
lowest value of each integer setting, its check of the config, the note the attention explorer
shows beside its maps, and its builder. ``ModelConfig.attention`` is checked against it
(config.attention_settings), and the layers (:func:`make_kind`, :func:`shared_module`) and the
explorer (viz/attention.kind_note) ask it instead of naming kinds.

Adding a kind: a subclass of :class:`AttentionKind` (its computation in a module of its own, as
flash.py and sparse.py are) and one KindSpec in ``ATTENTION_KINDS`` below; nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...config import ATTENTION_KINDS, attention_settings
from ...errors import AtencionError
from ..attention import causal_mask, repeat_kv, scaled_dot_product_attention, stack_beams, unstack_beams
from ..cache import BeamKVCache, KVCache
from ..positional import adds_bias
from .flash import flash_attention
from .linformer import SHARING, LinformerProjection, linformer_attention
from .performer import PerformerFeatures, PerformerState, performer_attention, performer_step
from .sparse import bigbird_attention, bigbird_pattern, longformer_attention, window_attention


class AttentionKind(nn.Module):
    """The interface of a kind; by itself (``kind: full`` never builds one) it is not used."""

    name = "full"
    general_masks = False  # True: takes any boolean mask, not only key padding (batch, 1, 1, keys)

    def __init__(self, settings: dict, causal: bool):
        super().__init__()
        self.settings, self.causal = dict(settings), causal

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights) -> tuple[Tensor, Tensor | None]:
        """Attention over a whole sequence (queries are the last q_len positions when causal)."""
        raise NotImplementedError

    def pattern(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """Which keys each query may see, (1 or heads, queries, keys), from their positions; None: all."""
        return None

    def new_cache(self, group: int) -> KVCache:
        """The self-attention cache of incremental decoding (``group``: rows of a beam)."""
        return KVCache() if group == 1 else BeamKVCache(group)

    def decode(self, q, k, v, mask, cache, positions, scale) -> Tensor:
        """The new positions' output with a cache: a single row per sentence runs the kind itself
        over the cached keys (the queries are the last positions); a beam's rows, whose keys are
        interleaved by slot, run eq. (1) under the beam's mask and the kind's pattern."""
        k, v = cache.append(k, v)
        if not isinstance(cache, BeamKVCache):  # the state's mask, if any, is the causal one the kind applies
            return self.forward(q, repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1)), None, positions, 0.0, scale,
                                False)[0]
        return self.explicit(q, k, v, mask, positions, scale)

    def explicit(self, q, k, v, mask, positions, scale) -> Tensor:
        """Eq. (1) under ``mask`` and the kind's pattern: exact for the exact and sparse kinds."""
        pattern = self.pattern(positions.q_pos, positions.k_pos)  # in the stacked layout already
        if pattern is not None:
            mask = pattern[None] if mask is None else mask & pattern[None]
        group = q.size(0) // k.size(0)
        out, _ = scaled_dot_product_attention(stack_beams(q, group), k, v, mask, 0.0, False, positions.bias, scale)
        return unstack_beams(out, group)


# the kinds ---------------------------------------------------------------------------------------

class Flash(AttentionKind):
    """Eq. (1) in tiles with the online softmax (flash.py); its maps are eq. (1)'s own weights."""

    name, general_masks = "flash", True

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights):
        if need_weights:  # the same function, with the matrix it never builds otherwise
            if self.causal:
                causal = causal_mask(q.size(2), k.size(2) - q.size(2), q.device)  # the queries are the last
                mask = causal if mask is None else mask & causal
            bias = None if positions is None else positions.bias
            return scaled_dot_product_attention(q, k, v, mask, dropout_p, True, bias, scale)
        bias, params = _bias(positions, k.size(2))
        out = flash_attention(q, k, v, mask=mask, causal=self.causal, bias=bias, bias_params=params,
                              dropout_p=dropout_p, scale=scale, q_tile=self.settings["q_tile"],
                              k_tile=self.settings["k_tile"])
        return out, None

    def decode(self, q, k, v, mask, cache, positions, scale):
        """A decoding step is a few queries over the cached keys: eq. (1) by torch's fused kernel,
        the same function without a Python loop over tiles (which made generation several times
        slower)."""
        k, v = cache.append(k, v)
        return self.explicit(q, k, v, mask, positions, scale)


class Window(AttentionKind):
    """A sliding window of ``window`` keys (sparse.py): in a decoder query i sees i − w < j ≤ i
    (Mistral's ``sliding_window``), in an encoder |i − j| < w; decoding keeps the last ``window``
    keys only, so its memory stays flat however long the text."""

    name = "window"

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights):
        bias, _ = _bias(positions, k.size(2))
        return window_attention(q, k, v, self.settings["window"], causal=self.causal, mask=mask, bias=bias,
                                dropout_p=dropout_p, scale=scale, need_weights=need_weights)

    def pattern(self, q_pos, k_pos):
        distance = q_pos[:, None] - k_pos[None, :]
        if self.causal:
            return ((distance >= 0) & (distance < self.settings["window"]))[None]
        return (distance.abs() < self.settings["window"])[None]

    def new_cache(self, group):
        return RollingKVCache(self.settings["window"]) if group == 1 else BeamKVCache(group)


class Longformer(Window):
    """Longformer (Beltagy et al. 2020): the window, plus global tokens that see every key and that
    every query sees (sparse.py)."""

    name = "longformer"

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights):
        bias, _ = _bias(positions, k.size(2))
        return longformer_attention(q, k, v, self.settings["window"], self._globals(k.size(2), q.device),
                                    causal=self.causal, mask=mask, bias=bias, dropout_p=dropout_p, scale=scale,
                                    need_weights=need_weights)

    def _globals(self, length: int, device) -> Tensor:
        """The global positions within ``length`` (a shorter input has fewer of them)."""
        tokens = self.settings["global_tokens"]
        where = torch.arange(min(tokens, length)) if isinstance(tokens, int) else torch.tensor(
            [p for p in tokens if p < length], dtype=torch.long)
        return where.to(device)

    def pattern(self, q_pos, k_pos):
        tokens = self.settings["global_tokens"]
        globals_ = (lambda p: p < tokens) if isinstance(tokens, int) else \
            (lambda p: torch.isin(p, torch.tensor(tokens, device=p.device)))
        seen = super().pattern(q_pos, k_pos)[0] | globals_(q_pos)[:, None] | globals_(k_pos)[None, :]
        if self.causal:
            seen &= k_pos[None, :] <= q_pos[:, None]
        return seen[None]

    def new_cache(self, group):  # a global token stays visible: every key is kept
        return KVCache() if group == 1 else BeamKVCache(group)


class BigBird(AttentionKind):
    """BigBird (Zaheer et al. 2020): blocks that see their neighbours, random blocks fixed per
    layer and head, and global blocks (sparse.py)."""

    name = "bigbird"

    def __init__(self, settings, causal, heads: int, layer: int):
        super().__init__(settings, causal)
        self.heads, self.seed = heads, settings["seed"] * 1_000_003 + layer  # fixed per layer (and, inside, head)

    def _args(self):
        s = self.settings
        return s["block_size"], s["random_blocks"], s["global_blocks"], self.seed

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights):
        bias, _ = _bias(positions, k.size(2))
        return bigbird_attention(q, k, v, *self._args(), causal=self.causal, mask=mask, bias=bias,
                                 dropout_p=dropout_p, scale=scale, need_weights=need_weights)

    def pattern(self, q_pos, k_pos):
        length = int(max(q_pos.max(), k_pos.max())) + 1
        full = bigbird_pattern(length, length, *self._args(), self.heads, self.causal, device=q_pos.device)
        return full[:, q_pos][:, :, k_pos]


class Linformer(AttentionKind):
    """Linformer (Wang et al. 2020): keys and values projected along the length to ``proj_len``
    (linformer.py). Its maps are the effective weights on the input positions, P·F (the
    weights over the projected keys times the values' projection): they need not be positive."""

    name = "linformer"

    def __init__(self, settings, causal, heads: int, max_len: int, shared: nn.Module | None = None):
        super().__init__(settings, causal)
        self.projection = shared if shared is not None else LinformerProjection(
            heads, max_len, settings["proj_len"], settings["sharing"])

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights):
        out, weights = linformer_attention(q, k, v, self.projection, mask=mask, dropout_p=dropout_p, scale=scale,
                                           need_weights=need_weights)
        if weights is not None:  # over the projected keys (…, proj_len): to the input positions, P · F
            projection = self.projection
            weights = weights @ (projection.E if projection.F is None else projection.F)[..., :k.size(2)]
            if mask is not None:
                weights = weights * mask  # a masked value is zeroed before F mixes it
        return out, weights


class Performer(AttentionKind):
    """Performer's FAVOR+ (Choromanski et al. 2021): softmax attention estimated with positive
    random features (performer.py); causal by prefix sums, decoding with a running sum. Its maps
    are the weights it implies, φ(q)·φ(k) normalised."""

    name = "performer"

    def __init__(self, settings, causal, d_k: int, layer: int):
        super().__init__(settings, causal)
        self.features = PerformerFeatures(d_k, settings["features"], settings["redraw"],
                                          settings["seed"] * 1_000_003 + layer)

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights):
        return performer_attention(q, k, v, self.features, causal=self.causal, mask=mask, scale=scale,
                                   need_weights=need_weights)

    def new_cache(self, group):
        return PerformerCache(PerformerState()) if group == 1 else BeamKVCache(group)

    def decode(self, q, k, v, mask, cache, positions, scale):
        if isinstance(cache, PerformerCache):  # its running sums are per query head
            return performer_step(q, repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1)), self.features, cache.state,
                                  scale=scale)
        k, v = cache.append(k, v)  # a beam: the implied weights under the beam's mask
        k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))

        group = q.size(0) // k.size(0)
        out = _masked_performer(stack_beams(q, group), k, v, mask, self.features, scale)
        return unstack_beams(out, group)


# the registry: every kind, named once ------------------------------------------------------------

def _takes_any(cfg, settings: dict) -> None:
    return None


def _shares_nothing(cfg) -> None:
    return None


@dataclass(frozen=True)
class KindSpec:
    """One kind of self-attention (a value of ``model.attention.kind``) and what atencion asks of it.

    ``note``: what its self-attention maps show, beside eq. (1)'s legend in the attention explorer
    ("" for eq. (1) itself). ``settings``: its settings with their defaults (config.json names every
    one). ``at_least``: the lowest value of each integer setting; ``choices``: the names each
    setting that takes a name may take. ``check(cfg, settings)``: raises AtencionError, naming the
    key, where ModelConfig ``cfg`` cannot take the kind; it may normalise ``settings`` in place.
    ``build(cfg, causal, layer, shared)``: the AttentionKind of one self-attention layer
    (``layer``: its place in the stack, ``shared``: what :attr:`shared` made); None for eq. (1)
    itself, which builds none. ``shared(cfg)``: a module every layer of a stack shares, or None."""

    name: str
    note: str
    settings: dict[str, Any] = field(default_factory=dict)
    at_least: dict[str, int] = field(default_factory=dict)
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    check: Callable[[Any, dict], None] = _takes_any
    build: Callable[[Any, bool, int, nn.Module | None], AttentionKind] | None = None
    shared: Callable[[Any], nn.Module | None] = _shares_nothing


def _no_bias(cfg, kind: str) -> None:
    """A kind that computes no score matrix cannot take positions that add a bias to the scores."""
    if adds_bias(cfg):
        raise AtencionError(f"attention.kind {kind} computes no score matrix to add positional {cfg.positional!r}'s "
                            f"bias to; use positional rope, sinusoidal or learned")


def _longformer_check(cfg, settings: dict) -> None:
    settings["global_tokens"] = _global_tokens(settings["global_tokens"], cfg.max_positions)


def _global_tokens(value: Any, max_positions: int) -> int | list[int]:
    """Longformer's global tokens: the first N (an integer), or a list of positions."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= max_positions:
            raise AtencionError(f"attention.global_tokens must be between 0 and max_positions ({max_positions}) "
                                f"(the first N tokens), got {value}")
        return value
    if not isinstance(value, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        raise AtencionError(f"attention.global_tokens must be a count (the first N tokens) or a list of positions, "
                            f"got {value!r}")
    for position in value:
        if not 0 <= position < max_positions:
            raise AtencionError(f"attention.global_tokens: position {position} is beyond the length this model "
                                f"takes (max_positions {max_positions})")
    return sorted(set(value))


def _linformer_check(cfg, settings: dict) -> None:
    if cfg.arch != "encoder":
        raise AtencionError(f"attention.kind linformer projects the keys along the whole length, so no query "
                            f"can be kept from the future: it is for arch 'encoder', not {cfg.arch!r} (use "
                            f"window, performer or flash)")
    if settings["proj_len"] > cfg.max_positions:
        raise AtencionError(f"attention.proj_len ({settings['proj_len']}) must be at most max_positions "
                            f"({cfg.max_positions}), the longest input the projection takes")
    _no_bias(cfg, "linformer")


def _linformer_shared(cfg) -> nn.Module | None:
    """Linformer's one projection for every layer, under ``sharing: layerwise``."""
    settings = cfg.attention
    if settings["sharing"] != "layerwise":
        return None
    return LinformerProjection(cfg.n_heads, cfg.max_positions, settings["proj_len"], "layerwise")


# config.ATTENTION_KINDS is the table ModelConfig checks ``attention`` against; it is filled here, once.
# (The order is the one error messages list.)
ATTENTION_KINDS.update({kind.name: kind for kind in (
    # eq. (1) itself, torch's fused kernel: no module of its own.
    KindSpec("full", ""),
    # eq. (1) in tiles with the online softmax (Dao et al. 2022).
    KindSpec("flash", "flash computes eq. (1) exactly: these are its weights",
             {"q_tile": 128, "k_tile": 128}, {"q_tile": 1, "k_tile": 1},
             build=lambda cfg, causal, layer, shared: Flash(cfg.attention, causal)),
    # a sliding window of keys (Longformer, Mistral).
    KindSpec("window", "a sliding window: zero outside each query's window",
             {"window": 256}, {"window": 1},
             build=lambda cfg, causal, layer, shared: Window(cfg.attention, causal)),
    # the window and global tokens (Beltagy et al. 2020).
    KindSpec("longformer", "Longformer: zero outside each query's window, except the global tokens' rows and "
                           "columns",
             {"window": 256, "global_tokens": 1}, {"window": 1}, check=_longformer_check,
             build=lambda cfg, causal, layer, shared: Longformer(cfg.attention, causal)),
    # neighbour, random and global blocks (Zaheer et al. 2020).
    KindSpec("bigbird", "BigBird: zero outside each query's neighbour, random and global blocks",
             {"block_size": 64, "random_blocks": 3, "global_blocks": 1, "seed": 0},
             {"block_size": 1, "random_blocks": 0, "global_blocks": 0, "seed": 0},
             build=lambda cfg, causal, layer, shared: BigBird(cfg.attention, causal, cfg.n_heads, layer)),
    # keys and values projected along the length, n → k (Wang et al. 2020).
    KindSpec("linformer", "Linformer: the effective weights on the input positions, P·F (softmax over the "
                          "projected keys, times the values' projection); they need not be positive nor sum to 1",
             {"proj_len": 256, "sharing": "headwise"}, {"proj_len": 1}, {"sharing": SHARING}, _linformer_check,
             build=lambda cfg, causal, layer, shared: Linformer(cfg.attention, causal, cfg.n_heads,
                                                                cfg.max_positions, shared),
             shared=_linformer_shared),
    # FAVOR+, positive random features (Choromanski et al. 2021).
    KindSpec("performer", "Performer: the weights its random features imply, φ(q)·φ(k) normalised (an estimate "
                          "of eq. (1)'s)",
             {"features": 256, "redraw": 0, "seed": 0}, {"features": 1, "redraw": 0, "seed": 0},
             check=lambda cfg, settings: _no_bias(cfg, "performer"),
             build=lambda cfg, causal, layer, shared: Performer(cfg.attention, causal, cfg.d_k, layer)),
)})


def attention_kind(cfg) -> KindSpec:
    """The kind ``cfg.attention`` names (None: full). A config made before this module was imported
    (config.py does not import torch) has its ``attention`` checked and completed here."""
    if cfg.attention is None:
        return ATTENTION_KINDS["full"]
    cfg.attention = attention_settings(cfg)  # a complete setting is returned as it was
    return ATTENTION_KINDS[cfg.attention["kind"]]


def full_attention(cfg) -> bool:
    """Whether self-attention is eq. (1) itself (no ``attention``, or a kind that builds no module: full)."""
    return attention_kind(cfg).build is None


def make_kind(cfg, causal: bool, layer: int, shared: nn.Module | None = None) -> AttentionKind | None:
    """The kind of one self-attention layer (``layer``: its place in the stack), or None for eq. (1)."""
    build = attention_kind(cfg).build
    return None if build is None else build(cfg, causal, layer, shared)


def shared_module(cfg) -> nn.Module | None:
    """What every layer of a stack shares (Linformer's one projection under ``sharing: layerwise``), or None."""
    return attention_kind(cfg).shared(cfg)


# caches and helpers ------------------------------------------------------------------------------

class RollingKVCache(KVCache):
    """A sliding window's self-attention cache: between steps the last ``window − 1`` keys and
    values (a step's query sees them and its own), and no more, so decoding takes the same memory at
    step 100 and at step 100,000."""

    rewinds = False  # the keys before the last ``window − 1`` are gone

    def __init__(self, window: int):
        super().__init__()
        self.window, self.seen = window, 0

    def __len__(self) -> int:
        return self.seen

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Every key the new queries may see (the kept ones, then the new), then keep the last
        ``window − 1``: the next query sees those and itself."""
        self.seen += k.size(2)
        k, v = super().append(k, v)
        start = max(0, k.size(2) - (self.window - 1))
        self.k, self.v = k[:, :, start:], v[:, :, start:]
        return k, v


class PerformerCache(KVCache):
    """The causal Performer's decoding state (running sums) behind the cache interface."""

    rewinds = False  # a sum does not say what was added last

    def __init__(self, state):
        super().__init__()
        self.state = state

    def __len__(self) -> int:
        return getattr(self.state, "length", 0)

    def reorder(self, index: Tensor) -> None:
        state = self.state
        if state.S is not None:
            state.S, state.z, state.stabiliser = (t.index_select(0, index) for t in (state.S, state.z,
                                                                                      state.stabiliser))


def _bias(positions, k_len: int):
    """The relative bias as a function of indices and its learned tensors, or (None, ())."""
    if positions is None or positions.relative is None:
        return None, ()
    return positions.bias_fn(k_len), positions.bias_params()


def _masked_performer(q, k, v, mask, features, scale):
    """The Performer's implied weights φ(q)·φ(k) under a boolean mask, normalised: a beam's rows."""
    _, weights = performer_attention(q, k, v, features, causal=False, mask=None, scale=scale, need_weights=True)
    if mask is not None:
        weights = weights * mask
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-30)
    return weights @ v


__all__ = ["ATTENTION_KINDS", "AttentionKind", "KindSpec", "RollingKVCache", "attention_kind", "full_attention",
           "make_kind", "shared_module"]
