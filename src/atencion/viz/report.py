"""`atencion attention`: every attention map of one sentence pair, written as files.

OUT/encoder.png, decoder.png, cross.png   a layers × heads grid of heatmaps for each kind
OUT/cross_mean.png                        cross-attention averaged over every head and layer
OUT/bertviz.json                          piece-level weights in the form BertViz takes
OUT/attention.html                        one self-contained page to explore heads and layers

bertviz.json holds ``encoder_attention``, ``decoder_attention`` and ``cross_attention`` (each a
list over layers of nested lists shaped (1, heads, queries, keys)), ``encoder_tokens`` (source
pieces + </s>) and ``decoder_tokens`` (<s> + target pieces: the decoder's inputs, as BertViz
and Hugging Face label them, whatever the row shift). It is always piece-level and raw. To load
it into BertViz (``pip install bertviz``, in a notebook)::

    import json, torch
    from bertviz import head_view, model_view
    d = json.load(open("OUT/bertviz.json"))
    head_view(encoder_attention=[torch.tensor(a) for a in d["encoder_attention"]],
              decoder_attention=[torch.tensor(a) for a in d["decoder_attention"]],
              cross_attention=[torch.tensor(a) for a in d["cross_attention"]],
              encoder_tokens=d["encoder_tokens"], decoder_tokens=d["decoder_tokens"])
    # model_view(...) takes the same arguments.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..decode.settings import DecodeConfig, decode_config
from ..errors import AtencionError
from ..fileio import atomic_write
from .attention import Attention, capture_attention, format_pharaoh, word_alignment
from .html import attention_html
from .plots import grid_figure, mean_figure, save

log = logging.getLogger(__name__)

FILES = ("encoder.png", "decoder.png", "cross.png", "cross_mean.png", "bertviz.json", "attention.html")


def bertviz_data(attention: Attention) -> dict[str, Any]:
    """The piece-level maps as BertViz's encoder-decoder views take them (see the module docstring)."""
    def layers(amap):
        return [amap.weights[layer][None].tolist() for layer in range(amap.weights.shape[0])]

    return {"encoder_attention": layers(attention.encoder),
            "decoder_attention": layers(attention.decoder),
            "cross_attention": layers(attention.cross),
            "encoder_tokens": attention.encoder.rows,
            "decoder_tokens": attention.decoder.rows}


def write_attention_report(model, tokenizer, src: str, out: str | Path, tgt: str | None = None,
                           words: bool = False, shift: str = "predict", decode: DecodeConfig | None = None,
                           max_tokens: int = 128, **settings: Any) -> dict[str, Any]:
    """Capture every attention map of ``src`` → ``tgt`` and write FILES into ``out``.

    Without ``tgt`` the model translates ``src`` first (beam search as ``decode`` says; default
    ``DecodeConfig()``, loose ``beam=``, ... keywords override it) and its own output, token for
    token, is the target. With ``words`` the PNGs and the page show words (see
    ``AttentionMap.to_words``); bertviz.json stays piece-level. Files of these names in ``out``
    are replaced. Returns a summary: the pair, the layer-averaged word alignment, the files.
    A side of more than ``max_tokens`` subword pieces is refused before the maps are drawn (their
    size grows with the square of the length); the source is checked before any work.
    """
    from ..decode.translate import translate_lines

    decode = decode_config(decode, **settings)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AtencionError(f"--out {out} exists and is not a directory")
    _check_length("--src", len(tokenizer.src_pieces(src)), max_tokens)
    if tgt is not None:
        _check_length("--tgt", len(tokenizer.tgt_pieces(tgt)), max_tokens)
    if tgt is None:
        if not src.strip():
            raise AtencionError("--src: the source sentence is empty")
        best = translate_lines(model, tokenizer, [src], decode, source="--src")[0][0]
        _check_length("the translation of --src", len(best.tokens), max_tokens)
        log.info("decoded (beam %d): %s", decode.beam, best.text)
        attention = capture_attention(model, tokenizer, src, best.tokens, shift)
    else:
        attention = capture_attention(model, tokenizer, src, tgt, shift)
    shown = attention.to_words() if words else attention
    out.mkdir(parents=True, exist_ok=True)

    for kind, amap in shown.maps().items():
        save(grid_figure(amap), out / f"{kind}.png")
    save(mean_figure(shown.cross), out / "cross_mean.png")
    bertviz = json.dumps(bertviz_data(attention), ensure_ascii=False)
    atomic_write(out / "bertviz.json", lambda tmp: tmp.write_text(bertviz, encoding="utf-8"))
    page = attention_html(shown)
    atomic_write(out / "attention.html", lambda tmp: tmp.write_text(page, encoding="utf-8"))
    log.info("wrote %s into %s", ", ".join(FILES), out)

    return {"src": attention.src, "tgt": attention.tgt, "decoded": tgt is None, "shift": shift,
            "words": words, "alignment": format_pharaoh(word_alignment(attention.cross)),
            "out": str(out), "files": list(FILES)}


def _check_length(what: str, pieces: int, limit: int) -> None:
    if pieces > limit:
        raise AtencionError(f"{what}: {pieces} subword pieces, more than the limit of {limit} (--max-tokens); "
                            f"attention maps of a sentence that long cannot be read")
