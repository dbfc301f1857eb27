"""Convert between a Hugging Face BloomForCausalLM and an atencion decoder-only Transformer, exactly.

Bloom is atencion's ``arch="decoder"`` with ALiBi (``positional="alibi"``, no position table), a
LayerNorm on the token embeddings (``embedding_norm``), pre-LN blocks (``norm_first``) with a
final LayerNorm, the tanh approximation of GELU (``bloom_gelu_forward`` is
x·½·(1 + tanh(0.79788456·x·(1 + 0.044715·x²))), i.e. ``"gelu-tanh"``), a feed-forward width of
4·d_model and an LM head tied to the token table. Three points of layout:

1. ``query_key_value`` interleaves Q, K and V per head: its output axis is
   (num_heads, 3, head_dim), where our ``in_proj`` stacks Q;K;V (3, num_heads, head_dim).
2. Its ALiBi bias is slope_h · j (key position j) where ours is −slope_h · (i − j); they differ by
   slope_h · i, constant along each query's row, which softmax ignores. Both use the paper's
   slopes (the same formula for a head count that is not a power of two).
3. Bloom derives key positions from the attention mask (cumsum), so only unpadded inputs (an
   all-ones mask) match; atencion's decoder takes no padding mask.

``apply_residual_connection_post_layernorm=True`` (the residual taken after the LayerNorm)
cannot be expressed by atencion's blocks and is refused.
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
    per_head_qkv,
    require,
    require_paper_blocks,
    weight_and_bias,
)

MODEL_TYPE = "bloom"


def _token_id(value, vocab_size: int, default: int) -> int:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if isinstance(value, int) and 0 <= value < vocab_size else default


def config_from_bloom(hf_config) -> ModelConfig:
    """The atencion config of a transformers.BloomConfig; settings it cannot express raise
    AtencionError naming the key."""
    c = hf_config
    if c.apply_residual_connection_post_layernorm:
        raise AtencionError("Bloom config: apply_residual_connection_post_layernorm=True (the residual taken "
                            "after the LayerNorm) cannot be expressed by atencion's pre-LN blocks")
    vocab = c.vocab_size
    eos = _token_id(c.eos_token_id, vocab, min(2, vocab - 1))
    return ModelConfig(
        vocab_size=vocab,
        arch="decoder",
        n_layers=c.n_layer,
        d_model=c.hidden_size,
        d_ff=4 * c.hidden_size,
        n_heads=c.n_head,
        dropout=float(c.hidden_dropout),
        attention_dropout=float(c.attention_dropout),
        activation="gelu-tanh",
        norm_first=True,
        positional="alibi",
        scale_embedding=False,
        embedding_norm=True,
        tie_output=bool(getattr(c, "tie_word_embeddings", True)),
        output_bias=False,
        layer_norm_eps=float(c.layer_norm_epsilon),
        pad_id=_token_id(c.pad_token_id, vocab, eos),
        bos_id=_token_id(c.bos_token_id, vocab, eos),
        eos_id=eos,
    )


def name_map(cfg: ModelConfig) -> list[Pair]:
    """The one table both directions walk: every atencion parameter and its Bloom name, the fused
    ``query_key_value`` reordered each way (point 1). A tied output projection is the embedding
    table and is not listed."""
    qkv = per_head_qkv(cfg.n_heads)
    pairs = [Pair("decoder.embed.weight", "transformer.word_embeddings.weight"),
             *weight_and_bias("decoder.embed_norm", "transformer.word_embeddings_layernorm")]
    for i in range(cfg.decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"transformer.h.{i}"
        pairs += [*weight_and_bias(f"{ours}.res_self.norm", f"{theirs}.input_layernorm"),
                  *weight_and_bias(f"{ours}.self_attn.in_proj", f"{theirs}.self_attention.query_key_value", *qkv),
                  *weight_and_bias(f"{ours}.self_attn.out_proj", f"{theirs}.self_attention.dense"),
                  *weight_and_bias(f"{ours}.res_ffn.norm", f"{theirs}.post_attention_layernorm"),
                  *weight_and_bias(f"{ours}.ffn.linear1", f"{theirs}.mlp.dense_h_to_4h"),
                  *weight_and_bias(f"{ours}.ffn.linear2", f"{theirs}.mlp.dense_4h_to_h")]
    pairs += weight_and_bias("decoder.final_norm", "transformer.ln_f")
    if not cfg.tie_output:
        pairs.append(Pair("generator.weight", "lm_head.weight"))
    return pairs


def import_config(hf_config, architecture: str = "BloomForCausalLM") -> ModelConfig:
    """The atencion config of a ``BloomForCausalLM``."""
    return config_from_bloom(hf_config)


def import_state(cfg: ModelConfig, state) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``cfg`` and the atencion tensors read from ``state`` (Bloom's names, as stored)."""
    out = import_decoder_tensors(name_map(cfg), state, cfg.tie_output)
    return cfg, out


def from_bloom(hf_model) -> Transformer:
    """An atencion Transformer (eval mode) computing the same logits as ``hf_model`` (a
    BloomForCausalLM) on unpadded inputs."""
    cfg = import_config(hf_model.config)
    cfg, out = import_state(cfg, {k: v.detach().float() for k, v in hf_model.state_dict().items()})
    return load_complete(Transformer(cfg), out, "Bloom import").eval()


def check_bloom_compatible(cfg: ModelConfig) -> None:
    """Raise AtencionError naming the first setting a BloomForCausalLM cannot express."""
    wanted = [("arch", "decoder"), ("positional", "alibi"), ("embedding_norm", True), ("norm_first", True),
              ("norm", "layernorm"), ("activation", "gelu-tanh"), ("scale_embedding", False),
              ("scale_attention", True), ("output_bias", False), ("scale_output", False), ("num_labels", 0)]
    require(cfg, wanted, "to_bloom", "BloomForCausalLM")
    require_paper_blocks(cfg, "to_bloom", "BloomForCausalLM")
    if cfg.d_ff != 4 * cfg.d_model:
        raise AtencionError(f"to_bloom: d_ff={cfg.d_ff} cannot be expressed by BloomForCausalLM, whose "
                            f"feed-forward width is 4 * d_model = {4 * cfg.d_model}")


def bloom_config(cfg: ModelConfig):
    """The transformers.BloomConfig of an atencion ModelConfig."""
    from transformers import BloomConfig

    check_bloom_compatible(cfg)
    return BloomConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, n_layer=cfg.decoder_layers, n_head=cfg.n_heads,
        layer_norm_epsilon=cfg.layer_norm_eps, hidden_dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
        apply_residual_connection_post_layernorm=False, tie_word_embeddings=cfg.tie_output,
        bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id,
    )


def to_bloom(model: Transformer):
    """A transformers.BloomForCausalLM (eval mode) computing the same logits as ``model`` on
    unpadded inputs. Settings Bloom cannot express raise AtencionError naming the key; missing
    biases (``bias=False``) are written as zeros."""
    from transformers import BloomForCausalLM

    cfg = model.cfg
    hf = BloomForCausalLM(bloom_config(cfg))
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    target = hf.state_dict()
    out = export_tensors(name_map(cfg), ours, target)  # bias=False: Bloom's projections always have one (zeros)
    if cfg.tie_output:
        out["lm_head.weight"] = out["transformer.word_embeddings.weight"]
    missing = set(target) - set(out)
    if missing:
        raise AtencionError(f"Bloom export left parameters unset: {sorted(missing)[:5]}")
    hf.load_state_dict({k: v.to(target[k].dtype).contiguous() for k, v in out.items()})
    return hf.eval()
