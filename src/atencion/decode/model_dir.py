"""One place that loads a model directory: config.json, model.safetensors and the tokenizer,
checked against each other, on the device asked for, optionally as int8."""

from __future__ import annotations

import os
from pathlib import Path

from ..data.tokenizer import INFO_FILE, Tokenizer
from ..devices import resolve_device
from ..errors import AtencionError
from ..fileio import json_line, need_dir
from ..nn.lora import merge_lora
from ..nn.model import CONFIG_FILE, Model, load_model


def load_model_dir(path: str | os.PathLike, device: str = "cpu", int8: bool = False,
                   what: str = "--model", merge: bool = True) -> tuple[Model, Tokenizer]:
    """The model (in eval mode) and tokenizer of the model directory ``path``; ``what`` names
    the option it came from in messages. The tokenizer's vocabularies must be the model's. The
    LoRA adapters of an adapted model are folded into its weights unless ``merge`` is False."""
    path = need_dir(path, what)
    model = load_model(path, map_location=resolve_device(device)).eval()
    if merge:
        merge_lora(model)
    tokenizer = Tokenizer.load(path)
    check_vocabularies(path, model, tokenizer)
    if int8:
        from ..nn.quantize import quantize_int8

        model = quantize_int8(model)
    return model, tokenizer


def check_vocabularies(path: Path, model: Model, tokenizer: Tokenizer) -> None:
    cfg = model.cfg
    for side, pieces, key, size in (("source", tokenizer.src_vocab_size, "vocab_size", cfg.vocab_size),
                                     ("target", tokenizer.tgt_vocab_size, "tgt_vocab_size", cfg.target_vocab_size)):
        if pieces != size:
            shown = key if key == "vocab_size" or cfg.tgt_vocab_size is not None else "vocab_size"
            raise AtencionError(f"{path / INFO_FILE}: the {side} tokenizer has {pieces} pieces but "
                                f"{path / CONFIG_FILE} line {json_line(path / CONFIG_FILE, shown)} gives the "
                                f"model {size}; the files come from different runs")
