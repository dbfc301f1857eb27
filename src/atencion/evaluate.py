"""Scores: sacreBLEU (13a), tokenized lower-cased BLEU (multi-bleu.perl style), chrF; and, for
models trained on tokenized lower-cased text, sacreBLEU on the raw references after recasing
and detokenizing the output (``data/postprocess.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .data.corpus import read_lines
from .errors import AtencionError

if TYPE_CHECKING:
    from .decode.settings import DecodeConfig


def score(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """``bleu``: sacreBLEU with its 13a tokenizer, on the text as written. ``bleu_tok``: BLEU
    on the lower-cased text split at spaces (tokenize='none'), comparable to multi-bleu.perl
    and to published numbers when both sides are already tokenized (Multi30k's tok/ files).
    ``chrf``: sacreBLEU's chrF."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise AtencionError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    refs = [references]
    return {
        "bleu": round(BLEU(tokenize="13a").corpus_score(hypotheses, refs).score, 2),
        "bleu_tok": round(BLEU(tokenize="none", lowercase=True).corpus_score(hypotheses, refs).score, 2),
        "chrf": round(CHRF().corpus_score(hypotheses, refs).score, 2),
    }


def score_by_length(sources: list[str], hypotheses: list[str], references: list[str],
                    buckets: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """``score`` of the sentences whose source has ``low`` to ``high`` words (both included), per
    bucket (low, high): its sentences, their exact-match rate, and the scores; an empty bucket
    is left out. Quality against length: Bahdanau et al. (2015), Figure 2."""
    if not len(sources) == len(hypotheses) == len(references):
        raise AtencionError(f"{len(sources)} sources, {len(hypotheses)} hypotheses and {len(references)} "
                            f"references: they must be aligned line by line")
    rows = []
    for low, high in buckets:
        index = [i for i, s in enumerate(sources) if low <= len(s.split()) <= high]
        if index:
            hyps, refs = [hypotheses[i] for i in index], [references[i] for i in index]
            exact = sum(h == r for h, r in zip(hyps, refs)) / len(index)
            rows.append({"words": f"{low}-{high}", "sentences": len(index), "exact_match": round(exact, 4),
                         **score(hyps, refs)})
    return rows


def raw_score(hypotheses: list[str], raw_references: list[str], lang: str,
              recase_from: list[str] | None = None) -> tuple[dict[str, float], list[str]]:
    """Score tokenized lower-cased ``hypotheses`` against raw (cased, untokenized) references:
    detokenize them (Moses rules for ``lang``), recase them when ``recase_from`` (raw text in the
    target language, e.g. the raw training targets) is given, and return sacreBLEU 13a
    (``raw_bleu``, cased; only with a recaser), ``raw_bleu_lc`` (lower-cased) and ``raw_chrf``,
    with the detokenized lines."""
    from sacrebleu.metrics import BLEU, CHRF

    from .data.postprocess import Detokenizer, Recaser

    recaser = Recaser.fit(recase_from, lang) if recase_from is not None else None
    detokenize = Detokenizer(lang, recaser)
    lines = [detokenize(h) for h in hypotheses]
    refs = [raw_references]
    result = {"raw_bleu_lc": round(BLEU(lowercase=True).corpus_score(lines, refs).score, 2)}
    if recaser is not None:
        result["raw_bleu"] = round(BLEU().corpus_score(lines, refs).score, 2)
        result["raw_chrf"] = round(CHRF().corpus_score(lines, refs).score, 2)
    return result, lines


def evaluate(model_dir: str | Path, src: str | Path, ref: str | Path, decode: DecodeConfig | None = None, *,
             output: str | Path | None = None, device: str = "cpu", raw_ref: str | Path | None = None,
             recase_from: str | Path | None = None, lang: str | None = None,
             int8: bool = False, max_src_tokens: int = 0, **settings: Any) -> dict[str, Any]:
    """Translate ``src`` with the model in ``model_dir``, decoding as ``decode`` says (default:
    ``DecodeConfig()``; loose ``beam=``, ``alpha=``, ... keywords override it), and score it against
    ``ref``; with ``raw_ref`` also against the raw references (see ``raw_score``; ``lang`` defaults
    to the suffix of ``raw_ref``'s name, as in ``test.de.gz``). ``int8``: decode with the int8 copy
    of the model (``nn/quantize.py``). ``max_src_tokens``: see ``translate_lines``. Output files are
    written atomically (a failed write leaves an older file as it was)."""
    from .data.postprocess import language_of
    from .decode.settings import decode_config
    from .decode.translate import translate_lines
    from .fileio import atomic_write_text
    from .nn.model_dir import load_model_dir

    d = decode_config(decode, **settings)
    sources, references = read_lines(src), read_lines(ref)
    if len(sources) != len(references):
        raise AtencionError(f"{src} has {len(sources)} lines but {ref} has {len(references)}; "
                         f"they must be aligned line by line")
    if raw_ref is not None:
        raw_references = read_lines(raw_ref)
        if len(raw_references) != len(sources):
            raise AtencionError(f"{raw_ref} has {len(raw_references)} lines but {src} has {len(sources)}; "
                             f"they must be aligned line by line")
        lang = lang or language_of(raw_ref)
        if lang is None:
            raise AtencionError(f"cannot tell the language of {raw_ref} from its name; pass --lang (e.g. de)")
        recase_lines = read_lines(recase_from) if recase_from is not None else None
    model, tokenizer = load_model_dir(model_dir, device, int8)
    translations = translate_lines(model, tokenizer, sources, d, max_src_tokens=max_src_tokens, source=str(src))
    hypotheses = [t[0].text for t in translations]
    if output is not None:
        atomic_write_text(output, "".join(h + "\n" for h in hypotheses))
    result: dict[str, Any] = score(hypotheses, references)
    if raw_ref is not None:
        raw, lines = raw_score(hypotheses, raw_references, lang, recase_lines)
        result.update(raw)
        if output is not None:
            atomic_write_text(f"{output}.detok", "".join(line + "\n" for line in lines))
        result.update(raw_ref=str(raw_ref), recase_from=None if recase_from is None else str(recase_from))
    result.update(sentences=len(sources), int8=int8, beam=d.beam, alpha=d.alpha, max_len_a=d.max_len_a,
                  max_len_b=d.max_len_b, model=str(model_dir), src=str(src), ref=str(ref))
    return result
