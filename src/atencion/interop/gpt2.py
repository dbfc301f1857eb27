"""Convert between a Hugging Face GPT2LMHeadModel and an atencion decoder-only Transformer, exactly.

GPT-2 is atencion's ``arch="decoder"`` with pre-LN blocks (``norm_first``), a learned position
table, unscaled embeddings, a final LayerNorm and an LM head tied to the token table (the
``gpt2`` preset). Two differences of layout, none of computation:

1. Its projections are ``Conv1D`` modules, whose weights are stored (in, out), the transpose
   of ``nn.Linear``'s (out, in): every weight is transposed on the way.
2. ``c_attn`` stacks Q;K;V on its output axis, heads contiguous within each: the layout of our
   ``in_proj`` once transposed, so no reordering is needed.

GPT-2 has no padding mask here: compare unpadded inputs (or right-padded ones, whose real
positions the causal mask keeps from seeing the pads).

``GPT2ForSequenceClassification`` is the same decoder with a classification head reading the
last real token (``pooling: last``) through ``score``, a linear layer without bias (its bias
here is zeros); its padding id is the config's ``pad_token_id``.
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
    import_decoder_tensors,
    load_complete,
    require,
    require_paper_blocks,
    weight_and_bias,
)

MODEL_TYPE = "gpt2"

# GPT-2's activation names → atencion's; "gelu_new" (GPT-2's) and "gelu_pytorch_tanh" are both
# the tanh approximation, equal to within float rounding
_ACTIVATIONS = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu_fast": "gelu-tanh",
                "gelu": "gelu", "relu": "relu"}
_EXPORT_ACTIVATIONS = {"gelu-tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def _token_id(value, vocab_size: int, default: int) -> int:
    """``value`` if it is a token id of the vocabulary, else ``default`` (a tiny test model keeps
    GPT-2's 50256 as BOS/EOS, outside its vocabulary; ModelConfig requires real ids)."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if isinstance(value, int) and 0 <= value < vocab_size else default


def config_from_gpt2(hf_config) -> ModelConfig:
    """The atencion config of a transformers.GPT2Config; settings it cannot express raise
    AtencionError naming the key. Dropout: atencion has one rate for the embeddings and the
    sub-layer outputs; GPT-2's ``resid_pdrop`` is taken (``embd_pdrop`` matters in training only)."""
    c = hf_config
    if c.activation_function not in _ACTIVATIONS:
        raise AtencionError(f"GPT-2 config: activation_function={c.activation_function!r}; atencion supports "
                            f"{sorted(_ACTIVATIONS)}")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise AtencionError("GPT-2 config: scale_attn_by_inverse_layer_idx=True (scores divided by the layer "
                            "number) cannot be expressed by atencion, whose layers share one scale")
    if getattr(c, "add_cross_attention", False):
        raise AtencionError("GPT-2 config: add_cross_attention=True; atencion's decoder-only model has no "
                            "cross-attention")
    vocab = c.vocab_size
    eos = _token_id(c.eos_token_id, vocab, vocab - 1)  # GPT-2's <|endoftext|> is its last token
    return ModelConfig(
        vocab_size=vocab,
        arch="decoder",
        n_layers=c.n_layer,
        d_model=c.n_embd,
        d_ff=c.n_inner if c.n_inner is not None else 4 * c.n_embd,
        n_heads=c.n_head,
        dropout=float(c.resid_pdrop),
        attention_dropout=float(c.attn_pdrop),
        activation=_ACTIVATIONS[c.activation_function],
        norm_first=True,
        positional="learned",
        max_positions=c.n_positions,
        scale_embedding=False,
        tie_output=bool(getattr(c, "tie_word_embeddings", True)),
        output_bias=False,
        layer_norm_eps=float(c.layer_norm_epsilon),
        scale_attention=bool(c.scale_attn_weights),
        pad_id=_token_id(c.pad_token_id, vocab, eos),
        bos_id=_token_id(c.bos_token_id, vocab, eos),
        eos_id=eos,
    )


# a Conv1D weight is stored (in, out), an nn.Linear weight (out, in): transposed each way
_TRANSPOSE = (torch.t, torch.t)


def name_map(cfg: ModelConfig) -> list[Pair]:
    """The one table both directions walk: every atencion parameter and its GPT-2 name, the
    Conv1D weights transposed (point 1); biases, LayerNorms and tables as they are. A tied
    output projection is the token table and is not listed."""
    pairs = [Pair("decoder.embed.weight", "transformer.wte.weight"),
             Pair("decoder.positions.weight", "transformer.wpe.weight")]
    for i in range(cfg.decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"transformer.h.{i}"
        for a, b in [("res_self.norm", "ln_1"), ("self_attn.in_proj", "attn.c_attn"),
                     ("self_attn.out_proj", "attn.c_proj"), ("res_ffn.norm", "ln_2"),
                     ("ffn.linear1", "mlp.c_fc"), ("ffn.linear2", "mlp.c_proj")]:
            turn = () if a.endswith("norm") else _TRANSPOSE
            pairs += [Pair(f"{ours}.{a}.weight", f"{theirs}.{b}.weight", *turn),
                      Pair(f"{ours}.{a}.bias", f"{theirs}.{b}.bias")]
    pairs += weight_and_bias("decoder.final_norm", "transformer.ln_f")
    if not cfg.tie_output:
        pairs.append(Pair("generator.weight", "lm_head.weight"))
    return pairs


def import_config(hf_config, architecture: str = "GPT2LMHeadModel") -> ModelConfig:
    """The atencion config of a GPT-2 of class ``architecture``: a language model, or a
    classifier (its output projection, unused, tied)."""
    cfg = config_from_gpt2(hf_config)
    if architecture == "GPT2ForSequenceClassification":
        cfg = dataclasses.replace(cfg, tie_output=True, **classifier_values(hf_config, "last"))
    return cfg


def import_state(cfg: ModelConfig, state) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``cfg`` and the atencion tensors read from ``state`` (GPT-2's names, as stored)."""
    out = import_decoder_tensors(name_map(cfg), state, cfg.tie_output)
    if cfg.num_labels:
        out["classifier.linear.weight"] = score = state["score.weight"]
        out["classifier.linear.bias"] = score.new_zeros(cfg.num_labels)  # GPT-2's score has no bias
    return cfg, out


def from_gpt2(hf_model) -> Transformer:
    """An atencion Transformer (eval mode) computing the same logits as ``hf_model`` (a
    GPT2LMHeadModel, or a GPT2ForSequenceClassification's classification logits)."""
    cfg = import_config(hf_model.config, type(hf_model).__name__)
    cfg, out = import_state(cfg, {k: v.detach().float() for k, v in hf_model.state_dict().items()})
    return load_complete(Transformer(cfg), out, "GPT-2 import").eval()


def check_gpt2_compatible(cfg: ModelConfig) -> None:
    """Raise AtencionError naming the first setting a GPT2LMHeadModel cannot express."""
    wanted = [("arch", "decoder"), ("positional", "learned"), ("norm_first", True), ("norm", "layernorm"),
              ("scale_embedding", False), ("embedding_norm", False), ("output_bias", False),
              ("scale_output", False), ("num_labels", 0)]
    require(cfg, wanted, "to_gpt2", "GPT2LMHeadModel")
    require_paper_blocks(cfg, "to_gpt2", "GPT2LMHeadModel")
    if cfg.activation not in _EXPORT_ACTIVATIONS:
        raise AtencionError(f"to_gpt2: activation={cfg.activation!r} cannot be expressed by GPT2LMHeadModel")


def gpt2_config(cfg: ModelConfig):
    """The transformers.GPT2Config of an atencion ModelConfig."""
    from transformers import GPT2Config

    check_gpt2_compatible(cfg)
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_positions, n_embd=cfg.d_model, n_layer=cfg.decoder_layers,
        n_head=cfg.n_heads, n_inner=cfg.d_ff, activation_function=_EXPORT_ACTIVATIONS[cfg.activation],
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=cfg.layer_norm_eps, scale_attn_weights=cfg.scale_attention,
        tie_word_embeddings=cfg.tie_output, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id,
    )


def to_gpt2(model: Transformer):
    """A transformers.GPT2LMHeadModel (eval mode) computing the same logits as ``model``, an
    atencion decoder-only Transformer. Settings GPT-2 cannot express raise AtencionError naming
    the key; missing biases (``bias=False``) are written as zeros."""
    from transformers import GPT2LMHeadModel

    cfg = model.cfg
    hf = GPT2LMHeadModel(gpt2_config(cfg))
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    target = hf.state_dict()
    out = export_tensors(name_map(cfg), ours, target)  # bias=False: GPT-2's Conv1D always has one (zeros)
    if cfg.tie_output:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    missing = set(target) - set(out)
    if missing:
        raise AtencionError(f"GPT-2 export left parameters unset: {sorted(missing)[:5]}")
    hf.load_state_dict({k: v.to(target[k].dtype).contiguous() for k, v in out.items()})
    return hf.eval()
