"""Export to a Hugging Face ``MarianMTModel`` directory: the model ``interop.marian.to_marian``
converts (weights and config; see ``interop/marian.py`` for the permutation of the d_model axis
and what Marian refuses), saved with a generation config and, with a tokenizer, the
MarianTokenizer files.

Marian cannot express pre-LN (``norm_first``), learned positions, or a LayerNorm ε other than
its fixed 1e-5; those are refused with a ValueError. Missing biases (``bias: false``) are
written as zeros.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..interop.marian import to_marian


def _save_marian_tokenizer(tokenizer, directory: Path) -> None:
    """MarianTokenizer files (source.spm, target.spm, vocab.json, ...) mapping pieces to our ids."""
    from transformers import MarianTokenizer

    work = directory / ".spm"
    work.mkdir()
    try:
        source, target = work / "source.spm", work / "target.spm"
        source.write_bytes(tokenizer.src.serialized_model_proto())
        target.write_bytes(tokenizer.tgt.serialized_model_proto())
        vocab = work / "vocab.json"
        pieces = {tokenizer.src.id_to_piece(i): i for i in range(tokenizer.src_vocab_size)}
        vocab.write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
        extra = {}
        if not tokenizer.joint:
            target_vocab = work / "target_vocab.json"
            target_pieces = {tokenizer.tgt.id_to_piece(i): i for i in range(tokenizer.tgt_vocab_size)}
            target_vocab.write_text(json.dumps(target_pieces, ensure_ascii=False), encoding="utf-8")
            extra = {"separate_vocabs": True, "target_vocab_file": str(target_vocab)}
        hf_tok = MarianTokenizer(str(source), str(target), str(vocab), **extra)
        hf_tok.save_pretrained(str(directory))
    finally:
        for path in work.iterdir():
            path.unlink()
        work.rmdir()


def export_hf(model, directory: str | os.PathLike, tokenizer=None) -> None:
    """Write a MarianMTModel directory (config.json, generation_config.json, model.safetensors
    and, with a tokenizer, the MarianTokenizer files) into the existing empty ``directory``."""
    from transformers import GenerationConfig

    cfg = model.cfg
    hf = to_marian(model)
    # generate() starts from BOS and never emits PAD or BOS, as atencion's search does (its
    # length penalty, len ** length_penalty, is not atencion's ((5 + len) / 6) ** alpha).
    hf.generation_config = GenerationConfig(
        decoder_start_token_id=cfg.bos_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id, bad_words_ids=[[cfg.pad_id], [cfg.bos_id]], num_beams=4,
        max_length=cfg.max_positions)
    hf.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer is not None and tokenizer.foreign:  # a Marian directory's own files, as they were
        tokenizer.save(directory)
    elif tokenizer is not None:
        _save_marian_tokenizer(tokenizer, Path(directory))
