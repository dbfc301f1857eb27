"""`atencion attention` (``attention_report``): every attention map of one sentence pair, written
as files; `atencion aer` (``aer_report``): how well cross-attention aligns words.

OUT/encoder.png, decoder.png, cross.png   a layers × heads grid of heatmaps for each kind
OUT/cross_mean.png                        cross-attention averaged over every head and layer
OUT/bertviz.json                          piece-level weights in the form BertViz takes
OUT/attention.html                        one self-contained page to explore heads and layers

A single-stack model has one kind, its self-attention (see ``capture_self_attention``): a GPT's
``decoder`` (causal, over its text and what it generated) or a BERT's ``encoder``
(bidirectional, over <s> sentence </s>). ``write_self_attention_report`` writes KIND.png,
KIND_mean.png (every head and layer averaged), bertviz.json and attention.html; bertviz.json
then holds only that kind's two keys, e.g. ``decoder_attention`` and ``decoder_tokens``, which
BertViz's views take alone (``head_view(decoder_attention=..., decoder_tokens=...)``).

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

from ..config import TWO_STACKS
from ..data.tokenizer import check_text
from ..decode.settings import DecodeConfig, decode_config
from ..errors import AtencionError
from ..fileio import atomic_write, need_file, need_output_dir
from .attention import (
    ARCH_NAMES,
    Attention,
    InputAttention,
    SelfAttention,
    capture_attention,
    capture_input_attention,
    capture_self_attention,
    evaluate_alignment,
    format_pharaoh,
    require_cross_attention,
    self_attention_ids,
    word_alignment,
)
from .html import attention_html
from .plots import grid_figure, image_attention_figure, mean_figure, save, spectrogram_attention_figure

log = logging.getLogger(__name__)


def bertviz_data(attention: Attention | SelfAttention) -> dict[str, Any]:
    """The piece-level maps as BertViz's encoder-decoder views take them, every kind present (see
    the module docstring): KIND_attention for each, and the tokens of the encoder and decoder."""
    def layers(amap):
        return [amap.weights[layer][None].tolist() for layer in range(amap.weights.shape[0])]

    maps = attention.maps()
    data = {f"{kind}_attention": layers(amap) for kind, amap in maps.items()}
    data.update({f"{kind}_tokens": maps[kind].rows for kind in ("encoder", "decoder") if kind in maps})
    if "cross" in maps and "encoder" not in maps:  # an RNN's one map: its keys are the source's tokens
        data.update(encoder_tokens=maps["cross"].cols, decoder_tokens=maps["cross"].rows)
    return data


def write_attention_report(model, tokenizer, src: str, out: str | Path, tgt: str | None = None,
                           words: bool = False, shift: str = "predict", decode: DecodeConfig | None = None,
                           max_tokens: int = 128, **settings: Any) -> dict[str, Any]:
    """Capture every attention map of ``src`` → ``tgt`` and write encoder.png, decoder.png, cross.png,
    cross_mean.png, bertviz.json and attention.html into ``out``.

    Without ``tgt`` the model translates ``src`` first (beam search as ``decode`` says; default
    ``DecodeConfig()``, loose ``beam=``, ... keywords override it) and its own output, token for
    token, is the target. With ``words`` the PNGs and the page show words (see
    ``AttentionMap.to_words``); bertviz.json stays piece-level. Files of these names in ``out``
    are replaced. Returns a summary: the pair, the layer-averaged word alignment, the files.
    A side of more than ``max_tokens`` subword pieces is refused before the maps are drawn (their
    size grows with the square of the length); the source is checked before any work, as is text
    that is not valid Unicode (``check_text``).
    """
    from ..decode.translate import translate_lines

    decode = decode_config(decode, **settings)
    check_text(src, "--src")
    if tgt is not None:
        check_text(tgt, "--tgt")
    require_cross_attention(model, "a sentence pair's attention (--src, --tgt)")
    out = _output_dir(out)
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
    files = _write_files(attention, out, words, "cross")
    return {"src": attention.src, "tgt": attention.tgt, "decoded": tgt is None, "shift": shift,
            "words": words, "alignment": format_pharaoh(word_alignment(attention.cross)),
            "out": str(out), "files": files}


def write_self_attention_report(model, tokenizer, text: str, out: str | Path, words: bool = False,
                                max_new_tokens: int = 0, max_tokens: int = 128) -> dict[str, Any]:
    """Capture a single-stack model's self-attention over ``text`` (and, for a GPT, the
    ``max_new_tokens`` it generates greedily after it) and write KIND.png, KIND_mean.png,
    bertviz.json and attention.html into ``out`` (files of these names are replaced). ``words``
    as in ``write_attention_report``. A sequence of more than ``max_tokens`` tokens in all
    (text, generated tokens, and a BERT's <s> and </s>) is refused before any work. Returns a
    summary: the text, what was generated, the number of tokens (new ones among them), the files."""
    check_text(text, "--text")
    out = _output_dir(out)
    total = len(self_attention_ids(model, tokenizer, text)) + max_new_tokens
    if total > max_tokens:
        new = f" + {max_new_tokens} new (--max-new-tokens)" if max_new_tokens else ""
        raise AtencionError(f"--text: {total - max_new_tokens} tokens{new}, more than the limit of {max_tokens} "
                            f"(--max-tokens); attention maps of a sequence that long cannot be read")
    attention = capture_self_attention(model, tokenizer, text, max_new_tokens)
    kind = attention.self_attention.kind
    files = _write_files(attention, out, words, kind)
    return {"arch": model.cfg.arch, "text": attention.text, "generated": attention.generated,
            "tokens": len(attention.self_attention.rows), "new_tokens": attention.new_tokens, "words": words,
            "out": str(out), "files": files}


# The options of `atencion attention` that only some architectures take: the archs, and what the option is.
ATTENTION_OPTIONS = {
    "tgt": (TWO_STACKS, "teacher-forces a translation's target, for its cross-attention and alignment"),
    "shift": (TWO_STACKS, "picks a translation's cross-attention rows, for its alignment"),
    "beam": (TWO_STACKS, "is the beam of the translation shown (a GPT generates greedily: --max-new-tokens)"),
    "max_new_tokens": (("decoder",), "is the number of tokens a GPT generates after --text"),
}


# The option of `atencion attention` that names the file a model of each input kind reads.
FILE_OPTIONS = {"patches": "--image", "spectrogram": "--audio"}


def write_input_attention_report(model, tokenizer, path: str | Path, option: str, out: str | Path) -> dict[str, Any]:
    """The attention of a model that reads images or recordings, on the file ``path`` (given as
    ``option``, --image or --audio), written into ``out``: attention.png and attention.json
    (``InputAttention.to_json``). A ViT: the image, its [CLS] token's last-layer attention per
    head and their mean, and the rollout's [CLS] row, each over the patch grid overlaid on the
    image. A speech classifier: the same rows (pooled as its head pools: [CLS] or the mean over
    positions) under the log-mel spectrogram. A speech-to-text model: the decoder's last-layer
    cross-attention (head mean) over the frames for each character it writes, under the
    spectrogram. The file is read and the maps computed before anything is written."""
    from ..nn.inputs import input_kind, read_inputs

    kind = input_kind(model.cfg)
    expected = FILE_OPTIONS.get(kind.name)
    if expected != option:
        reads = "tokens: give it --text" if expected is None else f"{kind.takes}: give it {expected}"
        raise AtencionError(f"{option}: this model reads {reads}")
    out = _output_dir(out)
    example = read_inputs(model.cfg.inputs, [Path(path)], lambda i: option)[0]
    attention = capture_input_attention(model, tokenizer, example)
    figure = input_attention_figure(attention)
    out.mkdir(parents=True, exist_ok=True)
    save(figure, out / "attention.png")
    data = json.dumps({"file": str(path), **attention.to_json()}, ensure_ascii=False)
    atomic_write(out / "attention.json", lambda tmp: tmp.write_text(data, encoding="utf-8"))
    log.info("wrote attention.png, attention.json into %s", out)
    summary = {"kind": attention.kind, "file": str(path), "out": str(out), "files": ["attention.png",
                                                                                     "attention.json"]}
    return summary | ({"text": attention.text} if attention.kind == "transcribe" else {})


def input_attention_figure(attention: InputAttention):
    """The figure of ``write_input_attention_report``."""
    heads = attention.last_layer()
    pooled = "[CLS]" if attention.pooling == "first" else "pooled"
    rows = {f"head {h + 1}": weights for h, weights in enumerate(heads)}
    rows.update({"mean": heads.mean(axis=0), "rollout": attention.pooled(attention.rollout)})
    if attention.kind == "patches":
        maps = {f"{pooled} {label}" if label != "rollout" else "rollout": values[1:] for label, values in rows.items()}
        return image_attention_figure(attention.features, maps, attention.grid)
    if attention.kind == "spectrogram":
        return spectrogram_attention_figure(attention.features, list(rows.items()),
                                            f"{pooled} attention over the frames (last layer; rollout)")
    cross = attention.cross
    mean = cross.mean(cross.weights.shape[0] - 1)
    return spectrogram_attention_figure(attention.features, list(zip(cross.rows, mean)),
                                        f"cross-attention of {attention.text!r} (last layer, mean of the heads)",
                                        "written")


def attention_report(model: str, src: str | None, out: str | Path, tgt: str | None = None, words: bool = False,
                     shift: str | None = None, beam: int | None = None, max_new_tokens: int = 0,
                     max_tokens: int = 128, device: str = "cpu", image: str | None = None,
                     audio: str | None = None) -> dict[str, Any]:
    """`atencion attention`: every attention map of the model directory ``model`` on ``src``,
    written into ``out``: a translator's (``write_attention_report``) or a GPT's or a BERT's
    (``write_self_attention_report``); on ``image`` or ``audio`` instead, a ViT's or a speech
    model's (``write_input_attention_report``). An option the model's arch does not take is
    refused, naming it (``ATTENTION_OPTIONS``)."""
    from ..nn.inputs import reads_tokens
    from ..nn.model_dir import load_model_dir

    need_output_dir(out, "--out", empty=False)
    loaded, tokenizer = load_model_dir(model, device)
    arch = loaded.cfg.arch
    given = {"tgt": tgt, "shift": shift, "beam": beam, "max_new_tokens": max_new_tokens}
    if image is not None or audio is not None:
        extra = [name for name, value in given.items() if value not in (None, 0)] + (["words"] if words else [])
        if extra:
            raise AtencionError(f"--{extra[0].replace('_', '-')} is for text; --image and --audio take --model and "
                                f"--out only")
        return write_input_attention_report(loaded, tokenizer, image if image is not None else audio,
                                            "--image" if image is not None else "--audio", out)
    if not reads_tokens(loaded.cfg):
        raise AtencionError(f"--text: this model reads {loaded.cfg.inputs['kind']}, not text: give it "
                            f"{FILE_OPTIONS[loaded.cfg.inputs['kind']]}")
    for name, (archs, what) in ATTENTION_OPTIONS.items():
        if given[name] not in (None, 0) and arch not in archs:
            raise AtencionError(f"--{name.replace('_', '-')} {what}; this model is {ARCH_NAMES[arch]}, so it "
                                f"does not apply")
    if arch in TWO_STACKS:
        decode = DecodeConfig() if beam is None else DecodeConfig(beam=beam)
        return write_attention_report(loaded, tokenizer, src, out, tgt, words, shift or "predict", decode, max_tokens)
    return write_self_attention_report(loaded, tokenizer, src, out, words, max_new_tokens, max_tokens)


def aer_report(model: str, src: str, tgt: str, align: str, shift: str = "predict", max_sentences: int = 0,
               max_tokens: int = 1024, device: str = "cpu") -> dict[str, Any]:
    """`atencion aer`: the alignment error rate of the model directory ``model``'s cross-attention
    on the files ``src``, ``tgt`` (teacher-forced) and ``align`` (gold, Pharaoh); see
    ``evaluate_alignment``."""
    from ..data.corpus import read_lines
    from ..nn.model_dir import load_model_dir

    files = [need_file(path, "--" + option) for path, option in ((src, "src"), (tgt, "tgt"), (align, "align"))]
    loaded, tokenizer = load_model_dir(model, device)
    return evaluate_alignment(loaded, tokenizer, read_lines(files[0]), read_lines(files[1]),
                              read_lines(files[2], allow_empty=True), shift, max_sentences,
                              names=[str(f) for f in files], max_tokens=max_tokens)


def _output_dir(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AtencionError(f"--out {out} exists and is not a directory")
    return out


def _write_files(attention: Attention | SelfAttention, out: Path, words: bool, mean_kind: str) -> list[str]:
    """KIND.png for each kind, a mean figure of ``mean_kind`` (KIND_mean.png), bertviz.json (pieces)
    and attention.html; the figures and the page show words with ``words``. Returns the names written."""
    shown = attention.to_words() if words else attention
    out.mkdir(parents=True, exist_ok=True)
    maps = shown.maps()
    for kind, amap in maps.items():
        save(grid_figure(amap), out / f"{kind}.png")
    save(mean_figure(maps[mean_kind]), out / f"{mean_kind}_mean.png")
    bertviz = json.dumps(bertviz_data(attention), ensure_ascii=False)
    atomic_write(out / "bertviz.json", lambda tmp: tmp.write_text(bertviz, encoding="utf-8"))
    page = attention_html(shown)
    atomic_write(out / "attention.html", lambda tmp: tmp.write_text(page, encoding="utf-8"))
    files = [f"{kind}.png" for kind in maps] + [f"{mean_kind}_mean.png", "bertviz.json", "attention.html"]
    log.info("wrote %s into %s", ", ".join(files), out)
    return files


def _check_length(what: str, pieces: int, limit: int) -> None:
    if pieces > limit:
        raise AtencionError(f"{what}: {pieces} subword pieces, more than the limit of {limit} (--max-tokens); "
                            f"attention maps of a sentence that long cannot be read")
