"""Token embeddings (§3.4) and positional encodings: the paper's absolute ones, added to the
embeddings (§3.5: sinusoidal; Table 3 row E: learned), and the relative ones of later models,
applied inside attention (RoPE, ALiBi, T5's bucketed bias).

``POSITIONS`` names every kind once, with what the rest of atencion asks about it: its role
(absolute or relative), the module it builds for a stack, how many positions it can read and
what it needs of the config. ``ModelConfig.positional`` takes its keys; the stacks, the config's
checks, generation, the exporters and the benchmarks ask it (``position_kind``,
``position_limit``, ``absolute_positions``, ``relative_positions``) instead of naming kinds.

Adding a position kind: one class here and one POSITIONS entry. An absolute kind's module
gives ``forward(length, offset)`` (the vectors added to the embeddings) and ``vectors(n)`` (what
an exporter writes); a relative kind's module gives ``bias(q_pos, k_pos, causal)`` (a term added to
the scores, or None) and, to turn queries and keys, ``angles(positions)`` and ``span(start, length)``
as RotaryPositions does. The entry says which of the two a relative kind does (its ``rotary`` and
``bias`` flags): the stacks, prefix-tuning, the fused decoding step and the attention kinds that
compute no score matrix ask the flags, never the class.
Formats and Hugging Face families that take one kind only (export/hf.py: Marian's sinusoids;
interop: BERT and GPT-2 learned, NeoX RoPE, Bloom ALiBi, T5 its bias) name it themselves."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..config import POSITIONS, check_positional
from ..errors import AtencionError


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))."""
    position = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """§3.5: fixed sinusoids, added to the embeddings; the table grows for longer inputs."""

    def __init__(self, d_model: int, n_positions: int = 1024):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("table", sinusoidal_table(n_positions, d_model), persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """PE for positions offset … offset+length-1, shape (length, d_model)."""
        end = offset + length
        if end > self.table.size(0):
            self.table = sinusoidal_table(max(end, 2 * self.table.size(0)), self.d_model).to(self.table.device)
        return self.table[offset:end]

    def vectors(self, n: int) -> Tensor:
        """The PE of positions 0 … n−1, computed afresh in float32: what an exporter writes."""
        return sinusoidal_table(n, self.d_model)


class Sinusoidal2DPositions(nn.Module):
    """Fixed 2-D positions for a grid of image patches: ViT's 2-D scheme (Dosovitskiy et al.
    2021, appendix D.4: half of d_model for the patch's row, half for its column) with §3.5's
    sinusoids in place of learned vectors, as MoCo v3 and MAE (He et al. 2022) use it; position
    0, the [CLS] token, gets zeros."""

    def __init__(self, d_model: int, grid: tuple[int, int]):
        super().__init__()
        rows, cols = grid
        half = d_model // 2
        row = sinusoidal_table(rows, half)[:, None, :].expand(rows, cols, half)
        col = sinusoidal_table(cols, half)[None, :, :].expand(rows, cols, half)
        patches = torch.cat([row, col], dim=-1).reshape(rows * cols, d_model)
        self.register_buffer("table", torch.cat([patches.new_zeros(1, d_model), patches]), persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        end = offset + length
        if end > self.table.size(0):
            raise AtencionError(f"sequence reaches position {end} but the patch grid has {self.table.size(0)} "
                                f"positions ([CLS] and the patches)")
        return self.table[offset:end]

    def vectors(self, n: int) -> Tensor:
        return self.table[:n]


class LearnedPositionalEmbedding(nn.Module):
    """Table 3, row (E): a learned vector per position instead of sinusoids."""

    def __init__(self, d_model: int, n_positions: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_positions, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        end = offset + length
        if end > self.weight.size(0):
            raise AtencionError(
                f"sequence reaches position {end} but learned positions stop at max_positions="
                f"{self.weight.size(0)}; shorten the input or raise max_positions"
            )
        return self.weight[offset:end]

    def vectors(self, n: int) -> Tensor:
        """The vectors of positions 0 … n−1, or the whole table when it has fewer (max_positions):
        what an exporter writes."""
        return self.weight[:n]


class TokenEmbedding(nn.Module):
    """§3.4: learned embeddings of dimension d_model, multiplied by √d_model."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.pad_id = pad_id
        self.scale = math.sqrt(d_model) if scale else 1.0

    def forward(self, ids: Tensor) -> Tensor:
        return nn.functional.embedding(ids, self.weight) * self.scale


# relative positions: inside attention instead of added to the embeddings ---------------------------
#
# A relative kind acts on every self-attention layer through two hooks: ``rotate`` (RoPE turns
# queries and keys by their positions before the dot product) and ``bias`` (ALiBi and T5 add a
# float (heads, queries, keys) term to the scores). Cross-attention relates two different
# sequences, so none of them touches it.

def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) → (−x2, x1) on the two halves of the last dimension (the layout of GPT-NeoX and
    Llama in Hugging Face: feature i pairs with feature i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RotaryPositions(nn.Module):
    """RoPE (Su et al. 2021): the pair (i, i + d_k/2) of a query or key at position m is turned
    by the angle m · base^(−2i/d_k), so q_m · k_n depends on m − n only; ``scaling`` (config
    ``rope_scaling``) changes the frequencies base^(−2i/d_k) as :func:`scaled_frequencies` says."""

    def __init__(self, d_k: int, base: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        if d_k % 2:
            raise AtencionError(f"positional 'rope' needs an even d_k = d_model / n_heads, got {d_k}")
        inv_freq = base ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)
        if scaling is not None:
            inv_freq = scaled_frequencies(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._table: tuple[Tensor, Tensor] | None = None  # ``angles`` of positions 0, 1, …: ``span`` reads it

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin, (length, d_k), for integer ``positions`` (length,)."""
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def span(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """``angles`` of the positions start, …, start + length − 1: rows of a table of the positions
        from 0, made again for twice as many when they pass its end. A stack's positions are such a
        span, so a generation step reads its row instead of computing it (five tensor operations)."""
        end, table = start + length, self._table  # (read once: another thread may grow it meanwhile)
        if (table is None or len(table[0]) < end or table[0].device != self.inv_freq.device
                or table[0].dtype != self.inv_freq.dtype):  # (the model moved or changed its dtype)
            grown = max(end, 2 * len(table[0])) if table is not None else end
            with torch.inference_mode(False):  # made while generating, read by training after it
                table = self._table = self.angles(torch.arange(grown, device=self.inv_freq.device))
        cos, sin = table
        return cos[start:end], sin[start:end]

    def bias(self, q_pos: Tensor, k_pos: Tensor, causal: bool) -> None:
        return None


def scaled_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """RoPE's frequencies for a longer context, as the Llama family scales them. ``linear``
    (position interpolation, Chen et al. 2023): every frequency ÷ factor, so position m turns as
    m / factor did. ``llama3`` (Llama 3.1): wavelengths 2π/f longer than L/low_freq_factor ÷ factor,
    shorter than L/high_freq_factor kept, those between interpolated by s = (L/λ − low) / (high − low),
    f·((1 − s)/factor + s), with L = original_max_position_embeddings."""
    factor = scaling["factor"]
    if scaling["type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi (Press et al. 2022): the geometric sequence starting at 2^(−8/n) with that ratio, for
    n a power of two (8 heads: 1/2, 1/4, …, 1/256); otherwise the slopes of the closest lower
    power of two, then every other slope of the next power of two."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest)
    if closest < n_heads:
        slopes += powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes)


class AlibiPositions(nn.Module):
    """ALiBi: score(i, j) − slope_h · distance(i, j). Causal attention sees keys j ≤ i, distance
    i − j (Bloom's form, up to a constant per row that softmax ignores); bidirectional attention
    (an encoder) takes |i − j|."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, q_pos: Tensor, k_pos: Tensor, causal: bool) -> Tensor:
        distance = (q_pos[:, None] - k_pos[None, :]).float()
        if not causal:
            distance = distance.abs()
        return -self.slopes[:, None, None] * distance


def t5_bucket(relative: Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's bucket of each relative position (key − query): exact buckets for small distances,
    logarithmic ones up to ``max_distance``, one bucket beyond. Bidirectional attention spends
    half the buckets on each sign; causal attention only looks back."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    exact = num_buckets // 2
    small = relative < exact
    log_ratio = torch.log(relative.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (num_buckets - exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(small, relative, large)


class T5Positions(nn.Module):
    """T5 (Raffel et al. 2020): a learned scalar per head and bucket of relative position, added to
    the scores; one table per stack, used by every layer of it."""

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.weight = nn.Parameter(torch.empty(num_buckets, n_heads))
        nn.init.normal_(self.weight, std=n_heads ** -0.5)

    def bias(self, q_pos: Tensor, k_pos: Tensor, causal: bool) -> Tensor:
        buckets = t5_bucket(k_pos[None, :] - q_pos[:, None], not causal, self.num_buckets, self.max_distance)
        return self.weight[buckets].permute(2, 0, 1)  # (heads, queries, keys)


# the registry: every kind, named once --------------------------------------------------------------

ROLES = ("absolute", "relative")


def _no_limit(cfg) -> None:
    return None


def _fits(cfg) -> None:
    return None


def _even_d_model(cfg) -> str | None:
    if cfg.d_model % 2 != 0:
        return f"d_model must be even for sinusoidal positions, got {cfg.d_model}"
    return None


def patch_grid(cfg) -> tuple[int, int] | None:
    """The (rows, columns) of patches of an encoder that reads patches (model.inputs, nn/inputs.py),
    else None."""
    inputs = cfg.inputs
    if not isinstance(inputs, dict) or inputs.get("kind") != "patches":
        return None
    return inputs["size"][0] // inputs["patch"], inputs["size"][1] // inputs["patch"]




def _patch_grid_kind(cfg) -> str | None:
    if patch_grid(cfg) is None:
        return "positional 'sinusoidal-2d' numbers a grid of image patches: it needs model.inputs kind patches"
    if cfg.d_model % 4:
        return f"positional 'sinusoidal-2d' needs d_model divisible by 4 (sines and cosines of rows and columns), " \
               f"got {cfg.d_model}"
    return None


def _even_d_k(cfg) -> str | None:
    if cfg.d_k % 2:
        return f"positional 'rope' needs an even d_k = d_model / n_heads, got {cfg.d_k}"
    return None


@dataclass(frozen=True)
class PositionKind:
    """One kind of position (a value of ``ModelConfig.positional``) and what atencion asks of it.

    ``role``: "absolute", a vector per position added to the embeddings of each stack, or
    "relative", terms inside each self-attention layer (cross-attention relates two sequences and
    takes none). ``build(cfg)``: the module of one stack, for a ModelConfig ``cfg``. ``limit(cfg)``:
    how many positions that module can read, None when it extends without limit. ``check(cfg)``:
    why ``cfg`` cannot take this kind (the message ModelConfig raises), or None. ``grid``: True
    for a kind that numbers a grid of image patches (model.inputs patches), not any sequence.
    A relative kind's flags: ``rotary``, it turns queries and keys by their positions (RoPE: its
    module gives ``span``); ``bias``, it adds a term to the scores (ALiBi, T5), so it needs
    attention that computes them. The module it builds carries ``rotary`` too (:func:`rotates`)."""

    name: str
    role: str
    build: Callable[[Any], nn.Module]
    limit: Callable[[Any], int | None] = _no_limit
    check: Callable[[Any], str | None] = _fits
    grid: bool = False
    rotary: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"position kind {self.name!r}: role must be one of {list(ROLES)}, got {self.role!r}")
        if self.role == "absolute" and (self.rotary or self.bias):
            raise ValueError(f"position kind {self.name!r}: rotary and bias are flags of a relative kind")


# config.POSITIONS is the table ModelConfig checks ``positional`` against; it is filled here, once.
POSITIONS.update({kind.name: kind for kind in (
    # §3.5: fixed sinusoids, computed for any length.
    PositionKind("sinusoidal", "absolute", lambda cfg: SinusoidalPositionalEncoding(cfg.d_model, cfg.max_positions),
                 check=_even_d_model),
    # Table 3, row (E): a learned table of max_positions rows, and nothing past it.
    PositionKind("learned", "absolute", lambda cfg: LearnedPositionalEmbedding(cfg.d_model, cfg.max_positions),
                 limit=lambda cfg: cfg.max_positions),
    # 2-D sinusoids (ViT's D.4 with §3.5's sinusoids, as MAE): a patch's row and column, [CLS] zeros.
    PositionKind("sinusoidal-2d", "absolute", lambda cfg: Sinusoidal2DPositions(cfg.d_model, patch_grid(cfg)),
                 limit=lambda cfg: 1 + patch_grid(cfg)[0] * patch_grid(cfg)[1], check=_patch_grid_kind, grid=True),
    # RoPE (Su et al. 2021): queries and keys turned by their positions.
    PositionKind("rope", "relative", lambda cfg: RotaryPositions(cfg.d_k, cfg.rope_base, cfg.rope_scaling),
                 check=_even_d_k, rotary=True),
    # ALiBi (Press et al. 2022): a fixed slope per head times the distance.
    PositionKind("alibi", "relative", lambda cfg: AlibiPositions(cfg.n_heads), bias=True),
    # T5 (Raffel et al. 2020): a learned scalar per head and bucket of relative position.
    PositionKind("t5", "relative",
                 lambda cfg: T5Positions(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance), bias=True),
)})


def kinds(role: str) -> tuple[str, ...]:
    """The names of the kinds of one ``role`` that number any sequence (not only a grid of
    patches), in POSITIONS order."""
    return tuple(name for name, kind in POSITIONS.items() if kind.role == role and not kind.grid)


def position_kind(cfg) -> PositionKind:
    """The kind ``cfg.positional`` names; an unknown name is refused in one line (a ModelConfig made
    before this module was imported has not been checked: config.py does not import torch)."""
    if cfg.positional not in POSITIONS:
        check_positional(cfg)
    return POSITIONS[cfg.positional]


def position_limit(cfg) -> int | None:
    """How many positions a model with ModelConfig ``cfg`` can read: a learned table's
    max_positions rows, or None (sinusoids and relative positions extend without limit; an arch
    "rnn" model has no positions)."""
    if cfg.arch == "rnn":
        return None
    return position_kind(cfg).limit(cfg)


def context_length(cfg) -> int:
    """The tokens a model is meant to read at once: a learned table's ``max_positions`` (its hard
    limit), or the context a RoPE or sinusoidal model was made for, which it can pass but was not
    trained past (Hugging Face's max_position_embeddings; what llama.cpp's and vLLM's servers take as
    the context). A chat's history and a served request are held within it."""
    return position_limit(cfg) or cfg.max_positions


def _module(cfg, role: str) -> nn.Module | None:
    check_positional(cfg)  # the kind's own check too, before its module is built
    kind = position_kind(cfg)
    if kind.role != role:
        return None
    module = kind.build(cfg)
    module.rotary = kind.rotary  # what the stacks and the fused step ask it (``rotates``)
    return module


def rotates(module: nn.Module | None) -> bool:
    """Whether a stack's relative-position module (or None) turns queries and keys, as its kind's
    ``rotary`` flag says: the stacks hand it to attention as a rotation, not a score bias."""
    return bool(getattr(module, "rotary", False))


def adds_bias(cfg) -> bool:
    """Whether ModelConfig ``cfg``'s positions add a term to the attention scores (the kind's
    ``bias`` flag: ALiBi, T5), which attention that computes no score matrix cannot take."""
    return position_kind(cfg).bias


def absolute_positions(cfg) -> nn.Module | None:
    """The absolute-position module added to one stack's embeddings, or None (a relative kind)."""
    return _module(cfg, "absolute")


def relative_positions(cfg) -> nn.Module | None:
    """The relative-position module of one stack's self-attention, or None (an absolute kind)."""
    return _module(cfg, "relative")
