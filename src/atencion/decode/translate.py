"""Text in, text out: subwords → length-sorted batches → search → detokenized text, in input order
(``translate_lines``); any source the encoder reads, token ids or log-mel frames, searched in
length-sorted batches (``decode_sources``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..data.batching import token_batches
from ..data.tokenizer import Tokenizer
from ..errors import AtencionError
from ..nn.model import Model
from .search import beam_search, greedy_search
from .settings import DecodeConfig, decode_config


@dataclass
class Translation:
    text: str
    score: float          # length-normalised log-probability (0.0 for greedy and empty input)
    tokens: list[int]


def translate_lines(model: Model, tokenizer: Tokenizer, lines: list[str],
                    decode: DecodeConfig | None = None, *, nbest: int = 1, max_src_tokens: int = 0,
                    source: str = "input", **settings: Any) -> list[list[Translation]]:
    """The ``nbest`` best translations of every line, in the order of ``lines``, decoded as
    ``decode`` says (default: ``DecodeConfig()``; loose ``beam=``, ``alpha=``, ... keywords of older
    calls override it).

    An empty (or all-blank) line gets one empty translation, so output lines match input lines.
    ``max_src_tokens`` (0: none): a line of more subwords is refused, naming ``source`` and the
    line, before anything is decoded. A model whose scores are not finite (diverged weights) is
    an AtencionError, never a missing line.
    """
    d = decode_config(decode, **settings)
    cfg = model.cfg
    encoded = [tokenizer.encode_src(line.strip()) if line.strip() else [] for line in lines]
    if max_src_tokens:
        for number, ids in enumerate(encoded, start=1):
            if len(ids) > max_src_tokens:
                raise AtencionError(f"{source} line {number}: {len(ids)} subword pieces, more than the "
                                    f"limit of {max_src_tokens} (--max-input-tokens)")
    results: list[list[Translation]] = [[Translation("", 0.0, [])] for _ in lines]
    todo = [i for i, ids in enumerate(encoded) if ids]

    def batch(group: list[int]) -> tuple[Tensor, None]:
        """The token ids of ``todo[j]`` for j in ``group``, each + EOS, right-padded."""
        rows = [encoded[todo[j]] for j in group]
        src = torch.full((len(rows), max(len(ids) for ids in rows) + 1), cfg.pad_id, dtype=torch.long)
        for r, ids in enumerate(rows):
            src[r, : len(ids) + 1] = torch.tensor(ids + [cfg.eos_id])
        return src, None

    found = decode_sources(model, tokenizer, [len(encoded[i]) for i in todo], batch, d, nbest,
                           lambda j: f"{source} line {todo[j] + 1}")
    for i, hyps in zip(todo, found):
        results[i] = hyps
    return results


def decode_sources(model: Model, tokenizer: Tokenizer, lengths: list[int],
                   batch: Callable[[list[int]], tuple[Tensor, Tensor | None]], decode: DecodeConfig, nbest: int = 1,
                   where: Callable[[int], str] = lambda i: f"source {i + 1}") -> list[list[Translation]]:
    """The ``nbest`` best outputs of each of ``len(lengths)`` sources, in their order, decoded
    (greedy for beam 1, else beam search) as ``decode`` says, with the target side of
    ``tokenizer``: sources of similar ``lengths`` (source positions) batched together up to
    ``decode.batch_tokens``; ``batch(indices)`` gives those sources' batch and, for a source
    that is not token ids (log-mel frames), their lengths (else None). A translator's lines and a
    speech model's recordings (tasks/transcribe.py) are searched alike here. A source without
    a finite hypothesis (diverged weights) is an AtencionError naming ``where(index)``."""
    d = decode
    if d.beam < 1 or nbest < 1 or nbest > d.beam:
        raise AtencionError(f"need 1 ≤ nbest ≤ beam, got beam={d.beam}, nbest={nbest}")
    model.eval()
    device = next(model.parameters()).device
    results: list[list[Translation]] = [[] for _ in lengths]
    for group in token_batches([(n, n) for n in lengths], d.batch_tokens, seed=None):
        src, src_lengths = batch(group)
        src, src_lengths = src.to(device), None if src_lengths is None else src_lengths.to(device)
        if d.beam == 1:
            outputs = [[(tokens, 0.0)] for tokens in greedy_search(model, src, d.max_len_a, d.max_len_b,
                                                                    lengths=src_lengths)]
        else:
            outputs = [[(h.tokens, h.score) for h in hyps]
                       for hyps in beam_search(model, src, d.beam, d.alpha, d.max_len_a, d.max_len_b, nbest,
                                               lengths=src_lengths)]
        for i, hyps in zip(group, outputs):
            if len(hyps) < nbest:
                raise AtencionError(f"{where(i)}: the model's scores are not finite (NaN), so it has no output; "
                                    f"its weights are broken")
            results[i] = [Translation(tokenizer.decode_tgt(tokens), score, tokens) for tokens, score in hyps]
    return results
