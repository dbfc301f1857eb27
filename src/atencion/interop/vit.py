"""Import a Hugging Face ViTForImageClassification into an atencion Transformer, and export one
back, exactly.

atencion's ViT is ``ModelConfig(arch="encoder", vocab_size=0, inputs={kind: patches, patch,
size, channels}, norm_first=True, positional="learned", max_positions=patches + 1,
activation="gelu", scale_embedding=False, num_labels=..., pooling="first")``; the ``vit-base``
preset is ViT-B/16. The weights map one to one (the names of transformers 5, the pinned version;
a directory saved by an older one is read through transformers' ``from_pretrained``, which
renames), except that ViT keeps W^Q, W^K, W^V as three Linear layers where atencion stacks them
as one ``in_proj`` [Q; K; V], its patch projection is a Conv2d whose kernel atencion keeps
flattened, and its positions are one (1, N + 1, D) tensor:

    atencion                              ViTForImageClassification
    encoder.embed.cls                     vit.embeddings.cls_token
    encoder.embed.proj                    vit.embeddings.patch_embeddings.projection (D, C, P, P) flattened
    encoder.positions                     vit.embeddings.position_embeddings[0]
    encoder.layers.i.self_attn.in_proj    vit.layers.i.attention.{q_proj; k_proj; v_proj}
    encoder.layers.i.self_attn.out_proj   vit.layers.i.attention.o_proj
    encoder.layers.i.res_self.norm        vit.layers.i.layernorm_before
    encoder.layers.i.ffn.linear1          vit.layers.i.mlp.fc1
    encoder.layers.i.ffn.linear2          vit.layers.i.mlp.fc2
    encoder.layers.i.res_ffn.norm         vit.layers.i.layernorm_after
    encoder.final_norm                    vit.layernorm
    classifier.linear                     classifier

ViT's quirks, and how they are handled:

1. Its position table has exactly N + 1 rows; an atencion model with a longer learned table
   (``max_positions`` above N + 1) uses, and exports, its first N + 1.
2. ``qkv_bias: false`` (W^Q, W^K, W^V without biases, the rest with) cannot be expressed by
   atencion's ``bias`` / ``qkv_bias`` and is refused; so are ``interpolate_pos_encoding`` (other
   image sizes) and non-square patches.
3. Its classifier reads the final LayerNorm's [CLS] output with no dropout: atencion's head with
   ``pooling: first`` and no pooler (its dropout is off in eval mode).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import AtencionError
from ..nn.transformer import Transformer
from .bert import ACTIVATIONS, HIDDEN_ACT
from .common import (
    Pair,
    classifier_values,
    export_tensors,
    import_tensors,
    load_complete,
    load_exported,
    require,
    require_paper_blocks,
    weight_and_bias,
)


def _pair(value, key: str) -> tuple[int, int]:
    """An int or a pair (height, width) of a ViTConfig, as a pair."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise AtencionError(f"ViT config: {key}={value!r}; expected an integer or [height, width]")


def config_from_vit(hf_config) -> ModelConfig:
    """The atencion config of a transformers.ViTConfig (a ViTForImageClassification's); what
    atencion cannot compute raises AtencionError naming the key."""
    c = hf_config
    if getattr(c, "model_type", None) != "vit":
        raise AtencionError(f"ViT import: expected a ViT config (model_type 'vit'), got {type(c).__name__} with "
                            f"model_type {getattr(c, 'model_type', None)!r}")
    if not c.qkv_bias:
        raise AtencionError("ViT config: qkv_bias=False (W^Q, W^K, W^V without biases, the rest with) cannot be "
                            "expressed by atencion's bias and qkv_bias")
    if not isinstance(c.hidden_act, str) or c.hidden_act not in ACTIVATIONS:
        raise AtencionError(f"ViT config: hidden_act={c.hidden_act!r}; atencion supports {sorted(ACTIVATIONS)}")
    patch = _pair(c.patch_size, "patch_size")
    if patch[0] != patch[1]:
        raise AtencionError(f"ViT config: patch_size={c.patch_size!r}; atencion's patches are square")
    size = _pair(c.image_size, "image_size")
    grid = (size[0] // patch[0]) * (size[1] // patch[0])
    return ModelConfig(
        vocab_size=0, arch="encoder", n_layers=c.num_hidden_layers, d_model=c.hidden_size, d_ff=c.intermediate_size,
        n_heads=c.num_attention_heads, dropout=float(c.hidden_dropout_prob),
        attention_dropout=float(c.attention_probs_dropout_prob), activation=ACTIVATIONS[c.hidden_act],
        norm_first=True, positional="learned", max_positions=grid + 1, scale_embedding=False,
        layer_norm_eps=float(c.layer_norm_eps),
        inputs={"kind": "patches", "patch": patch[0], "size": list(size), "channels": c.num_channels},
        **classifier_values(c, "first"))


def check_vit(cfg: ModelConfig) -> None:
    """Raise AtencionError, naming the first key, unless ViTForImageClassification can compute
    ``cfg``'s model."""
    if cfg.inputs is None or cfg.inputs["kind"] != "patches":
        raise AtencionError("ViT export: the model must read image patches (model.inputs kind patches)")
    if cfg.inputs.get("shifted"):
        raise AtencionError("ViT export: inputs.shifted=true (Shifted Patch Tokenization) has no counterpart in "
                            "ViTForImageClassification")
    require(cfg, [("arch", "encoder"), ("norm_first", True), ("norm", "layernorm"), ("positional", "learned"),
                  ("embedding_norm", False), ("scale_attention", True), ("bias", True), ("pooling", "first"),
                  ("pooler", False)], "ViT export", "ViTForImageClassification")
    require_paper_blocks(cfg, "ViT export", "ViTForImageClassification")
    if cfg.activation not in HIDDEN_ACT:
        raise AtencionError(f"ViT export: activation={cfg.activation!r}; ViT's hidden_act covers {sorted(HIDDEN_ACT)}")
    if not cfg.num_labels:
        raise AtencionError("ViT export: num_labels=0; ViTForImageClassification needs a classification head")


def vit_config(cfg: ModelConfig):
    """The transformers.ViTConfig of an atencion model that :func:`check_vit` accepts."""
    from transformers import ViTConfig

    check_vit(cfg)
    labels = cfg.labels or [f"LABEL_{i}" for i in range(cfg.num_labels)]
    inputs = cfg.inputs
    return ViTConfig(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     intermediate_size=cfg.d_ff, hidden_act=HIDDEN_ACT[cfg.activation],
                     hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.attention_dropout,
                     layer_norm_eps=cfg.layer_norm_eps, image_size=list(inputs["size"]), patch_size=inputs["patch"],
                     num_channels=inputs["channels"], qkv_bias=True, num_labels=cfg.num_labels,
                     id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})


def name_map(cfg: ModelConfig) -> list[Pair]:
    """The one table both directions walk (the module docstring's, one row per parameter)."""
    inputs = cfg.inputs
    kernel = (cfg.d_model, inputs["channels"], inputs["patch"], inputs["patch"])
    pairs = [Pair("encoder.embed.cls", "vit.embeddings.cls_token"),
             Pair("encoder.embed.proj.weight", "vit.embeddings.patch_embeddings.projection.weight",
                  to_ours=lambda t: t.reshape(cfg.d_model, -1), to_theirs=lambda t: t.reshape(kernel)),
             Pair("encoder.embed.proj.bias", "vit.embeddings.patch_embeddings.projection.bias"),
             Pair("encoder.positions.weight", "vit.embeddings.position_embeddings",
                  to_ours=lambda t: t[0], to_theirs=lambda t: t[None])]
    for i in range(cfg.n_layers):
        ours, theirs = f"encoder.layers.{i}", f"vit.layers.{i}"
        pairs += [*weight_and_bias(f"{ours}.self_attn.in_proj",
                                   tuple(f"{theirs}.attention.{x}_proj" for x in ("q", "k", "v"))),
                  *weight_and_bias(f"{ours}.self_attn.out_proj", f"{theirs}.attention.o_proj"),
                  *weight_and_bias(f"{ours}.res_self.norm", f"{theirs}.layernorm_before"),
                  *weight_and_bias(f"{ours}.ffn.linear1", f"{theirs}.mlp.fc1"),
                  *weight_and_bias(f"{ours}.ffn.linear2", f"{theirs}.mlp.fc2"),
                  *weight_and_bias(f"{ours}.res_ffn.norm", f"{theirs}.layernorm_after")]
    return [*pairs, *weight_and_bias("encoder.final_norm", "vit.layernorm"),
            *weight_and_bias("classifier.linear", "classifier")]


def from_vit(hf_model) -> Transformer:
    """An atencion Transformer (eval mode) computing the same logits as ``hf_model``, a
    transformers.ViTForImageClassification, on the same images (batch, channels, height, width)."""
    from transformers import ViTForImageClassification

    if not isinstance(hf_model, ViTForImageClassification):
        raise AtencionError(f"ViT import: expected a transformers ViTForImageClassification, got "
                            f"{type(hf_model).__name__}")
    cfg = config_from_vit(hf_model.config)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    try:
        out = import_tensors(name_map(cfg), state)
    except KeyError as err:
        raise AtencionError(f"ViT import: no tensor {err.args[0]!r}; atencion reads the names of transformers 5's "
                            f"ViT (vit.layers.0.attention.q_proj, ...)") from None
    return load_complete(Transformer(cfg), out, "ViT import").eval()


def to_vit(model: Transformer):
    """A transformers.ViTForImageClassification (eval mode) computing the same logits as ``model``;
    an atencion model that ViT cannot express raises AtencionError naming the config key."""
    from transformers import ViTForImageClassification

    if not isinstance(model, Transformer):
        raise AtencionError(f"ViT export: expected an atencion Transformer, got {type(model).__name__}")
    cfg = model.cfg
    hf_model = ViTForImageClassification(vit_config(cfg))
    src = {k: v.detach() for k, v in model.state_dict().items()}
    n = 1 + (cfg.inputs["size"][0] // cfg.inputs["patch"]) * (cfg.inputs["size"][1] // cfg.inputs["patch"])
    src["encoder.positions.weight"] = src["encoder.positions.weight"][:n]  # quirk 1
    out = export_tensors(name_map(cfg), src)
    dtype = src["encoder.embed.proj.weight"].dtype
    return load_exported(hf_model, out, "ViT export").to(dtype)
