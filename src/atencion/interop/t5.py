"""Convert between a Hugging Face ``T5ForConditionalGeneration`` (original T5, v1.0) and an
atencion Transformer, exactly.

atencion's T5 is the ``t5-small`` preset: pre-LN with RMSNorm (T5's ``T5LayerNorm``: scale
only), no biases, unscaled attention scores, a learned bucketed relative-position bias per
stack (T5 keeps it in block 0's ``relative_attention_bias`` and reuses it in every block of the
stack; atencion calls it ``encoder.relative`` / ``decoder.relative``), one embedding table for
the encoder, the decoder and the tied output projection, and the decoder output multiplied by
d_model^-0.5 before that projection (``scale_output``; transformers' ``scale_decoder_outputs``).
The decoder starts from T5's ``decoder_start_token_id`` (the pad id): the config's ``bos_id``.

T5 cannot express: biases, LayerNorm, post-LN, absolute or other relative positions, scaled
attention or embeddings, separate source/target tables, an untied output projection (transformers
5 always ties T5's ``lm_head`` to ``shared``), an output bias, gated feed-forward networks (T5
v1.1's ``gated-gelu``: atencion has no gated FFN) and ``d_kv`` other than d_model / num_heads.

Training-time dropout differs slightly and does not affect eval logits: T5 has one
``dropout_rate`` (the importer sets both of atencion's ``dropout`` and ``attention_dropout`` to
it; the exporter writes ``dropout``) and also drops inside the feed-forward network (between the
activation and ``wo``), which atencion does not.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..errors import AtencionError
from ..nn.transformer import Transformer
from .common import Pair, export_tensors, import_tensors, load_complete, load_exported, require, require_paper_blocks

# atencion activation ↔ T5's feed_forward_proj (transformers' ACT2FN names)
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu-tanh": "gelu_new"}

MODEL_TYPE = "t5"
# what a saved checkpoint leaves out: the embedding tables and the output projection are ``shared``
TIED = {"lm_head.weight": "shared.weight"}
_FROM_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh"}


def _first_id(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def config_from_t5(hf_config) -> ModelConfig:
    """The atencion config of a transformers.T5Config; what atencion cannot reproduce raises
    AtencionError naming the T5 key."""
    c = hf_config
    if getattr(c, "is_gated_act", False) or c.feed_forward_proj.startswith("gated-"):
        raise AtencionError(f"T5 config: feed_forward_proj={c.feed_forward_proj!r} is a gated feed-forward "
                            f"network (T5 v1.1); atencion's is W2·act(W1·x): use 'relu' or 'gelu'")
    act = getattr(c, "dense_act_fn", c.feed_forward_proj)
    if act not in _FROM_HF_ACTIVATIONS:
        raise AtencionError(f"T5 config: feed_forward_proj={c.feed_forward_proj!r}; atencion supports "
                            f"{sorted(_FROM_HF_ACTIVATIONS)}")
    if c.d_kv * c.num_heads != c.d_model:
        raise AtencionError(f"T5 config: d_kv={c.d_kv} with num_heads={c.num_heads} and d_model={c.d_model}; "
                            f"atencion needs d_kv = d_model / num_heads")
    pad = c.pad_token_id if c.pad_token_id is not None else 0
    start = c.decoder_start_token_id if getattr(c, "decoder_start_token_id", None) is not None else pad
    eos = _first_id(c.eos_token_id)
    return ModelConfig(
        vocab_size=c.vocab_size,
        arch="encoder-decoder",
        n_layers=c.num_layers,
        n_decoder_layers=c.num_decoder_layers if c.num_decoder_layers != c.num_layers else None,
        d_model=c.d_model,
        d_ff=c.d_ff,
        n_heads=c.num_heads,
        dropout=c.dropout_rate,
        attention_dropout=c.dropout_rate,
        activation=_FROM_HF_ACTIVATIONS[act],
        norm_first=True,
        norm="rmsnorm",
        positional="t5",
        relative_buckets=c.relative_attention_num_buckets,
        relative_max_distance=c.relative_attention_max_distance,
        scale_embedding=False,
        share_embeddings=True,
        tie_output=True,
        output_bias=False,
        bias=False,
        layer_norm_eps=c.layer_norm_epsilon,
        scale_attention=False,
        scale_output=bool(getattr(c, "scale_decoder_outputs", getattr(c, "tie_word_embeddings", True))),
        pad_id=pad,
        bos_id=start,
        eos_id=eos if eos is not None else pad,
    )


def check_t5_compatible(cfg: ModelConfig) -> None:
    """Raise AtencionError naming the first setting T5ForConditionalGeneration cannot express."""
    required = [("arch", "encoder-decoder"), ("positional", "t5"), ("norm", "rmsnorm"), ("norm_first", True),
                ("bias", False), ("scale_attention", False), ("scale_embedding", False),
                ("share_embeddings", True), ("tie_output", True), ("output_bias", False),
                ("embedding_norm", False), ("type_vocab_size", 0), ("num_labels", 0)]
    require(cfg, required, "t5 export", "T5ForConditionalGeneration")
    require_paper_blocks(cfg, "t5 export", "T5ForConditionalGeneration")
    if cfg.tgt_vocab_size not in (None, cfg.vocab_size):
        raise AtencionError(f"t5 export: tgt_vocab_size={cfg.tgt_vocab_size} cannot be expressed by "
                            f"T5ForConditionalGeneration, which has one vocabulary")
    if cfg.activation not in _ACTIVATIONS:
        raise AtencionError(f"t5 export: activation={cfg.activation!r} has no T5 feed_forward_proj")


def t5_config(cfg: ModelConfig):
    """The ``transformers.T5Config`` of an atencion ModelConfig."""
    from transformers import T5Config

    check_t5_compatible(cfg)
    return T5Config(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        d_kv=cfg.d_k,
        d_ff=cfg.d_ff,
        num_layers=cfg.n_layers,
        num_decoder_layers=cfg.decoder_layers,
        num_heads=cfg.n_heads,
        relative_attention_num_buckets=cfg.relative_buckets,
        relative_attention_max_distance=cfg.relative_max_distance,
        dropout_rate=cfg.dropout,
        layer_norm_epsilon=cfg.layer_norm_eps,
        feed_forward_proj=_ACTIVATIONS[cfg.activation],
        tie_word_embeddings=cfg.scale_output,  # transformers 5: False means "do not scale" (T5 v1.1)
        pad_token_id=cfg.pad_id,
        eos_token_id=cfg.eos_id,
        decoder_start_token_id=cfg.bos_id,
    )


def name_map(cfg: ModelConfig) -> list[Pair]:
    """The one table both directions walk: every atencion parameter of the attentions (W^Q, W^K,
    W^V stacked into ``in_proj``), RMSNorms, feed-forward networks and relative-position tables
    ((buckets, heads) each) and its T5 name. The embedding tables are handled apart: one atencion
    table is T5's ``shared``, both ``embed_tokens`` and the tied ``lm_head``."""
    def attention(ours: str, theirs: str) -> list[Pair]:
        return [Pair(f"{ours}.in_proj.weight", tuple(f"{theirs}.{p}.weight" for p in "qkv")),
                Pair(f"{ours}.out_proj.weight", f"{theirs}.o.weight")]

    def ffn(ours: str, theirs: str) -> list[Pair]:
        return [Pair(f"{ours}.linear1.weight", f"{theirs}.wi.weight"),
                Pair(f"{ours}.linear2.weight", f"{theirs}.wo.weight")]

    def norm(ours: str, theirs: str) -> Pair:
        return Pair(f"{ours}.weight", f"{theirs}.weight")

    pairs = [Pair("encoder.relative.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
             Pair("decoder.relative.weight", "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
             norm("encoder.final_norm", "encoder.final_layer_norm"),
             norm("decoder.final_norm", "decoder.final_layer_norm")]
    for i in range(cfg.n_layers):
        ours, theirs = f"encoder.layers.{i}", f"encoder.block.{i}.layer"
        pairs += [*attention(f"{ours}.self_attn", f"{theirs}.0.SelfAttention"),
                  norm(f"{ours}.res_self.norm", f"{theirs}.0.layer_norm"),
                  *ffn(f"{ours}.ffn", f"{theirs}.1.DenseReluDense"),
                  norm(f"{ours}.res_ffn.norm", f"{theirs}.1.layer_norm")]
    for i in range(cfg.decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"decoder.block.{i}.layer"
        pairs += [*attention(f"{ours}.self_attn", f"{theirs}.0.SelfAttention"),
                  norm(f"{ours}.res_self.norm", f"{theirs}.0.layer_norm"),
                  *attention(f"{ours}.cross_attn", f"{theirs}.1.EncDecAttention"),
                  norm(f"{ours}.res_cross.norm", f"{theirs}.1.layer_norm"),
                  *ffn(f"{ours}.ffn", f"{theirs}.2.DenseReluDense"),
                  norm(f"{ours}.res_ffn.norm", f"{theirs}.2.layer_norm")]
    return pairs


def import_config(hf_config, architecture: str = "T5ForConditionalGeneration") -> ModelConfig:
    """The atencion config of a ``T5ForConditionalGeneration``."""
    return config_from_t5(hf_config)


def import_state(cfg: ModelConfig, state) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``cfg`` (untied if the checkpoint's ``lm_head`` is not ``shared``: older transformers) and
    the atencion tensors read from ``state`` (T5's names, as stored)."""
    shared, head = state["shared.weight"], state["lm_head.weight"]
    if not torch.equal(head, shared):
        cfg = dataclasses.replace(cfg, tie_output=False)  # an untied head (older transformers): keep it
    out = import_tensors(name_map(cfg), state)
    out["encoder.embed.weight"] = out["decoder.embed.weight"] = shared
    out["generator.weight"] = head if not cfg.tie_output else shared
    return cfg, out


def from_t5(hf_model) -> Transformer:
    """An atencion Transformer (in eval mode) computing the same logits as ``hf_model``, a
    ``T5ForConditionalGeneration``."""
    cfg, out = import_state(import_config(hf_model.config), {k: v.detach() for k, v in hf_model.state_dict().items()})
    return load_complete(Transformer(cfg), out, "T5 import").eval()


def to_t5(model: Transformer):
    """A ``T5ForConditionalGeneration`` (in eval mode) computing the same logits as ``model``;
    settings T5 cannot express raise AtencionError naming the key."""
    from transformers import T5ForConditionalGeneration

    cfg = model.cfg
    hf = T5ForConditionalGeneration(t5_config(cfg))
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    out = export_tensors(name_map(cfg), ours)
    for name in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        out[name] = ours["encoder.embed.weight"]
    return load_exported(hf, out, "T5 export")
