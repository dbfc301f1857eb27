"""Export to a Hugging Face ``MarianMTModel`` directory: the inverse of ``interop/marian.py``.

Marian is the paper's post-LN Transformer with sinusoidal positions, so an atencion model with
those settings maps onto it weight for weight, after one permutation: Marian's sinusoid table
puts all sines before all cosines where §3.5 interleaves them, so every d_model axis is permuted
with the inverse of the importer's permutation (see ``interop/marian.py``). The rest is config:
``scale_embedding``, shared and tied tables, ``final_logits_bias`` (the output bias, or zeros),
``decoder_start_token_id`` = our BOS id (Marian's own models start from PAD), pad/eos ids,
``max_position_embeddings`` = ``max_positions`` (Marian's table has that many rows).

Marian cannot express pre-LN (``norm_first``), learned positions, or a LayerNorm ε other than
its fixed 1e-5; those are refused with a ValueError. Missing biases (``bias: false``) are
written as zeros.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from ..errors import AtencionError
from ..interop.marian import marian_to_paper_permutation, module_pairs

MARIAN_LAYER_NORM_EPS = 1e-5


def check_marian_compatible(cfg) -> None:
    """Raise a ValueError naming the first setting Marian cannot express."""
    if cfg.norm_first:
        raise AtencionError("hf export: norm_first=true (pre-LN) cannot be expressed by MarianMTModel, "
                         "which is post-LN; export to ctranslate2 or onnx instead")
    if cfg.positional != "sinusoidal":
        raise AtencionError(f"hf export: positional={cfg.positional!r} cannot be expressed by MarianMTModel, "
                         f"whose positions are fixed sinusoids; export to ctranslate2 or onnx instead")
    if cfg.layer_norm_eps != MARIAN_LAYER_NORM_EPS:
        raise AtencionError(f"hf export: layer_norm_eps={cfg.layer_norm_eps} cannot be expressed by "
                         f"MarianMTModel, whose LayerNorms use eps={MARIAN_LAYER_NORM_EPS}")


def marian_config(cfg):
    """The ``transformers.MarianConfig`` of an atencion ModelConfig."""
    from transformers import MarianConfig

    check_marian_compatible(cfg)
    return MarianConfig(
        vocab_size=cfg.vocab_size,
        decoder_vocab_size=cfg.target_vocab_size,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.tie_output,
        max_position_embeddings=cfg.max_positions,
        encoder_layers=cfg.n_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        d_model=cfg.d_model,
        activation_function=cfg.activation,
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=0.0,
        scale_embedding=cfg.scale_embedding,
        pad_token_id=cfg.pad_id,
        eos_token_id=cfg.eos_id,
        bos_token_id=cfg.bos_id,
        decoder_start_token_id=cfg.bos_id,
        forced_eos_token_id=None,   # atencion does not force an EOS at the maximum length
    )


def marian_state_dict(model, hf_keys) -> dict[str, Tensor]:
    """Every tensor of a MarianMTModel (names in ``hf_keys``) from the atencion ``model``."""
    cfg = model.cfg
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    # paper_features = marian_features[..., perm], so marian_features = paper_features[..., inverse]
    inverse = torch.argsort(marian_to_paper_permutation(cfg.d_model))

    def cols(t):   # a d_model input axis
        return t[:, inverse]

    def rows(t):   # a d_model output axis (weight rows, or a bias/LayerNorm vector)
        return t[inverse]

    def bias(name: str, size: int) -> Tensor:
        return ours[name] if name in ours else torch.zeros(size)

    out: dict[str, Tensor] = {}

    def attention(theirs: str, mine: str) -> None:
        d = cfg.d_model
        for j, p in enumerate("qkv"):
            out[f"{theirs}.{p}_proj.weight"] = cols(ours[f"{mine}.in_proj.weight"][j * d:(j + 1) * d])
            out[f"{theirs}.{p}_proj.bias"] = bias(f"{mine}.in_proj.bias", 3 * d)[j * d:(j + 1) * d]
        out[f"{theirs}.out_proj.weight"] = rows(ours[f"{mine}.out_proj.weight"])
        out[f"{theirs}.out_proj.bias"] = rows(bias(f"{mine}.out_proj.bias", d))

    def norm(theirs: str, mine: str) -> None:
        out[f"{theirs}.weight"] = rows(ours[f"{mine}.weight"])
        out[f"{theirs}.bias"] = rows(ours[f"{mine}.bias"])

    def ffn(theirs: str, mine: str) -> None:
        out[f"{theirs}.fc1.weight"] = cols(ours[f"{mine}.linear1.weight"])
        out[f"{theirs}.fc1.bias"] = bias(f"{mine}.linear1.bias", cfg.d_ff)
        out[f"{theirs}.fc2.weight"] = rows(ours[f"{mine}.linear2.weight"])
        out[f"{theirs}.fc2.bias"] = rows(bias(f"{mine}.linear2.bias", cfg.d_model))

    convert = {"attention": attention, "norm": norm, "ffn": ffn}
    for kind, mine, theirs in module_pairs(cfg):
        convert[kind](theirs, mine)

    out["model.encoder.embed_tokens.weight"] = cols(ours["encoder.embed.weight"])
    out["model.decoder.embed_tokens.weight"] = cols(ours["decoder.embed.weight"])
    if cfg.share_embeddings:
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    out["lm_head.weight"] = cols(ours["generator.weight"])
    out["final_logits_bias"] = bias("generator.bias", cfg.target_vocab_size).reshape(1, -1)

    unknown = sorted(set(hf_keys) - set(out) - {k for k in hf_keys if "embed_positions" in k})
    if unknown:
        raise AtencionError(f"hf export: MarianMTModel has tensors this exporter does not fill: {unknown[:5]}")
    return {k: v.contiguous().clone() for k, v in out.items() if k in hf_keys}


def to_marian(model):
    """A ``transformers.MarianMTModel`` computing the same logits as the atencion ``model``."""
    from transformers import MarianMTModel

    hf = MarianMTModel(marian_config(model.cfg)).eval()
    state = hf.state_dict()
    weights = marian_state_dict(model, state.keys())
    hf.load_state_dict({**state, **weights})   # the sinusoid tables stay Marian's own
    return hf


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
    if tokenizer is not None:
        _save_marian_tokenizer(tokenizer, Path(directory))
