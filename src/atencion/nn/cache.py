"""Speed machinery that is not the paper, behind the interfaces the model uses: the key/value
caches of incremental decoding (one per layer; a beam's hypotheses share one), the decoding
state that holds them and follows beam search's re-rankings, and the packing that lets an
encoder compute on its real positions only.

The search (decode/search.py) sees only the state's ``reorder``: which sentences stay and, in a
beam, which slot each new hypothesis came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import AtencionError
from .matvec import eager


def _causal(length: int, offset: int, device) -> Tensor:
    """(length, offset+length): query i (at position offset+i) sees keys 0 … offset+i."""
    keys = torch.arange(offset + length, device=device)
    queries = torch.arange(offset, offset + length, device=device)
    return keys[None, :] <= queries[:, None]


class KVCache:
    """Keys and values already computed by one attention layer, shape (batch, heads, length, d_k).

    Self-attention appends one step at a time; cross-attention fills it once per source.
    ``reorder`` selects batch rows, as beam search does when hypotheses are re-ranked;
    ``truncate`` forgets the last keys, as speculative decoding does with rejected draft tokens.
    """

    rewinds = True  # whether ``truncate`` can forget the last keys (a cache that keeps all of them)

    def __init__(self) -> None:
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._room: tuple[Tensor, Tensor] | None = None  # buffers whose first keys are k and v
        # set by ``written``: k and v are the buffers' first ``_held`` positions, as views made when first
        # read (nn/fused.py's one-call step writes every layer's cache at every step, and nothing reads
        # them in between: 60 views a step for nothing at 30 layers)
        self._held: int | None = None

    @property
    def k(self) -> Tensor | None:
        if self._k is None and self._held is not None:
            self._views()
        return self._k

    @k.setter
    def k(self, value: Tensor | None) -> None:
        self._let_go()
        self._k = value

    @property
    def v(self) -> Tensor | None:
        if self._v is None and self._held is not None:
            self._views()
        return self._v

    @v.setter
    def v(self, value: Tensor | None) -> None:
        self._let_go()
        self._v = value

    def _views(self) -> None:
        self._k, self._v = self._room[0].narrow(2, 0, self._held), self._room[1].narrow(2, 0, self._held)

    def _let_go(self) -> None:
        """k or v set from outside: the other one stays what the buffers hold, as a view of them."""
        if self._held is not None:
            if self._k is None:
                self._views()
            self._held = None

    def __len__(self) -> int:
        return self._kept()

    def _kept(self) -> int:
        """How many positions' keys it holds (``len`` of a sliding window's cache counts every position seen)."""
        if self._held is not None:
            return self._held
        return 0 if self._k is None else self._k.size(2)

    @property
    def rows(self) -> int:
        """The batch rows the cache holds keys for (it must hold some)."""
        return (self._room[0] if self._held is not None else self._k).size(0)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k and v with the new keys and values after them. Outside autograd they are views of
        buffers with room for more (doubled when full), so that a generation step writes its own
        keys only instead of copying the whole cache; ``k`` and ``v`` as set from outside, or cut
        by ``truncate`` and ``reorder``, are copied into new buffers at the next step. Under autograd,
        tracing or export the new keys are concatenated."""
        if self.k is None:
            self.k, self.v = k, v
        elif (torch.is_grad_enabled() and (k.requires_grad or self.k.requires_grad)) or not eager():
            # tracing, compiling or exporting: no buffers in their graphs
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        else:
            start = self._kept()
            end = start + k.size(2)
            keys, values = self.room(end)
            keys[:, :, start:end], values[:, :, start:end] = k, v
            self.written(end)
        return self.k, self.v

    def room(self, end: int) -> tuple[Tensor, Tensor]:
        """Buffers (batch, heads, capacity, d_k) whose first keys and values are k and v, with room
        up to position ``end``: the ones kept, or new ones (twice ``end``) holding a copy of them.
        The cache needs keys already (a first ``append``)."""
        if self._held is not None and end <= self._room[0].size(2):  # as ``written`` left it: a step's common case
            return self._room
        if not (self._room is not None and self._holds(self._room[0], self.k, end)
                and self._holds(self._room[1], self.v, end)):
            start = self.k.size(2)
            self._room = tuple(old.new_empty(*old.shape[:2], max(2 * end, 64), old.size(3)) for old in (self.k, self.v))
            self._room[0][:, :, :start], self._room[1][:, :, :start] = self.k, self.v
        return self._room

    def written(self, end: int) -> None:
        """The buffers' first ``end`` positions are the cache now: the new keys and values were
        written into :meth:`room` (by ``append``, or by the whole-step kernel of nn/fused.py)."""
        self._held, self._k, self._v = end, None, None

    @staticmethod
    def _holds(buffer: Tensor, kept: Tensor, end: int) -> bool:
        """Whether ``kept`` is the first keys of ``buffer`` and the buffer has room up to ``end``."""
        return (kept.data_ptr() == buffer.data_ptr() and kept.stride() == buffer.stride()
                and kept.shape[:2] == buffer.shape[:2] and kept.dtype == buffer.dtype and end <= buffer.size(2))

    def truncate(self, length: int) -> None:
        """Keep the keys and values of the first ``length`` positions only."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def reorder(self, index: Tensor) -> None:
        if self.k is not None:
            # rows of a 2-D view: torch's index_select copies whole rows there, but walks a 4-D
            # tensor element by element (several times slower on a CPU)
            shape = (len(index),) + self.k.shape[1:]
            self.k = self.k.reshape(self.k.size(0), -1).index_select(0, index).view(shape)
            self.v = self.v.reshape(self.v.size(0), -1).index_select(0, index).view(shape)
            self._room = None  # the old rows' buffers: new ones at the next step


class BeamKVCache(KVCache):
    """The self-attention cache of a beam: the ``group`` hypotheses of one sentence share one
    row, shape (sentences, heads, length · group, d_k), where key ``s · group + j`` is the one
    written at step ``s`` by beam slot ``j``.

    Keys are never moved when beam search re-ranks hypotheses: a hypothesis attends to the keys
    of its own ancestors through the mask that :class:`~atencion.nn.transformer.DecoderState`
    builds from the beams' ancestry, so only the mask changes (a few bytes per key, not d_k
    floats). :meth:`reorder` selects sentences (when done ones leave the batch).
    """

    rewinds = False  # speculative decoding runs one row per sentence, never a beam

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group
        self.length = 0  # keys written so far (steps · group); the buffers hold more

    def __len__(self) -> int:
        return self.length // self.group

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``k``, ``v``: (sentences · group, heads, new, d_k), rows grouped by sentence. They are
        written into preallocated buffers (doubled when full), so a step copies only its own
        keys; the result is a view of the buffers' first keys."""
        k, v = self._interleave(k), self._interleave(v)
        end = self.length + k.size(2)
        if self.k is None or end > self.k.size(2):
            capacity = max(end, 2 * (0 if self.k is None else self.k.size(2)), 16 * self.group)
            self.k, self.v = self._grow(self.k, k, capacity), self._grow(self.v, v, capacity)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, old: Tensor | None, new: Tensor, capacity: int) -> Tensor:
        b, h, _, d = new.shape
        buffer = new.new_empty(b, h, capacity, d)
        if old is not None:
            buffer[:, :, : self.length] = old[:, :, : self.length]
        return buffer

    def _interleave(self, x: Tensor) -> Tensor:
        rows, h, t, d = x.shape
        b = rows // self.group
        return x.view(b, self.group, h, t, d).permute(0, 2, 3, 1, 4).reshape(b, h, t * self.group, d)


class Packing:
    """The real (non-padding) positions of a right-padded batch, so that the position-wise work
    (projections, feed-forward, layer norms, dropout) runs on the ``n`` real rows only.

    Layers then hold activations packed as (n, d); attention, the one step that mixes positions,
    scatters its projections back to (batch, length) around the kernel (padding rows zero,
    hidden from every query by the mask) and packs its output again."""

    def __init__(self, real: Tensor):
        """``real``: (batch, length) boolean, True at the positions to keep."""
        self.batch, self.length = real.shape
        self.index = real.flatten().nonzero().squeeze(1)

    def pack(self, x: Tensor) -> Tensor:
        """(batch, length, d) → (n, d)."""
        return x.reshape(-1, x.size(-1)).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(n, d) → (batch, length, d), zeros at the positions left out."""
        padded = x.new_zeros(self.batch * self.length, x.size(-1)).index_copy(0, self.index, x)
        return padded.view(self.batch, self.length, -1)


@dataclass
class DecoderState:
    """What incremental decoding keeps between steps: per layer, the self-attention cache and
    the cross-attention cache (the encoder's keys/values, computed once), plus the source mask.

    With ``group`` > 1 (a beam: ``group`` consecutive decoder rows per sentence), the rows of a
    sentence share its caches (:class:`BeamKVCache`), and ``origin`` (sentences, group, offset)
    records, for each hypothesis and each past step, the beam slot that wrote its ancestor's key
    then; :meth:`self_attention_mask` turns it into the mask that lets each hypothesis see its
    own ancestors only."""

    memory_mask: Tensor | None
    self_caches: list[KVCache] = field(default_factory=list)
    cross_caches: list[KVCache] = field(default_factory=list)
    offset: int = 0
    memory: Tensor | None = None  # the encoder output, until the first step has cached it
    group: int = 1                # decoder rows per source sentence (the beam)
    origin: Tensor | None = None  # beams only: (sentences, group, offset) beam slots of the ancestors
    fused: tuple | bool | None = None  # nn/fused.py's (layout, its layers for the kernel, made once); False: not

    def self_attention_mask(self, rows: int, length: int, device) -> Tensor | None:
        """The self-attention mask for ``length`` new positions of ``rows`` decoder rows (and,
        for beams, the ancestry extended with them). Without groups: causal, or None for one
        position. With groups: (sentences, 1, group · length, (offset + length) · group); query
        ``i · length + l`` (beam slot i, new position l) sees key ``s · group + j`` when slot j
        held its ancestor at step s, s <= offset + l."""
        t = self.offset
        if self.group == 1:
            return _causal(length, t, device)[None, None] if length > 1 else None
        k = self.group
        new = torch.arange(k, device=device).view(1, k, 1).expand(rows // k, k, length)
        self.origin = new if self.origin is None else torch.cat([self.origin, new], dim=2)
        ancestors = self.origin.unsqueeze(-1) == torch.arange(k, device=device)  # (b, i, s, j)
        causal = _causal(length, t, device)                            # (l, s)
        mask = ancestors[:, :, None, :, :] & causal[None, None, :, :, None]      # (b, i, l, s, j)
        return mask.view(rows // k, 1, k * length, (t + length) * k)

    def skip(self, count: int, rows: int, device) -> None:
        """Count ``count`` places as decoded before the first token: prefix-tuning's keys, which the
        first step puts in the caches (nn/prefix.py). In a beam each hypothesis sees its own row's."""
        self.offset += count
        if self.group > 1:
            k = self.group
            self.origin = torch.arange(k, device=device).view(1, k, 1).expand(rows // k, k, count)

    @property
    def rewinds(self) -> bool:
        """Whether :meth:`truncate` can forget positions: every self-attention cache keeps all its
        keys (not a beam's shared one, a sliding window's last keys or a Performer's running sums)."""
        return all(cache.rewinds for cache in self.self_caches)

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on, as if only the first ``length`` had been
        decoded: speculative decoding's rollback of the draft tokens it rejected."""
        if not self.rewinds:
            raise AtencionError("this decoding state cannot forget positions: a cache of it keeps only recent keys "
                                "or running sums, or is a beam's")
        for cache in self.self_caches:
            cache.truncate(length)
        self.offset = min(self.offset, length)

    def reorder(self, sentences: Tensor, beams: Tensor | None = None) -> None:
        """Keep the sentences ``sentences`` (indices into the current ones, in that order).

        Without groups each sentence is one decoder row. With groups (a beam), ``beams``
        (kept sentences, group) says which beam slot of its sentence each new hypothesis comes
        from: the caches, one per sentence, follow the sentences; within a sentence only
        ``origin``, the ancestry the self-attention mask is built from, is permuted."""
        if self.group > 1:
            if beams is None or beams.shape != (len(sentences), self.group):
                raise AtencionError(f"a beam state needs beams shaped ({len(sentences)}, {self.group}), got "
                                    f"{None if beams is None else tuple(beams.shape)}")
            if self.origin is not None:
                slots = beams[:, :, None].expand(-1, -1, self.origin.size(2))
                self.origin = self.origin.index_select(0, sentences).gather(1, slots)
        mask = self.memory_mask
        if mask is not None and torch.equal(sentences, torch.arange(mask.size(0), device=sentences.device)):
            return  # every sentence stays where it is: nothing to copy
        for cache in self.self_caches + self.cross_caches:
            cache.reorder(sentences)
        if self.memory is not None:
            self.memory = self.memory.index_select(0, sentences)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, sentences)
