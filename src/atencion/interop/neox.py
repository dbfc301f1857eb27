"""Convert between a Hugging Face ``GPTNeoXForCausalLM`` and a decoder-only atencion Transformer
with rotary positions, exactly.

GPT-NeoX (Pythia) is a pre-LN decoder with biases, LayerNorm, RoPE in the rotate-half layout
(feature i pairs with i + d_k/2: atencion's) and an output projection of its own, ``lm_head``
(``embed_out`` before transformers 5; atencion's untied ``generator.weight``). Two things differ
in layout or need refusing:

1. ``query_key_value`` is fused per head: its output rows are (heads, [q; k; v], d_k). atencion's
   ``in_proj`` stacks all the queries, then all the keys, then all the values; the rows (and the
   bias) are reordered each way.
2. atencion rotates every feature of a head and runs the two sub-layers one after the other, so
   a partial rotary (``rotary_pct`` / ``partial_rotary_factor`` < 1, Pythia's 0.25),
   ``use_parallel_residual=True`` (NeoX's default), a scaled RoPE type and
   ``attention_bias=False`` (the MLP keeps its biases) are refused, naming the key.
"""

from __future__ import annotations

from torch import Tensor

from ..config import ModelConfig
from ..errors import AtencionError
from ..nn.transformer import Transformer
from .common import (
    Pair,
    export_tensors,
    import_decoder_tensors,
    load_complete,
    load_exported,
    per_head_qkv,
    require,
    require_paper_blocks,
    weight_and_bias,
)

_FROM_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh"}
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu-tanh": "gelu_new"}

MODEL_TYPE = "gpt_neox"


def _rope(c) -> dict:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    rope.setdefault("rope_theta", getattr(c, "rotary_emb_base", 10000.0))
    rope.setdefault("partial_rotary_factor", getattr(c, "rotary_pct", 1.0))
    rope.setdefault("rope_type", "default")
    return rope


def _token_id(value, fallback: int) -> int:
    value = value[0] if isinstance(value, (list, tuple)) else value
    return fallback if value is None else value


def config_from_neox(hf_config) -> ModelConfig:
    """The atencion config of a transformers.GPTNeoXConfig; what atencion cannot reproduce
    raises AtencionError naming the NeoX key."""
    c = hf_config
    rope = _rope(c)
    if c.use_parallel_residual:
        raise AtencionError("GPT-NeoX config: use_parallel_residual=True (attention and MLP read the same "
                            "input); atencion's blocks are sequential: use_parallel_residual=False only")
    if rope["partial_rotary_factor"] != 1.0:
        raise AtencionError(f"GPT-NeoX config: partial_rotary_factor (rotary_pct)="
                            f"{rope['partial_rotary_factor']}; atencion's RoPE turns every feature of a head "
                            f"(1.0 only)")
    if rope["rope_type"] != "default":
        raise AtencionError(f"GPT-NeoX config: rope_parameters rope_type={rope['rope_type']!r}; atencion "
                            f"supports the 'default' RoPE only")
    if not getattr(c, "attention_bias", True):
        raise AtencionError("GPT-NeoX config: attention_bias=False while the MLP has biases; atencion's "
                            "`bias` covers both")
    if c.hidden_act not in _FROM_HF_ACTIVATIONS:
        raise AtencionError(f"GPT-NeoX config: hidden_act={c.hidden_act!r}; atencion supports "
                            f"{sorted(_FROM_HF_ACTIVATIONS)}")
    if getattr(c, "head_dim", None) not in (None, c.hidden_size // c.num_attention_heads):
        raise AtencionError(f"GPT-NeoX config: head_dim={c.head_dim}; atencion needs hidden_size / "
                            f"num_attention_heads")
    eos = _token_id(c.eos_token_id, 0)
    return ModelConfig(
        vocab_size=c.vocab_size,
        arch="decoder",
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        d_ff=c.intermediate_size,
        n_heads=c.num_attention_heads,
        dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
        activation=_FROM_HF_ACTIVATIONS[c.hidden_act],
        norm_first=True,
        norm="layernorm",
        positional="rope",
        rope_base=float(rope["rope_theta"]),
        max_positions=c.max_position_embeddings,
        scale_embedding=False,
        tie_output=bool(c.tie_word_embeddings),
        output_bias=False,
        bias=True,
        layer_norm_eps=c.layer_norm_eps,
        scale_attention=True,
        scale_output=False,
        pad_id=_token_id(c.pad_token_id, eos),  # NeoX has none by default: pad with EOS, as HF's users do
        bos_id=_token_id(c.bos_token_id, eos),
        eos_id=eos,
    )


def check_neox_compatible(cfg: ModelConfig) -> None:
    """Raise AtencionError naming the first setting GPTNeoXForCausalLM cannot express."""
    required = [("arch", "decoder"), ("positional", "rope"), ("norm", "layernorm"), ("norm_first", True),
                ("bias", True), ("scale_attention", True), ("scale_embedding", False), ("scale_output", False),
                ("output_bias", False), ("embedding_norm", False), ("num_labels", 0)]
    require(cfg, required, "neox export", "GPTNeoXForCausalLM")
    require_paper_blocks(cfg, "neox export", "GPTNeoXForCausalLM")


def neox_config(cfg: ModelConfig):
    """The ``transformers.GPTNeoXConfig`` of an atencion ModelConfig."""
    from transformers import GPTNeoXConfig

    check_neox_compatible(cfg)
    return GPTNeoXConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.d_ff,
        hidden_act=_ACTIVATIONS[cfg.activation],
        attention_dropout=cfg.attention_dropout,
        hidden_dropout=cfg.dropout,
        max_position_embeddings=cfg.max_positions,
        layer_norm_eps=cfg.layer_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base, "partial_rotary_factor": 1.0},
        use_parallel_residual=False,
        attention_bias=True,
        tie_word_embeddings=cfg.tie_output,
        pad_token_id=cfg.pad_id,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
    )


def _head_name(state) -> str:
    """The output projection's name: ``lm_head`` (transformers 5) or ``embed_out`` (before)."""
    return "embed_out" if "embed_out.weight" in state else "lm_head"


def name_map(cfg: ModelConfig, head: str = "lm_head") -> list[Pair]:
    """The one table both directions walk: every atencion parameter and its NeoX name, the fused
    ``query_key_value`` reordered each way (point 1). ``head`` is the output projection's name
    (see :func:`_head_name`); a tied one is the embedding table and is not listed."""
    qkv = per_head_qkv(cfg.n_heads)
    pairs = [Pair("decoder.embed.weight", "gpt_neox.embed_in.weight"),
             *weight_and_bias("decoder.final_norm", "gpt_neox.final_layer_norm")]
    if not cfg.tie_output:
        pairs.append(Pair("generator.weight", f"{head}.weight"))
    for i in range(cfg.n_layers):
        ours, theirs = f"decoder.layers.{i}", f"gpt_neox.layers.{i}"
        pairs += [*weight_and_bias(f"{ours}.self_attn.in_proj", f"{theirs}.attention.query_key_value", *qkv),
                  *weight_and_bias(f"{ours}.self_attn.out_proj", f"{theirs}.attention.dense"),
                  *weight_and_bias(f"{ours}.res_self.norm", f"{theirs}.input_layernorm"),
                  *weight_and_bias(f"{ours}.ffn.linear1", f"{theirs}.mlp.dense_h_to_4h"),
                  *weight_and_bias(f"{ours}.ffn.linear2", f"{theirs}.mlp.dense_4h_to_h"),
                  *weight_and_bias(f"{ours}.res_ffn.norm", f"{theirs}.post_attention_layernorm")]
    return pairs


def import_config(hf_config, architecture: str = "GPTNeoXForCausalLM") -> ModelConfig:
    """The atencion config of a ``GPTNeoXForCausalLM``."""
    return config_from_neox(hf_config)


def import_state(cfg: ModelConfig, state) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``cfg`` and the atencion tensors read from ``state`` (NeoX's names, as stored)."""
    out = import_decoder_tensors(name_map(cfg, _head_name(state)), state, cfg.tie_output)
    return cfg, out


def from_neox(hf_model) -> Transformer:
    """A decoder-only atencion Transformer (in eval mode) computing the same logits as
    ``hf_model``, a ``GPTNeoXForCausalLM``."""
    cfg, out = import_state(import_config(hf_model.config), {k: v.detach() for k, v in hf_model.state_dict().items()})
    return load_complete(Transformer(cfg), out, "GPT-NeoX import").eval()


def to_neox(model: Transformer):
    """A ``GPTNeoXForCausalLM`` (in eval mode) computing the same logits as ``model``; settings
    NeoX cannot express raise AtencionError naming the key."""
    from transformers import GPTNeoXForCausalLM

    cfg = model.cfg
    hf = GPTNeoXForCausalLM(neox_config(cfg))
    head = _head_name(hf.state_dict())
    out = export_tensors(name_map(cfg, head), {k: v.detach() for k, v in model.state_dict().items()})
    if cfg.tie_output:
        out[f"{head}.weight"] = out["gpt_neox.embed_in.weight"]
    return load_exported(hf, out, "GPT-NeoX export")
