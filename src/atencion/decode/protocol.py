"""What the searches need from a model: the decoding protocol.

Greedy and beam search (search.py) call only these methods, so any model that implements them
— the Transformer today, an RNN encoder-decoder tomorrow — is searched the same way.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class DecodingState(Protocol):
    """What a model keeps between steps (caches, encoder output)."""

    def reorder(self, sentences: Tensor, beams: Tensor | None = None) -> None:
        """Keep ``sentences`` (indices, in that order); in a beam, ``beams`` (kept sentences,
        group) gives the slot each new hypothesis continues."""


@runtime_checkable
class Decodable(Protocol):
    """A model the searches can decode. ``cfg`` gives pad_id, bos_id, eos_id and
    target_vocab_size."""

    cfg: object
    training: bool

    def encode(self, src_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The encoder output and the source mask."""

    def init_state(self, memory: Tensor, src_mask: Tensor, group: int = 1) -> DecodingState:
        """A fresh state; with ``group`` > 1, ``group`` consecutive rows decode each sentence."""

    def decode_step(self, tgt_ids: Tensor, state: DecodingState) -> Tensor:
        """Logits (rows, new tokens, vocabulary) for the new target tokens, extending ``state``."""
