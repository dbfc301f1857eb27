"""Convert between a Hugging Face MarianMTModel and an atencion Transformer, exactly: import
(``from_marian``) and export (``to_marian``; ``export/hf.py`` saves its result as a directory).

Marian is the paper's model with three differences, each handled here explicitly:

1. Its sinusoidal table puts all sines before all cosines (column i and d/2+i share a
   frequency) where §3.5 interleaves them (columns 2i and 2i+1). A Transformer is equivariant
   to a permutation of the d_model features of its residual stream, so importing permutes every
   d_model axis (embeddings, LayerNorms, the input side of W^Q/W^K/W^V/W1, the output side of
   W^O/W2); the model then computes the same function with the paper's table. Exporting
   permutes with the inverse.
2. It adds ``final_logits_bias`` to the logits: the imported config sets ``output_bias=True``;
   an exported model without an output bias gets zeros.
3. Its decoder starts from the pad id: the imported config's ``bos_id`` is Marian's
   ``decoder_start_token_id``, and the exporter writes our BOS id there. Target padding is never
   masked here (the causal mask covers right padding), so a pad at position 0 is an ordinary
   start token.

The rest of the export is config: ``scale_embedding``, shared and tied tables, pad/eos ids,
``max_position_embeddings`` = ``max_positions`` (Marian's table has that many rows). Marian
cannot express pre-LN (``norm_first``), learned positions, or a LayerNorm ε other than its fixed
1e-5; those are refused with a ValueError. Missing biases (``bias: false``) are written as zeros.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import ModelConfig
from ..errors import AtencionError
from ..nn.transformer import Transformer
from .common import Pair, export_tensors, import_tensors, load_complete, require_paper_blocks, weight_and_bias

MODEL_TYPE = "marian"
# what a saved checkpoint leaves out: the embedding tables are ``shared`` (when they are one), and the
# output projection is the decoder's table
TIED = {"model.encoder.embed_tokens.weight": "model.shared.weight",
        "model.decoder.embed_tokens.weight": "model.shared.weight",
        "lm_head.weight": "model.decoder.embed_tokens.weight"}


def marian_to_paper_permutation(d_model: int) -> Tensor:
    """``perm`` such that paper_features = marian_features[..., perm]."""
    half = d_model // 2
    perm = torch.empty(d_model, dtype=torch.long)
    perm[0::2] = torch.arange(half)
    perm[1::2] = torch.arange(half, d_model)
    return perm


def config_from_marian(hf_config) -> ModelConfig:
    """The atencion config of a transformers.MarianConfig; unsupported settings raise ValueError."""
    c = hf_config
    pairs = [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    for a, b in pairs:
        if getattr(c, a) != getattr(c, b):
            raise AtencionError(f"Marian config: {a}={getattr(c, a)} differs from {b}={getattr(c, b)}; "
                             f"atencion uses one value for both")
    if c.activation_function not in ("relu", "gelu"):
        raise AtencionError(f"Marian config: activation_function={c.activation_function!r}; "
                         f"atencion supports 'relu' and 'gelu'")
    decoder_vocab = getattr(c, "decoder_vocab_size", None) or c.vocab_size
    share = bool(getattr(c, "share_encoder_decoder_embeddings", True))
    return ModelConfig(
        vocab_size=c.vocab_size,
        tgt_vocab_size=None if share else decoder_vocab,
        n_layers=c.encoder_layers,
        n_decoder_layers=c.decoder_layers,
        d_model=c.d_model,
        d_ff=c.encoder_ffn_dim,
        n_heads=c.encoder_attention_heads,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation=c.activation_function,
        norm_first=False,
        positional="sinusoidal",
        max_positions=c.max_position_embeddings,
        scale_embedding=bool(c.scale_embedding),
        share_embeddings=share,
        tie_output=bool(getattr(c, "tie_word_embeddings", True)),
        output_bias=True,
        pad_id=c.pad_token_id,
        bos_id=c.decoder_start_token_id,
        eos_id=c.eos_token_id,
    )


def name_map(cfg: ModelConfig) -> list[Pair]:
    """The one table the importer and the exporter both walk: every atencion parameter and its
    Marian name, with the permutation of point 1 on each d_model axis (``cols``: an input axis;
    ``rows``: an output axis, i.e. weight rows or a bias/LayerNorm vector) and its inverse."""
    # paper_features = marian_features[..., perm], so marian_features = paper_features[..., inverse]
    perm = marian_to_paper_permutation(cfg.d_model)
    inverse = torch.argsort(perm)
    cols = (lambda t: t[:, perm], lambda t: t[:, inverse])
    rows = (lambda t: t[perm], lambda t: t[inverse])

    def attention(ours: str, theirs: str) -> list[Pair]:
        qkv = [f"{theirs}.{p}_proj" for p in "qkv"]
        return [Pair(f"{ours}.in_proj.weight", tuple(f"{name}.weight" for name in qkv), *cols),
                Pair(f"{ours}.in_proj.bias", tuple(f"{name}.bias" for name in qkv)),
                *weight_and_bias(f"{ours}.out_proj", f"{theirs}.out_proj", *rows)]

    def ffn(ours: str, theirs: str) -> list[Pair]:
        return [Pair(f"{ours}.linear1.weight", f"{theirs}.fc1.weight", *cols),
                Pair(f"{ours}.linear1.bias", f"{theirs}.fc1.bias"),
                *weight_and_bias(f"{ours}.linear2", f"{theirs}.fc2", *rows)]

    pairs = []
    for i in range(cfg.n_layers):
        ours, theirs = f"encoder.layers.{i}", f"model.encoder.layers.{i}"
        pairs += [*attention(f"{ours}.self_attn", f"{theirs}.self_attn"),
                  *weight_and_bias(f"{ours}.res_self.norm", f"{theirs}.self_attn_layer_norm", *rows),
                  *ffn(f"{ours}.ffn", theirs),
                  *weight_and_bias(f"{ours}.res_ffn.norm", f"{theirs}.final_layer_norm", *rows)]
    for i in range(cfg.decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"model.decoder.layers.{i}"
        pairs += [*attention(f"{ours}.self_attn", f"{theirs}.self_attn"),
                  *weight_and_bias(f"{ours}.res_self.norm", f"{theirs}.self_attn_layer_norm", *rows),
                  *attention(f"{ours}.cross_attn", f"{theirs}.encoder_attn"),
                  *weight_and_bias(f"{ours}.res_cross.norm", f"{theirs}.encoder_attn_layer_norm", *rows),
                  *ffn(f"{ours}.ffn", theirs),
                  *weight_and_bias(f"{ours}.res_ffn.norm", f"{theirs}.final_layer_norm", *rows)]
    return pairs + [Pair("encoder.embed.weight", "model.encoder.embed_tokens.weight", *cols),
                    Pair("decoder.embed.weight", "model.decoder.embed_tokens.weight", *cols),
                    Pair("generator.weight", "lm_head.weight", *cols),
                    Pair("generator.bias", "final_logits_bias", lambda t: t.reshape(-1), lambda t: t.reshape(1, -1))]


def import_config(hf_config, architecture: str = "MarianMTModel") -> ModelConfig:
    """The atencion config of a ``MarianMTModel``."""
    return config_from_marian(hf_config)


def import_state(cfg: ModelConfig, state) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``cfg`` and the atencion tensors read from ``state`` (Marian's names, as stored)."""
    return cfg, import_tensors(name_map(cfg), state)


def from_marian(hf_model) -> Transformer:
    """An atencion Transformer computing the same logits as ``hf_model`` (a MarianMTModel)."""
    cfg, out = import_state(import_config(hf_model.config), {k: v.detach() for k, v in hf_model.state_dict().items()})
    return load_complete(Transformer(cfg), out, "Marian import")


MARIAN_LAYER_NORM_EPS = 1e-5


def check_marian_compatible(cfg) -> None:
    """Raise a ValueError naming the first setting Marian cannot express."""
    require_paper_blocks(cfg, "hf export", "MarianMTModel")
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


def marian_state_dict(model, target: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every tensor of a MarianMTModel (``target``: its own state dict) from the atencion ``model``."""
    cfg = model.cfg
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    out = export_tensors(name_map(cfg), ours, target)  # biases we lack (bias: false) as zeros
    if cfg.share_embeddings:
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    hf_keys = set(target)
    unknown = sorted(hf_keys - set(out) - {k for k in hf_keys if "embed_positions" in k})
    if unknown:
        raise AtencionError(f"hf export: MarianMTModel has tensors this exporter does not fill: {unknown[:5]}")
    return {k: v.contiguous().clone() for k, v in out.items() if k in hf_keys}


def to_marian(model):
    """A ``transformers.MarianMTModel`` computing the same logits as the atencion ``model``."""
    from transformers import MarianMTModel

    hf = MarianMTModel(marian_config(model.cfg)).eval()
    state = hf.state_dict()
    weights = marian_state_dict(model, state)
    hf.load_state_dict({**state, **weights})   # the sinusoid tables stay Marian's own
    return hf
