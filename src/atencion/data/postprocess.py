"""From tokenized, lower-cased output back to text as people write it, to score with sacreBLEU
against the raw references: a recaser learnt from raw text, then Moses detokenization.

A model trained on Multi30k's tok/ files writes ``ein mann mit einem roten hut .``; the raw
reference reads ``Ein Mann mit einem roten Hut.``. ``Recaser`` gives each token the casing it
has most often in raw text of the same language (outside sentence starts, where every word is
capitalised) and capitalises the sentence's first letter; ``Detokenizer`` undoes the Moses
tokenization (``hut .`` → ``hut.``, ``&apos;`` → ``'``).
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from pathlib import Path


def _moses(kind: str, lang: str):
    try:
        import sacremoses
    except ImportError as e:
        raise ImportError("detokenizing needs sacremoses: pip install sacremoses") from e
    return getattr(sacremoses, kind)(lang=lang)


class Recaser:
    """The most frequent casing of each word in raw text (a truecaser in its simplest form)."""

    def __init__(self, casing: dict[str, str]):
        self.casing = casing

    @classmethod
    def fit(cls, lines: list[str], lang: str) -> "Recaser":
        tokenizer = _moses("MosesTokenizer", lang)
        counts: dict[str, Counter] = defaultdict(Counter)
        first: dict[str, Counter] = defaultdict(Counter)
        for line in lines:
            tokens = tokenizer.tokenize(line, escape=False)
            for i, token in enumerate(tokens):
                (first if i == 0 else counts)[token.lower()][token] += 1
        casing = {word: forms.most_common(1)[0][0] for word, forms in first.items()}
        casing.update({word: forms.most_common(1)[0][0] for word, forms in counts.items()})
        return cls(casing)

    def __call__(self, tokens: list[str]) -> list[str]:
        out = [self.casing.get(t.lower(), t) for t in tokens]
        for i, token in enumerate(out):
            if any(c.isalpha() for c in token):
                out[i] = token[0].upper() + token[1:] if token[0].isalpha() else token
                break
        return out


class Detokenizer:
    """Moses detokenization of space-separated (and XML-escaped) tokens, optionally recased."""

    def __init__(self, lang: str, recaser: Recaser | None = None):
        self.moses = _moses("MosesDetokenizer", lang)
        self.recaser = recaser

    def __call__(self, line: str) -> str:
        tokens = [html.unescape(t) for t in line.split()]
        if self.recaser is not None:
            tokens = self.recaser(tokens)
        return self.moses.detokenize(tokens, unescape=False)


def language_of(path: str | Path) -> str | None:
    """``de`` for names like ``val.de``, ``test_2016_flickr.de.gz`` or ``train.lc.norm.tok.de``
    (a two-letter suffix); None otherwise."""
    parts = Path(path).name.split(".")
    if parts[-1] == "gz":
        parts = parts[:-1]
    return parts[-1] if len(parts) > 1 and parts[-1].isalpha() and len(parts[-1]) == 2 else None
