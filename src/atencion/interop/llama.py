"""Convert between Hugging Face's Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``) and a decoder-only atencion Transformer, exactly.

The three are one decoder (Touvron et al. 2023): pre-RMSNorm blocks, RoPE, a gated feed-forward
network (``hidden_act`` silu: SwiGLU; gelu: GEGLU), grouped-query attention
(``num_key_value_heads``: atencion's ``n_kv_heads``), unscaled embeddings, an output projection
of its own or tied. Layout, and nothing else, differs:

1. ``q_proj``, ``k_proj`` and ``v_proj`` are stacked into ``in_proj`` as [Q; K; V] (K and V of
   n_kv_heads heads each); ``gate_proj``, ``up_proj``, ``down_proj`` are ``linear1``, ``linear3``,
   ``linear2``. Their RoPE pairs feature i with i + d_k/2 (``rotate_half``), as atencion's does,
   so the rows of W^Q and W^K are taken as they are.
2. RoPE's ``rope_theta`` is ``rope_base``; its ``rope_parameters`` (transformers 5) or
   ``rope_scaling`` (older config.json files) of type ``default``, ``linear`` or ``llama3`` are
   ``rope_scaling``; another type, or a partial rotary factor, is refused naming the key.

and each member has its own:

- Llama: ``attention_bias`` (q, k, v, o) and ``mlp_bias`` are atencion's ``bias`` when they agree;
  one without the other is refused.
- Mistral: ``sliding_window`` W is ``attention: {kind: window, window: W}`` (query i sees
  i − W < j ≤ i); None is full attention. No biases.
- Qwen2: biases on q, k, v only (``qkv_bias``); a sliding window when every layer has it
  (``use_sliding_window`` with ``max_window_layers`` 0), refused when only some do.

Dropout is a training setting that Llama's config has no place for: a model exported with one
computes the same logits in eval mode. atencion has one EOS id: of a list (Llama 3's), the first;
without a padding id (Llama has none), EOS pads.
"""

from __future__ import annotations

from torch import Tensor

from ..config import ModelConfig
from ..errors import AtencionError
from ..nn.transformer import Transformer
from .common import Pair, export_tensors, import_decoder_tensors, load_complete, load_exported, require

MODEL_TYPE = ("llama", "mistral", "qwen2")
_FROM_HF_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}
_ROPE_TYPES = ("default", "linear", "llama3")
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _token_id(value, vocab_size: int, default: int) -> int:
    """``value`` (the first of a list) if it is a token id of the vocabulary, else ``default``."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if isinstance(value, int) and 0 <= value < vocab_size else default


def _rope(c, who: str) -> tuple[float, dict | None]:
    """``rope_base`` and ``rope_scaling`` from ``rope_parameters`` (transformers 5) or from the
    older ``rope_theta`` and ``rope_scaling`` keys."""
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise AtencionError(f"{who} config: rope_type={kind!r}; atencion scales RoPE as {list(_ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise AtencionError(f"{who} config: partial_rotary_factor={partial}; atencion's RoPE turns every feature "
                            f"of a head (1.0 only)")
    if kind == "default":
        return theta, None
    keys = ["factor"] if kind == "linear" else ["factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"]
    if kind == "llama3":
        rope.setdefault("original_max_position_embeddings", c.max_position_embeddings)
    return theta, {"type": kind, **{key: rope[key] for key in keys}}


def _window(c, family: str, who: str) -> int | None:
    """The sliding window every layer has, or None; a window on some layers only is refused."""
    window = getattr(c, "sliding_window", None)
    if family == "mistral" or window is None:
        return window
    layers = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    sliding = [kind == "sliding_attention" for kind in layers]
    if any(sliding) and not all(sliding):
        raise AtencionError(f"{who} config: a sliding window on {sum(sliding)} of {len(sliding)} layers "
                            f"(use_sliding_window, max_window_layers); atencion's layers share one attention kind")
    return window if all(sliding) else None


def _biases(c, family: str, who: str) -> tuple[bool, bool]:
    """atencion's (bias, qkv_bias) of a Llama-family config."""
    if family == "qwen2":
        return False, True
    if family == "mistral":
        return False, False
    attention, mlp = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    if attention != mlp:
        raise AtencionError(f"{who} config: attention_bias={attention} with mlp_bias={mlp}; atencion's `bias` "
                            f"covers the attention and feed-forward projections together")
    return attention, False


def config_from_llama(hf_config) -> ModelConfig:
    """The atencion config of a transformers LlamaConfig, MistralConfig or Qwen2Config (its
    ``model_type``); what atencion cannot reproduce raises AtencionError naming the key."""
    c = hf_config
    family = c.model_type
    if family not in _CLASSES:
        raise AtencionError(f"Llama-family import: model_type {family!r}; supported: {sorted(_CLASSES)}")
    who = _CLASSES[family]
    if c.hidden_act not in _FROM_HF_ACTIVATIONS:
        raise AtencionError(f"{who} config: hidden_act={c.hidden_act!r}; atencion gates with "
                            f"{sorted(_FROM_HF_ACTIVATIONS)}")
    if getattr(c, "head_dim", None) not in (None, c.hidden_size // c.num_attention_heads):
        raise AtencionError(f"{who} config: head_dim={c.head_dim}; atencion needs hidden_size / "
                            f"num_attention_heads ({c.hidden_size // c.num_attention_heads})")
    rope_base, rope_scaling = _rope(c, who)
    window = _window(c, family, who)
    bias, qkv_bias = _biases(c, family, who)
    vocab = c.vocab_size
    eos = _token_id(c.eos_token_id, vocab, 0)
    return ModelConfig(
        vocab_size=vocab,
        arch="decoder",
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        d_ff=c.intermediate_size,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        dropout=0.0,
        attention_dropout=float(c.attention_dropout),
        activation=_FROM_HF_ACTIVATIONS[c.hidden_act],
        norm_first=True,
        norm="rmsnorm",
        positional="rope",
        max_positions=c.max_position_embeddings,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        scale_embedding=False,
        tie_output=bool(c.tie_word_embeddings),
        bias=bias,
        qkv_bias=qkv_bias,
        layer_norm_eps=float(c.rms_norm_eps),
        attention=None if window is None else {"kind": "window", "window": window},
        pad_id=_token_id(c.pad_token_id, vocab, eos),  # none in Llama: pad with EOS, as HF's users do
        bos_id=_token_id(c.bos_token_id, vocab, eos),
        eos_id=eos,
    )


def check_llama_compatible(cfg: ModelConfig, family: str = "llama") -> None:
    """Raise AtencionError naming the first setting the ``family``'s Hugging Face class cannot express."""
    who, target = f"to_{family}", _CLASSES[family]
    biases = {"llama": [("qkv_bias", False)] if not cfg.bias else [],
              "mistral": [("bias", False), ("qkv_bias", False)], "qwen2": [("bias", False), ("qkv_bias", True)]}
    required = [("arch", "decoder"), ("positional", "rope"), ("norm", "rmsnorm"), ("norm_first", True),
                ("scale_attention", True), ("scale_embedding", False), ("scale_output", False),
                ("output_bias", False), ("embedding_norm", False), ("num_labels", 0), ("moe", None),
                *biases[family]]
    require(cfg, required, who, target)
    if cfg.activation not in _ACTIVATIONS:
        raise AtencionError(f"{who}: activation={cfg.activation!r} cannot be expressed by {target}, whose "
                            f"feed-forward network is gated: swiglu or geglu")
    kind = "full" if cfg.attention is None else cfg.attention["kind"]
    kinds = ("full", "flash") if family == "llama" else ("full", "flash", "window")
    if kind not in kinds:
        raise AtencionError(f"{who}: attention.kind {kind} cannot be expressed by {target}, which takes "
                            f"{' or '.join(kinds)}")


def llama_config(cfg: ModelConfig, family: str = "llama"):
    """The transformers LlamaConfig, MistralConfig or Qwen2Config (``family``) of an atencion ModelConfig."""
    import transformers

    check_llama_compatible(cfg, family)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling is not None:
        rope.update({key: value for key, value in cfg.rope_scaling.items() if key != "type"},
                    rope_type=cfg.rope_scaling["type"])
    window = cfg.attention["window"] if cfg.attention is not None and cfg.attention["kind"] == "window" else None
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  hidden_act=_ACTIVATIONS[cfg.activation], max_position_embeddings=cfg.max_positions,
                  rms_norm_eps=cfg.layer_norm_eps, rope_parameters=rope, attention_dropout=cfg.attention_dropout,
                  tie_word_embeddings=cfg.tie_output, pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id,
                  eos_token_id=cfg.eos_id)
    if family == "llama":
        return transformers.LlamaConfig(**common, attention_bias=cfg.bias, mlp_bias=cfg.bias)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=window)
    return transformers.Qwen2Config(**common, use_sliding_window=window is not None, sliding_window=window,
                                    max_window_layers=0)


def _linear(ours: str, theirs: tuple[str, ...] | str, bias: bool, sizes: tuple[int, ...] | None = None) -> list[Pair]:
    """The Pairs of a linear layer, its bias only when it has one (``bias``)."""
    names = (theirs,) if isinstance(theirs, str) else theirs
    params = ("weight", "bias") if bias else ("weight",)
    return [Pair(f"{ours}.{p}", tuple(f"{t}.{p}" for t in names) if len(names) > 1 else f"{names[0]}.{p}",
                 sizes=sizes) for p in params]


def name_map(cfg: ModelConfig) -> list[Pair]:
    """The one table both directions walk: every atencion parameter and its Hugging Face name,
    q/k/v stacked into ``in_proj`` (point 1). A tied output projection is the embedding table and
    is not listed."""
    dk, h, g = cfg.d_k, cfg.n_heads, cfg.kv_heads
    pairs = [Pair("decoder.embed.weight", "model.embed_tokens.weight"),
             Pair("decoder.final_norm.weight", "model.norm.weight")]
    if not cfg.tie_output:
        pairs.append(Pair("generator.weight", "lm_head.weight"))
    for i in range(cfg.n_layers):
        ours, theirs = f"decoder.layers.{i}", f"model.layers.{i}"
        qkv = tuple(f"{theirs}.self_attn.{name}_proj" for name in "qkv")
        pairs += [*_linear(f"{ours}.self_attn.in_proj", qkv, cfg.bias or cfg.qkv_bias, (h * dk, g * dk, g * dk)),
                  *_linear(f"{ours}.self_attn.out_proj", f"{theirs}.self_attn.o_proj", cfg.bias),
                  *_linear(f"{ours}.ffn.linear1", f"{theirs}.mlp.gate_proj", cfg.bias),
                  *_linear(f"{ours}.ffn.linear3", f"{theirs}.mlp.up_proj", cfg.bias),
                  *_linear(f"{ours}.ffn.linear2", f"{theirs}.mlp.down_proj", cfg.bias),
                  Pair(f"{ours}.res_self.norm.weight", f"{theirs}.input_layernorm.weight"),
                  Pair(f"{ours}.res_ffn.norm.weight", f"{theirs}.post_attention_layernorm.weight")]
    return pairs


def import_config(hf_config, architecture: str = "LlamaForCausalLM") -> ModelConfig:
    """The atencion config of a ``LlamaForCausalLM``, ``MistralForCausalLM`` or
    ``Qwen2ForCausalLM`` (the family is the config's ``model_type``)."""
    return config_from_llama(hf_config)


def import_state(cfg: ModelConfig, state) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``cfg`` and the atencion tensors read from ``state`` (the Llama family's names, as stored)."""
    out = import_decoder_tensors(name_map(cfg), state, cfg.tie_output)
    return cfg, out


def from_llama(hf_model) -> Transformer:
    """A decoder-only atencion Transformer (in eval mode) computing the same logits as
    ``hf_model``, a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM."""
    cfg, out = import_state(import_config(hf_model.config, type(hf_model).__name__),
                            {k: v.detach() for k, v in hf_model.state_dict().items()})
    return load_complete(Transformer(cfg), out, f"{_CLASSES[hf_model.config.model_type]} import").eval()


def _export(model: Transformer, family: str):
    import transformers

    cfg = model.cfg
    hf = getattr(transformers, _CLASSES[family])(llama_config(cfg, family))
    out = export_tensors(name_map(cfg), {k: v.detach() for k, v in model.state_dict().items()})
    if cfg.tie_output:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return load_exported(hf, out, f"{_CLASSES[family]} export")


def to_llama(model: Transformer):
    """A ``LlamaForCausalLM`` (in eval mode) computing the same logits as ``model``; settings it
    cannot express raise AtencionError naming the key."""
    return _export(model, "llama")


def to_mistral(model: Transformer):
    """A ``MistralForCausalLM`` (eval mode) equal to ``model``: a window kind is its ``sliding_window``."""
    return _export(model, "mistral")


def to_qwen2(model: Transformer):
    """A ``Qwen2ForCausalLM`` (eval mode) equal to ``model``, which has biases on q, k, v only."""
    return _export(model, "qwen2")
