"""What atencion reads from a Hugging Face directory's config.json, checked in one place before
transformers or atencion's importers see it (interop/hf_dir.py calls ``read_checked``).

Each key atencion reads has a rule in ``RULES``: a count is a whole number of at least 1 (not
``true``, not ``64.0``, not ``"64"``), a dropout rate a number in [0, 1), an epsilon or a RoPE
base a positive finite number, a switch ``true`` or ``false``, a token id one of the
vocabulary's when the model reads it (or null). Then what keys must agree on (``AGREE``): the heads divide the width,
the key/value heads divide the heads. A value that breaks a rule is refused in one line naming
the file, the key and what is expected; none is clipped, converted or ignored. What only
transformers reads is left to transformers, whose own refusals hf_dir.py turns into one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import AtencionError
from ..fileio import read_json
from ..fileio import shown_json as _shown

Rule = Callable[[Any], "str | None"]  # a value → what is expected of it when it is wrong, else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def count(minimum: int = 1, most: int | None = None) -> Rule:
    expected = f"a whole number ≥ {minimum}" if most is None else f"a whole number from {minimum} to {most:,}"
    return lambda v: None if _is_int(v) and v >= minimum and (most is None or v <= most) else expected


def positive() -> Rule:
    return lambda v: None if _is_number(v) and v > 0 else "a positive finite number"


def rate() -> Rule:
    return lambda v: None if _is_number(v) and 0 <= v < 1 else "a number in [0, 1) (a dropout rate)"


def fraction() -> Rule:
    return lambda v: None if _is_number(v) and 0 < v <= 1 else "a number in (0, 1]"


def switch() -> Rule:
    return lambda v: None if isinstance(v, bool) else "true or false"


def text() -> Rule:
    return lambda v: None if isinstance(v, str) and v else "a non-empty string"


def texts() -> Rule:
    return lambda v: (None if isinstance(v, list) and v and all(isinstance(x, str) and x for x in v)
                      else "a list of non-empty strings")


def optional(rule: Rule) -> Rule:
    expected = rule(object())
    return lambda v: None if v is None or rule(v) is None else f"{expected}, or null"


def size() -> Rule:  # ViT's image_size / patch_size: one side, or [height, width]
    return lambda v: (None if (_is_int(v) and v >= 1) or (isinstance(v, list) and len(v) == 2 and
                                                           all(_is_int(x) and x >= 1 for x in v))
                      else "a whole number ≥ 1 or a list [height, width] of them")


def token_ids() -> Rule:  # checked against vocab_size by ``_check_token_ids``
    def rule(v):
        values = v if isinstance(v, list) else [v]
        return (None if v is None or (values and all(_is_int(x) and x >= 0 for x in values))
                else "a token id (a whole number ≥ 0), a list of them, or null")
    return rule


def rope() -> Rule:
    """``rope_scaling`` / ``rope_parameters``: null or an object of RoPE's settings, each checked."""
    inner = {"rope_type": text(), "type": text(), "rope_theta": positive(), "factor": positive(),
             "low_freq_factor": positive(), "high_freq_factor": positive(),
             "original_max_position_embeddings": count(), "partial_rotary_factor": fraction()}

    def rule(v):
        if v is None:
            return None
        if not isinstance(v, dict):
            return "an object of RoPE settings (rope_type, factor, …), or null"
        for key, check in inner.items():
            if key in v and (wrong := check(v[key])) is not None:
                return f"an object whose {key} is {wrong} (got {_shown(v[key])})"
        return None
    return rule


def labels() -> Rule:
    """``id2label``: an object from label ids ("0", "1", …) to names."""
    def rule(v):
        ok = isinstance(v, dict) and all(isinstance(k, str) and k.isdigit() and isinstance(name, str)
                                         for k, name in v.items())
        return None if ok else 'an object from label ids ("0", "1", …) to label names'
    return rule


def label_ids() -> Rule:
    """``label2id``: an object from names to label ids."""
    return lambda v: (None if isinstance(v, dict) and all(_is_int(i) and i >= 0 for i in v.values())
                      else "an object from label names to label ids (whole numbers ≥ 0)")


# layers: transformers lists each layer's kind while it reads the file (10^9 layers: minutes and gigabytes)
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers")
MOST_LAYERS = 10_000  # the deepest published models have a few hundred
COUNTS = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
          "max_position_embeddings", "n_embd", "n_head", "n_positions", "d_model", "d_ff", "d_kv",
          "num_heads", "encoder_attention_heads",
          "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "relative_attention_num_buckets",
          "relative_attention_max_distance", "num_channels", "num_labels", "type_vocab_size")
OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim", "n_inner", "sliding_window", "decoder_vocab_size")
RATES = ("attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "hidden_dropout",
         "dropout_rate", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop", "activation_dropout")
POSITIVES = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "rotary_emb_base")
SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_parallel_residual", "scale_embedding",
            "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention", "is_decoder",
            "qkv_bias", "apply_residual_connection_post_layernorm", "share_encoder_decoder_embeddings",
            "use_sliding_window", "tie_encoder_decoder", "scale_decoder_outputs")
TEXTS = ("model_type", "hidden_act", "activation_function", "feed_forward_proj", "position_embedding_type")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
FED_IDS = ("pad_token_id", "decoder_start_token_id")  # ids the model reads as input: within the vocabulary

RULES: dict[str, Rule] = {
    **dict.fromkeys(COUNTS, count()), **dict.fromkeys(OPTIONAL_COUNTS, optional(count())),
    **dict.fromkeys(LAYERS, count(1, MOST_LAYERS)), "num_decoder_layers": optional(count(1, MOST_LAYERS)),
    **dict.fromkeys(RATES, rate()), **dict.fromkeys(POSITIVES, positive()),
    **dict.fromkeys(SWITCHES, switch()), **dict.fromkeys(TEXTS, text()), **dict.fromkeys(TOKEN_IDS, token_ids()),
    "max_window_layers": count(0), "rotary_pct": fraction(), "partial_rotary_factor": fraction(),
    "architectures": optional(texts()), "layer_types": optional(texts()),
    "rope_scaling": rope(), "rope_parameters": rope(),
    "image_size": size(), "patch_size": size(), "id2label": labels(), "label2id": label_ids(),
}

# (whole, part, why): ``part`` must divide ``whole``
_HEADS = "each head reads {whole} / {part} features"
AGREE = (("hidden_size", "num_attention_heads", _HEADS), ("n_embd", "n_head", _HEADS),
         ("d_model", "encoder_attention_heads", _HEADS), ("d_model", "decoder_attention_heads", _HEADS),
         ("num_attention_heads", "num_key_value_heads", "each key/value head serves {whole} / {part} query heads"))


def read_checked(path: Path) -> dict[str, Any]:
    """The object in the config.json at ``path``, every key atencion reads checked (``RULES``,
    ``AGREE``, token ids within the vocabulary); AtencionError naming the file and key otherwise."""
    config = read_json(path, "model configuration")
    if not isinstance(config, dict):
        raise AtencionError(f"{path}: holds {type(config).__name__}; expected a JSON object of settings")
    if "model_type" not in config:
        raise AtencionError(f"{path}: has no model_type; expected a Hugging Face model configuration")
    for key, rule in RULES.items():
        if key in config and (expected := rule(config[key])) is not None:
            raise AtencionError(f"{path}: {key} is {_shown(config[key])}; expected {expected}")
    for whole, part, why in AGREE:
        w, p = config.get(whole), config.get(part)
        if _is_int(w) and _is_int(p) and w % p:
            raise AtencionError(f"{path}: {part} ({p}) must divide {whole} ({w}): "
                                + why.format(whole=whole, part=part))
    _check_token_ids(path, config)
    return config


def _check_token_ids(path: Path, config: dict[str, Any]) -> None:
    """Every token id fed to the model (``FED_IDS``) names a token of the vocabulary
    (``vocab_size``). BOS and EOS ids past it are taken as transformers takes them (a warning):
    an id the model cannot produce never ends a text, and a tiny model saved with GPT-2's
    defaults keeps its 50256."""
    vocab = config.get("vocab_size")
    if not _is_int(vocab):
        return
    for key in FED_IDS:
        value = config.get(key)
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token >= vocab:
                raise AtencionError(f"{path}: {key} is {token}, outside the vocabulary (vocab_size {vocab}); "
                                    f"expected an id below {vocab}, or null")
