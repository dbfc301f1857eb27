"""Import a Hugging Face BertForMaskedLM into an atencion Transformer, and export one back, exactly.

atencion's BERT is ``ModelConfig(arch="encoder", activation="gelu", positional="learned",
type_vocab_size=..., embedding_norm=True, scale_embedding=False, norm_first=False, ...)``; the
``bert-base`` preset is BERT-Base. The weights map one to one, except that BERT keeps W^Q, W^K,
W^V as three Linear layers where atencion stacks them as one ``in_proj`` [Q; K; V]:

    atencion                              BertForMaskedLM
    encoder.embed                         bert.embeddings.word_embeddings (= cls.predictions.decoder.weight)
    encoder.positions                     bert.embeddings.position_embeddings
    encoder.token_types                   bert.embeddings.token_type_embeddings
    encoder.embed_norm                    bert.embeddings.LayerNorm
    encoder.layers.i.self_attn.in_proj    bert.encoder.layer.i.attention.self.{query; key; value}
    encoder.layers.i.self_attn.out_proj   bert.encoder.layer.i.attention.output.dense
    encoder.layers.i.res_self.norm        bert.encoder.layer.i.attention.output.LayerNorm
    encoder.layers.i.ffn.linear1          bert.encoder.layer.i.intermediate.dense
    encoder.layers.i.ffn.linear2          bert.encoder.layer.i.output.dense
    encoder.layers.i.res_ffn.norm         bert.encoder.layer.i.output.LayerNorm
    mlm_head.dense, mlm_head.norm         cls.predictions.transform.dense, .LayerNorm
    mlm_head.bias                         cls.predictions.decoder.bias (= cls.predictions.bias)

BERT's quirks, and how they are handled:

1. Padding: BERT attends to whatever ``attention_mask`` says (everything when it is omitted);
   atencion masks the keys whose id is ``pad_id`` (= BERT's ``pad_token_id``). The two agree when
   BERT is given ``attention_mask = input_ids != pad_token_id``. atencion's output at padding
   positions is undefined (it skips them); only real positions compare.
2. Token types: BERT always adds a token-type embedding (type 0 when none is given), so its
   ``type_vocab_size`` is at least 1. A model without token types (``type_vocab_size=0``) is
   exported with one all-zero type row, which adds nothing.
3. The MLM head is tied to the word embeddings in atencion; a BERT whose decoder weight differs
   from its word embeddings (``tie_word_embeddings=False``, trained apart) is refused. The head's
   bias is the one its forward uses, ``cls.predictions.decoder.bias``.
4. ``hidden_act`` is used by both the feed-forward layers and the MLM head's transform, as
   atencion's ``activation`` is: "gelu" (erf), "relu", and the tanh approximation ("gelu_new",
   "gelu_pytorch_tanh" → "gelu-tanh"; exported as "gelu_pytorch_tanh").
5. Only training differs: BERT's word embeddings do not train their padding row
   (``padding_idx``), atencion's do. No pooler: BertForMaskedLM has none.
6. ``BertForSequenceClassification`` has the pooler (``bert.pooler.dense``, then tanh) on the
   [CLS] output and a linear ``classifier``: atencion's classification head with ``pooler:
   true`` and ``pooling: first``. It has no MLM head: the imported one is left untrained (zeros,
   a LayerNorm of ones) and never used for classifying.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..errors import AtencionError
from ..nn.transformer import Transformer
from .common import (
    Pair,
    classifier_values,
    export_tensors,
    import_tensors,
    load_complete,
    require,
    require_paper_blocks,
    weight_and_bias,
)

MODEL_TYPE = "bert"
# what a saved BertForMaskedLM leaves out: its decoder is tied to the word embeddings and its bias
TIED = {"cls.predictions.decoder.bias": "cls.predictions.bias",
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}

# BERT's hidden_act → atencion's activation; and back (the exact torch form of the tanh GELU)
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh"}
HIDDEN_ACT = {"gelu": "gelu", "relu": "relu", "gelu-tanh": "gelu_pytorch_tanh"}


def config_from_bert(hf_config) -> ModelConfig:
    """The atencion config of a transformers.BertConfig; what atencion cannot compute raises
    AtencionError naming the key."""
    c = hf_config
    model_type = getattr(c, "model_type", None)
    if model_type != "bert":
        raise AtencionError(f"BERT import: expected a BERT config (model_type 'bert'), got "
                            f"{type(c).__name__} with model_type {model_type!r}")
    if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
        raise AtencionError("BERT config: is_decoder/add_cross_attention is set (causal or cross-attention); "
                            "atencion imports the bidirectional encoder only")
    position_type = getattr(c, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise AtencionError(f"BERT config: position_embedding_type={position_type!r}; atencion imports "
                            f"'absolute' (learned) positions only")
    if not isinstance(c.hidden_act, str) or c.hidden_act not in ACTIVATIONS:
        raise AtencionError(f"BERT config: hidden_act={c.hidden_act!r}; atencion supports {sorted(ACTIVATIONS)}")
    if c.pad_token_id is None:
        raise AtencionError("BERT config: pad_token_id is None; atencion masks padding by a pad id, so it needs one")
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, (list, tuple)) else c.eos_token_id
    return ModelConfig(
        vocab_size=c.vocab_size,
        arch="encoder",
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        d_ff=c.intermediate_size,
        n_heads=c.num_attention_heads,
        dropout=float(c.hidden_dropout_prob),
        attention_dropout=float(c.attention_probs_dropout_prob),
        activation=ACTIVATIONS[c.hidden_act],
        norm_first=False,
        positional="learned",
        max_positions=c.max_position_embeddings,
        scale_embedding=False,
        embedding_norm=True,
        type_vocab_size=c.type_vocab_size,
        layer_norm_eps=float(c.layer_norm_eps),
        pad_id=c.pad_token_id,
        bos_id=ModelConfig.bos_id if c.bos_token_id is None else c.bos_token_id,
        eos_id=ModelConfig.eos_id if eos is None else eos,
    )


def check_bert(cfg: ModelConfig) -> None:
    """Raise AtencionError, naming the first key, unless BertForMaskedLM can compute ``cfg``'s model."""
    wanted = [("arch", "encoder"), ("norm_first", False), ("norm", "layernorm"),
              ("positional", "learned"),
              ("embedding_norm", True), ("scale_embedding", False), ("scale_attention", True), ("bias", True),
              ("num_labels", 0)]
    require(cfg, wanted, "BERT export", "BertForMaskedLM")
    require_paper_blocks(cfg, "BERT export", "BertForMaskedLM")
    if cfg.activation not in HIDDEN_ACT:
        raise AtencionError(f"BERT export: activation={cfg.activation!r}; BERT's hidden_act covers "
                            f"{sorted(HIDDEN_ACT)}")


def bert_config(cfg: ModelConfig):
    """The transformers.BertConfig of an atencion model that :func:`check_bert` accepts."""
    from transformers import BertConfig

    check_bert(cfg)
    return BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.d_ff,
        hidden_act=HIDDEN_ACT[cfg.activation],
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_positions,
        type_vocab_size=max(cfg.type_vocab_size, 1),  # quirk 2: BERT always has a type 0
        layer_norm_eps=cfg.layer_norm_eps,
        pad_token_id=cfg.pad_id,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        tie_word_embeddings=True,
    )


def name_map(cfg: ModelConfig) -> list[Pair]:
    """The one table both directions walk (the module docstring's, one row per parameter): one
    BERT name is copied as is, three (query, key, value) are stacked along dim 0. The tied output
    projection (``mlm_head.weight``) is the embedding table and is not listed."""
    return [*_encoder_pairs(cfg), *weight_and_bias("mlm_head.dense", "cls.predictions.transform.dense"),
            *weight_and_bias("mlm_head.norm", "cls.predictions.transform.LayerNorm"),
            Pair("mlm_head.bias", "cls.predictions.decoder.bias")]


def _encoder_pairs(cfg: ModelConfig) -> list[Pair]:
    pairs = [Pair("encoder.embed.weight", "bert.embeddings.word_embeddings.weight"),
             Pair("encoder.positions.weight", "bert.embeddings.position_embeddings.weight")]
    if cfg.type_vocab_size:
        pairs.append(Pair("encoder.token_types.weight", "bert.embeddings.token_type_embeddings.weight"))
    pairs += weight_and_bias("encoder.embed_norm", "bert.embeddings.LayerNorm")
    for i in range(cfg.n_layers):
        ours, theirs = f"encoder.layers.{i}", f"bert.encoder.layer.{i}"
        pairs += [*weight_and_bias(f"{ours}.self_attn.in_proj",
                                   tuple(f"{theirs}.attention.self.{x}" for x in ("query", "key", "value"))),
                  *weight_and_bias(f"{ours}.self_attn.out_proj", f"{theirs}.attention.output.dense"),
                  *weight_and_bias(f"{ours}.res_self.norm", f"{theirs}.attention.output.LayerNorm"),
                  *weight_and_bias(f"{ours}.ffn.linear1", f"{theirs}.intermediate.dense"),
                  *weight_and_bias(f"{ours}.ffn.linear2", f"{theirs}.output.dense"),
                  *weight_and_bias(f"{ours}.res_ffn.norm", f"{theirs}.output.LayerNorm")]
    return pairs


def import_config(hf_config, architecture: str = "BertForMaskedLM") -> ModelConfig:
    """The atencion config of a BERT of class ``architecture``: a masked language model, or a
    classifier (quirk 6)."""
    cfg = config_from_bert(hf_config)
    if architecture == "BertForSequenceClassification":
        cfg = dataclasses.replace(cfg, pooler=True, **classifier_values(hf_config, "first"))
    return cfg


def import_state(cfg: ModelConfig, state) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``cfg`` and the atencion tensors read from ``state`` (BERT's names, as stored)."""
    if cfg.num_labels:  # quirk 6
        out = import_tensors([*_encoder_pairs(cfg), *weight_and_bias("classifier.pooler", "bert.pooler.dense"),
                              *weight_and_bias("classifier.linear", "classifier")], state)
        words = out["encoder.embed.weight"]
        d = cfg.d_model
        out.update({"mlm_head.dense.weight": words.new_zeros(d, d), "mlm_head.dense.bias": words.new_zeros(d),
                    "mlm_head.norm.weight": words.new_ones(d), "mlm_head.norm.bias": words.new_zeros(d),
                    "mlm_head.bias": words.new_zeros(cfg.vocab_size)})
    else:
        if not torch.equal(state["cls.predictions.decoder.weight"], state["bert.embeddings.word_embeddings.weight"]):
            raise AtencionError("BERT import: cls.predictions.decoder.weight differs from the word embeddings "
                                "(tie_word_embeddings=False); atencion's MLM head is tied to them")
        out = import_tensors(name_map(cfg), state)
    out["mlm_head.weight"] = out["encoder.embed.weight"]  # tied (quirk 3)
    return cfg, out


def from_bert(hf_model) -> Transformer:
    """An atencion Transformer (eval mode) computing the same MLM logits as ``hf_model``, a
    transformers.BertForMaskedLM (see the module docstring for padding), or the same
    classification logits as a BertForSequenceClassification."""
    from transformers import BertForMaskedLM, BertForSequenceClassification

    if not isinstance(hf_model, (BertForMaskedLM, BertForSequenceClassification)):
        model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
        raise AtencionError(f"BERT import: expected a transformers BertForMaskedLM, got "
                            f"{type(hf_model).__name__} (model_type {model_type!r})")
    cfg = import_config(hf_model.config, type(hf_model).__name__)
    cfg, out = import_state(cfg, {k: v.detach() for k, v in hf_model.state_dict().items()})
    return load_complete(Transformer(cfg), out, "BERT import").eval()


def to_bert(model: Transformer):
    """A transformers.BertForMaskedLM (eval mode) computing the same MLM logits as ``model``; an
    atencion model that BERT cannot express raises AtencionError naming the config key."""
    from transformers import BertForMaskedLM

    if not isinstance(model, Transformer):
        raise AtencionError(f"BERT export: expected an atencion Transformer, got {type(model).__name__}")
    cfg = model.cfg
    hf_model = BertForMaskedLM(bert_config(cfg))
    src = {k: v.detach() for k, v in model.state_dict().items()}
    out = export_tensors(name_map(cfg), src)
    if not cfg.type_vocab_size:  # quirk 2: one token type, adding zero
        out["bert.embeddings.token_type_embeddings.weight"] = src["encoder.embed.weight"].new_zeros(1, cfg.d_model)
    out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]  # tied
    out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    hf_model.load_state_dict(out)  # strict: a name missing on either side raises
    return hf_model.to(src["encoder.embed.weight"].dtype).eval()
