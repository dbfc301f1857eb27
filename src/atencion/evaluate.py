"""Scores: sacreBLEU (13a), tokenized lower-cased BLEU (multi-bleu.perl style), chrF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .data.corpus import read_lines


def score(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """``bleu``: sacreBLEU with its 13a tokenizer, on the text as written. ``bleu_tok``: BLEU
    on the lower-cased text split at spaces (tokenize='none'), comparable to multi-bleu.perl
    and to published numbers when both sides are already tokenized (Multi30k's tok/ files).
    ``chrf``: sacreBLEU's chrF."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    refs = [references]
    return {
        "bleu": round(BLEU(tokenize="13a").corpus_score(hypotheses, refs).score, 2),
        "bleu_tok": round(BLEU(tokenize="none", lowercase=True).corpus_score(hypotheses, refs).score, 2),
        "chrf": round(CHRF().corpus_score(hypotheses, refs).score, 2),
    }


def evaluate(model_dir: str | Path, src: str | Path, ref: str | Path, beam: int = 4, alpha: float = 0.6,
             max_len_a: float = 1.0, max_len_b: int = 50, batch_tokens: int = 4096,
             output: str | Path | None = None, device: str = "cpu") -> dict[str, Any]:
    """Translate ``src`` with the model in ``model_dir`` and score it against ``ref``."""
    from .data.tokenizer import Tokenizer
    from .decode.translate import translate_lines
    from .nn.transformer import Transformer

    sources, references = read_lines(src), read_lines(ref)
    if len(sources) != len(references):
        raise ValueError(f"{src} has {len(sources)} lines but {ref} has {len(references)}; "
                         f"they must be aligned line by line")
    model = Transformer.load(model_dir, map_location=device).eval()
    tokenizer = Tokenizer.load(model_dir)
    translations = translate_lines(model, tokenizer, sources, beam, alpha, max_len_a, max_len_b, batch_tokens)
    hypotheses = [t[0].text for t in translations]
    if output is not None:
        Path(output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    result: dict[str, Any] = score(hypotheses, references)
    result.update(sentences=len(sources), beam=beam, alpha=alpha, max_len_a=max_len_a,
                  max_len_b=max_len_b, model=str(model_dir), src=str(src), ref=str(ref))
    return result
