"""The decoding settings that travel together: beam size, length penalty, maximum output length,
batch size (§6.1 of the paper: beam 4, α = 0.6, input length + 50).

One :class:`DecodeConfig` is the ``decode:`` section of a training config (validation BLEU), the
decoding options of ``atencion translate`` and ``evaluate``, and a request of ``atencion serve``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class DecodeConfig:
    """How to decode: §6.1's beam search with a length penalty, and its limits."""

    beam: int = 4                       # beam size; 1 is greedy search
    alpha: float = 0.6                  # length penalty of Wu et al. (2016)
    max_len_a: float = 1.0              # output length ≤ a · source length + b
    max_len_b: int = 50
    batch_tokens: int = 4096            # source tokens per decoding batch


def decode_config(decode: DecodeConfig | None = None, **settings) -> DecodeConfig:
    """``decode`` (default: ``DecodeConfig()``) with the loose keyword ``settings`` of older calls
    (``beam=4, alpha=0.6, ...``) put in; an unknown name is a TypeError."""
    if decode is not None and not isinstance(decode, DecodeConfig):
        raise TypeError(f"expected a DecodeConfig, got {decode!r} (pass beam, alpha, ... as DecodeConfig(beam=...))")
    decode = decode or DecodeConfig()
    return dataclasses.replace(decode, **settings) if settings else decode
