"""The decoding settings that travel together. A translator's search: beam size, length penalty,
maximum output length, batch size (§6.1 of the paper: beam 4, α = 0.6, input length + 50). A
language model's sampling: how many tokens, temperature, top-k, top-p, seed, samples.

One :class:`DecodeConfig` is the ``decode:`` section of a training config (validation BLEU), the
decoding options of ``atencion translate`` and ``evaluate``, and a request of ``atencion serve``;
one :class:`SamplingConfig` the options of ``atencion generate`` and a request to /generate.
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


@dataclass(frozen=True)
class SamplingConfig:
    """How a language model continues a prompt (decode/sample.py): ``num_samples`` samples of
    ``max_new_tokens`` tokens each, drawn at ``temperature`` (0: greedy) among the ``top_k`` most
    likely tokens (0: all) and the nucleus of probability ``top_p`` (1: all), from ``seed`` (None: a
    fresh one); with a draft model, ``draft_tokens`` proposed per round of speculative decoding."""

    max_new_tokens: int = 200
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    num_samples: int = 1
    draft_tokens: int = 4

    def check(self) -> None:
        """Refuse, in one line naming the option, settings that draw no distribution (``check_sampling``)
        or no sample."""
        from ..errors import AtencionError
        from .sample import check_sampling

        check_sampling(self.temperature, self.top_k, self.top_p)
        for key in ("max_new_tokens", "num_samples", "draft_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AtencionError(f"--{key.replace('_', '-')} must be a positive integer, got {value!r}")


def sampling_config(sampling: SamplingConfig | None = None, **settings) -> SamplingConfig:
    """``sampling`` (default: ``SamplingConfig()``) with loose keyword ``settings`` put in
    (``max_new_tokens=100, seed=0``), as ``decode_config`` does; an unknown name is a TypeError."""
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise TypeError(f"expected a SamplingConfig, got {sampling!r} (pass max_new_tokens, temperature, ... as "
                        f"SamplingConfig(max_new_tokens=...))")
    sampling = sampling or SamplingConfig()
    return dataclasses.replace(sampling, **settings) if settings else sampling
