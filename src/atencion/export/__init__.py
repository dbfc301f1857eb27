"""Export a trained model for faster inference elsewhere: CTranslate2, Hugging Face Marian, ONNX,
GGUF (llama.cpp).

Each exporter takes an atencion ``Transformer`` (and its ``Tokenizer``, when there is one) and
writes a directory that works on its own; each is tested to compute what atencion computes.

``gguf`` takes decoder-only models (``arch: decoder``) that llama.cpp has an architecture for,
GPT-2's and Llama's, and refuses the rest naming the setting (``export/gguf.py``); its
``dtype`` is float32, float16 or q8_0. ``ctranslate2`` takes the paper's translator and
decoder-only models (GPT-2, the Llama family, Bloom: ``export/ctranslate2_decoder.py``, which
names what it refuses). The other formats take the paper's translator only for now, and so does
``ctranslate2`` for the other archs: they refuse relative positions (rope, alibi, t5), the
single-stack archs, RMSNorm, unscaled attention, T5's scaled output and mixture-of-experts layers
(``moe``), the attention kinds other than eq. (1) (``attention``: flash, exact, is eq. (1) once
exported) and today's decoder blocks (grouped-query attention, q/k/v biases alone, gated
feed-forward networks).

* ``ctranslate2``: model.bin, config.json, *_vocabulary.json (a decoder's: vocabulary.json),
  atencion.json; refuses nothing else in ModelConfig (only vocabularies it cannot map). Decode
  with ``ctranslate2.ct2_translate``, generate with ``ctranslate2_decoder.ct2_generate``.
* ``hf``: a MarianMTModel (config.json, generation_config.json, model.safetensors); refuses
  pre-LN, learned positions and a LayerNorm ε other than 1e-5.
* ``onnx``: encoder.onnx, decoder_step.onnx (one step with a key/value cache), config.json;
  refuses nothing else.
* ``gguf``: model.gguf, weights and tokenizer in one file.

With a tokenizer, ctranslate2 and onnx also get spm*.model and tokenizer.json, and hf gets
the MarianTokenizer files (source.spm, target.spm, vocab.json).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..errors import AtencionError
from ..interop.common import require_paper_blocks
from ..nn.positional import kinds, position_kind

FORMATS = ("ctranslate2", "hf", "onnx", "gguf")
NEEDS = {"ctranslate2": ["ctranslate2"], "hf": ["transformers"], "onnx": ["onnx", "onnxscript"], "gguf": ["gguf"]}


def _writer(fmt: str, arch: str | None = None):
    """The function that writes ``fmt`` (for ``arch``: CTranslate2 has a spec for translators and
    one for decoder-only models), or an AtencionError naming what is missing."""
    from importlib.util import find_spec

    missing = [name for name in NEEDS.get(fmt, []) if find_spec(name) is None]
    if missing:
        raise AtencionError(f"export to {fmt} needs the Python package(s) {', '.join(missing)}: "
                         f"pip install {' '.join(missing)}")
    if fmt == "ctranslate2" and arch == "decoder":
        from .ctranslate2_decoder import export_ctranslate2_decoder
        return export_ctranslate2_decoder
    if fmt == "ctranslate2":
        from .ctranslate2 import export_ctranslate2
        return export_ctranslate2
    if fmt == "hf":
        from .hf import export_hf
        return export_hf
    if fmt == "onnx":
        from .onnx import export_onnx
        return export_onnx
    if fmt == "gguf":
        from .gguf import export_gguf
        return export_gguf
    raise AtencionError(f"unknown export format {fmt!r}; expected one of {list(FORMATS)}")


def _check_translator(cfg, fmt: str) -> None:
    """Refuse, naming the setting, what the translator formats (ctranslate2's translator spec, hf,
    onnx) cannot export."""
    if position_kind(cfg).role != "absolute":
        raise AtencionError(f"export to {fmt}: positional={cfg.positional!r} (relative positions) cannot be "
                            f"exported yet; only {' and '.join(kinds('absolute'))} positions can")
    if cfg.moe is not None:
        raise AtencionError(f"export to {fmt}: moe (mixture-of-experts feed-forward layers) cannot be exported; "
                            f"the exporters take one dense feed-forward network per layer")
    if cfg.attention is not None and cfg.attention["kind"] not in ("full", "flash"):
        raise AtencionError(f"export to {fmt}: attention.kind {cfg.attention['kind']} cannot be exported; the "
                            f"exporters compute eq. (1) (kinds full and flash)")
    if cfg.arch != "encoder-decoder":
        takes = " and decoder-only models (arch 'decoder')" if fmt == "ctranslate2" else ""
        raise AtencionError(f"export to {fmt}: arch={cfg.arch!r} cannot be exported yet; {fmt} takes the paper's "
                            f"translator (arch 'encoder-decoder'){takes}")
    unsupported = {"norm": ("layernorm",), "activation": ("relu", "gelu"),
                   "scale_attention": (True,), "scale_output": (False,)}
    for key, allowed in unsupported.items():
        if getattr(cfg, key) not in allowed:
            raise AtencionError(f"export to {fmt}: {key}={getattr(cfg, key)!r} cannot be exported yet; the "
                                f"exporters take the paper's translator ({key} {' or '.join(map(repr, allowed))})")
    require_paper_blocks(cfg, f"export to {fmt}", "the exporters, which take the paper's translator")


def export(model, out: str | os.PathLike, fmt: str, tokenizer=None, dtype: str | None = None) -> list[str]:
    """Write ``model`` (and ``tokenizer``) in format ``fmt`` into ``out``, which must be new or
    empty: the files go to a temporary directory that is renamed to ``out`` when complete.
    ``dtype`` (gguf only): float32 (None), float16 or q8_0. Returns the names of the files written."""
    from ..fileio import atomic_directory

    writer = _writer(fmt, model.cfg.arch)
    if model.cfg.d_ff == 0 and fmt != "onnx":  # ONNX traces atencion's own blocks
        raise AtencionError(f"export to {fmt}: d_ff 0 (blocks without a feed-forward sub-layer) cannot be "
                            f"exported; every layer of {fmt} has one (onnx takes it)")
    if fmt == "gguf":
        from .gguf import check_gguf

        dtype = dtype or "float32"
        check_gguf(model.cfg, tokenizer, dtype)
        writer = functools.partial(writer, dtype=dtype)
    elif dtype is not None:
        raise AtencionError(f"--dtype is for --format gguf; {fmt} is written in float32")
    elif fmt == "ctranslate2" and model.cfg.arch == "decoder":
        from .ctranslate2_decoder import check_decoder

        check_decoder(model.cfg)
    else:
        _check_translator(model.cfg, fmt)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AtencionError(f"--out {out} exists and is not an empty directory; choose a new or empty "
                         f"one (nothing was overwritten)")
    model.eval()
    atomic_directory(out, lambda tmp: writer(model, tmp, tokenizer))
    return sorted(p.name for p in out.iterdir())


def export_model_dir(model_dir: str | os.PathLike, out: str | os.PathLike, fmt: str,
                     dtype: str | None = None) -> list[str]:
    """:func:`export` for a model directory (config.json, model.safetensors or LoRA adapters over a
    base, tokenizer if present), atencion's or Hugging Face's (converted on load)."""
    from ..data.hf_tokenizer import MARIAN_FILES
    from ..data.tokenizer import INFO_FILE, Tokenizer
    from ..fileio import need_dir, need_output_dir
    from ..nn.lora import merge_lora
    from ..nn.model import Model
    from ..nn.model_dir import check_vocabularies, load_model
    from ..nn.prefix import unmergeable

    need_dir(model_dir, "--model")
    need_output_dir(out, "--out")
    _writer(fmt)  # an unknown format fails before anything is loaded
    # one model (towers, nn/towers.py, are refused); a LoRA model is exported with its adapters folded in
    model = merge_lora(load_model(model_dir, expect=Model))
    if model.virtual is not None:  # prefix or prompt tuning: nothing to fold in
        raise unmergeable(f"--model {model_dir}", model.virtual.spec.kind)
    tokenizer = None
    if (Path(model_dir) / INFO_FILE).is_file() or (Path(model_dir) / MARIAN_FILES[0]).is_file():
        tokenizer = Tokenizer.load(model_dir)
        check_vocabularies(Path(model_dir), model, tokenizer)
    return export(model, out, fmt, tokenizer, dtype)
