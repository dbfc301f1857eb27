"""Text in, text out: subwords → length-sorted batches → search → detokenized text, in input order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
    if d.beam < 1 or nbest < 1 or nbest > d.beam:
        raise AtencionError(f"need 1 ≤ nbest ≤ beam, got beam={d.beam}, nbest={nbest}")
    model.eval()
    device = next(model.parameters()).device
    cfg = model.cfg
    encoded = [tokenizer.encode_src(line.strip()) if line.strip() else [] for line in lines]
    if max_src_tokens:
        for number, ids in enumerate(encoded, start=1):
            if len(ids) > max_src_tokens:
                raise AtencionError(f"{source} line {number}: {len(ids)} subword pieces, more than the "
                                    f"limit of {max_src_tokens} (--max-input-tokens)")
    results: list[list[Translation]] = [[Translation("", 0.0, [])] for _ in lines]
    todo = [i for i, ids in enumerate(encoded) if ids]
    lengths = [(len(encoded[i]), len(encoded[i])) for i in todo]
    for group in token_batches(lengths, d.batch_tokens, seed=None):
        rows = [todo[j] for j in group]
        longest = max(len(encoded[i]) for i in rows) + 1
        src = torch.full((len(rows), longest), cfg.pad_id, dtype=torch.long)
        for r, i in enumerate(rows):
            src[r, : len(encoded[i]) + 1] = torch.tensor(encoded[i] + [cfg.eos_id])
        src = src.to(device)
        if d.beam == 1:
            outputs = [[(tokens, 0.0)] for tokens in greedy_search(model, src, d.max_len_a, d.max_len_b)]
        else:
            outputs = [[(h.tokens, h.score) for h in hyps]
                       for hyps in beam_search(model, src, d.beam, d.alpha, d.max_len_a, d.max_len_b, nbest)]
        for i, hyps in zip(rows, outputs):
            if len(hyps) < nbest:
                raise AtencionError(f"{source} line {i + 1}: the model's scores are not finite (NaN), so "
                                    f"it has no translation; its weights are broken")
            results[i] = [Translation(tokenizer.decode_tgt(tokens), score, tokens) for tokens, score in hyps]
    return results
