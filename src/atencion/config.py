"""The model's hyper-parameters as one typed dataclass, with the paper's presets (Table 3)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import AtencionError


@dataclass
class ModelConfig:
    """Hyper-parameters of a Transformer of the family, named as in the paper.

    ``arch`` is the paper's ``encoder-decoder`` (the default), ``encoder`` (BERT: bidirectional
    self-attention, a masked-LM head), ``decoder`` (GPT: causal self-attention, no
    cross-attention, a tied LM head) or ``rnn``, the recurrent encoder-decoder the Transformer
    replaced (nn/rnn.py; its settings in ``rnn``, and of the fields below it reads the
    vocabularies, ``n_layers``, ``n_decoder_layers``, ``d_model``, ``dropout``, the embedding
    flags and the token ids). ``vocab_size`` is the source vocabulary (and the target
    one unless ``tgt_vocab_size`` is set). ``n_layers`` is the paper's N for the encoder, and for
    the decoder unless ``n_decoder_layers`` is set.
    """

    vocab_size: int
    arch: str = "encoder-decoder"          # "encoder-decoder" | "encoder" (BERT) | "decoder" (GPT) | "rnn"
    tgt_vocab_size: int | None = None
    n_layers: int = 6                      # N
    n_decoder_layers: int | None = None
    d_model: int = 512
    d_ff: int = 2048                       # 0: no feed-forward sub-layer (attention-only, Olsson et al. 2022)
    n_heads: int = 8                       # h; d_k = d_v = d_model / h
    n_kv_heads: int | None = None          # grouped-query attention (Ainslie et al. 2023): g key/value heads, each
                                           # shared by h / g query heads; 1: multi-query; None: h (the paper's)
    dropout: float = 0.1                   # P_drop: sub-layer outputs and embeddings + positions
    attention_dropout: float = 0.0         # on the attention weights (not in the paper's text)
    activation: str = "relu"               # "relu" (the paper, §3.3), "gelu" (BERT), "gelu-tanh" (GPT-2); gated
                                           # (Shazeer 2020): "swiglu" (Llama), "geglu", d_ff the gated width
    norm_first: bool = False               # False: post-LN, the paper's; True: pre-LN
    norm: str = "layernorm"                # "layernorm" or "rmsnorm" (T5)
    positional: str = "sinusoidal"         # a key of POSITIONS (nn/positional.py): absolute, added to the
                                           # embeddings: "sinusoidal" (§3.5), "learned" (Table 3, row E);
                                           # relative, inside self-attention: "rope", "alibi", "t5"
    max_positions: int = 1024              # rows of the learned table; sinusoids extend freely
    rope_base: float = 10000.0             # RoPE: the angle of pair i at position m is m · base^(-2i/d_k)
    rope_scaling: dict[str, Any] | None = None  # RoPE for longer contexts, as the Llama family sets it: {type:
                                           # linear, factor} | {type: llama3, factor, low_freq_factor,
                                           # high_freq_factor, original_max_position_embeddings}; None: none
    relative_buckets: int = 32             # T5: buckets of relative position (half per direction in the encoder)
    relative_max_distance: int = 128       # T5: distances beyond this share the last bucket
    scale_embedding: bool = True           # embeddings multiplied by sqrt(d_model) (§3.4)
    share_embeddings: bool = True          # one table for source and target tokens
    tie_output: bool = True                # the pre-softmax projection uses the target table
    output_bias: bool = False              # a bias on the logits (Marian has one)
    bias: bool = True                      # biases in the attention and feed-forward projections
    qkv_bias: bool = False                 # biases on the q, k, v projections whatever `bias` says (Qwen2)
    layer_norm_eps: float = 1e-5
    scale_attention: bool = True           # divide the scores by √d_k (eq. 1); T5 does not
    scale_output: bool = False             # T5: the decoder output × d_model^-0.5 before the tied projection
    embedding_norm: bool = False           # BERT: a LayerNorm on embeddings + positions (+ token types)
    type_vocab_size: int = 0               # BERT: token-type (segment) embeddings; 0: none
    num_labels: int = 0                    # a sequence-classification head with this many labels; 0: none
    pooling: str = "first"                 # its input: the output of the "first" token (BERT), of the "last"
                                           # real token (GPT), or the "mean" over the real tokens
    pooler: bool = False                   # BERT's pooler before it: tanh(W·pooled + b) (BERT, §3.1's [CLS])
    labels: list[str] | None = None        # the classification head's label names, in logit order
    moe: dict[str, Any] | None = None      # mixture of experts in place of the FFN: {experts, top_k,
                                           # aux_loss_weight, capacity_factor, layers} (nn/moe.py)
    attention: dict[str, Any] | None = None  # the self-attention's kind and its settings: {kind: flash, ...};
                                           # None: eq. (1) itself, {kind: full} (ATTENTION_KINDS, nn/kinds/)
    inputs: dict[str, Any] | None = None   # what the encoder reads and its settings: {kind: patches, patch,
                                           # size, channels} (ViT); None: tokens (INPUTS, nn/inputs.py)
    rnn: dict[str, Any] | None = None      # arch rnn: {cell, hidden, bidirectional, decoder_hidden, bridge,
                                           # attention, score, input_feeding} (RNN_DEFAULTS, nn/rnn.py)
    task: str | None = None                # the task it was trained for (tasks/: translate, lm, mlm, classify);
                                           # None: told by arch and num_labels (directories written before)
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_numbers_and_flags()
        self._check_choices()
        self._check_stacks()
        if self.inputs is not None and INPUTS:  # filled when nn/inputs.py is imported (it needs torch); a
            self.inputs = inputs_settings(self)  # config made before that is completed when its model is built
        if self.vocab_size != 0 or self.inputs is None:  # an encoder of images or sounds reads no tokens
            _require_positive_int("vocab_size", self.vocab_size)
        self._check_positions()
        if self.share_embeddings and self.tgt_vocab_size not in (None, self.vocab_size):
            raise AtencionError(
                f"share_embeddings needs one vocabulary, but vocab_size is {self.vocab_size} "
                f"and tgt_vocab_size is {self.tgt_vocab_size}; set share_embeddings=False"
            )
        self._check_moe()
        if self.attention is not None and ATTENTION_KINDS:  # filled when nn/kinds/ is imported (it needs
            self.attention = attention_settings(self)  # torch); a config made before is completed when built
        self._check_rnn()
        if self.task is not None and not isinstance(self.task, str):
            raise AtencionError(f"task must be the name of a task (translate, lm, mlm, classify), got {self.task!r}")
        self._check_token_ids()

    # the checks of __post_init__, in its order (the first problem found is the one reported) -------------

    def _check_sizes(self) -> None:
        """The widths, depths and heads: positive integers (d_ff may be 0), heads that divide d_model."""
        for key in ("n_layers", "d_model", "n_heads", "max_positions"):
            _require_positive_int(key, getattr(self, key))
        if not isinstance(self.d_ff, int) or isinstance(self.d_ff, bool) or self.d_ff < 0:
            raise AtencionError(f"d_ff must be an integer >= 0 (0: no feed-forward sub-layer), got {self.d_ff!r}")
        for key in ("tgt_vocab_size", "n_decoder_layers"):
            if getattr(self, key) is not None:
                _require_positive_int(key, getattr(self, key))
        if self.arch != "rnn" and self.d_model % self.n_heads != 0:  # an RNN has no heads and no positions
            raise AtencionError(
                f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}): "
                f"each of the h heads gets d_k = d_model / h dimensions"
            )
        if self.n_kv_heads is not None:
            _require_positive_int("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise AtencionError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}): each "
                                    f"key/value head serves n_heads / n_kv_heads query heads")

    def _check_numbers_and_flags(self) -> None:
        """The dropout rates and LayerNorm's epsilon in range, the switches true or false."""
        for key in ("dropout", "attention_dropout"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise AtencionError(f"{key} must be a number in [0, 1), got {value!r}")
        if not isinstance(self.layer_norm_eps, (int, float)) or not 0 < self.layer_norm_eps < 1:
            raise AtencionError(f"layer_norm_eps must be a number in (0, 1), got {self.layer_norm_eps!r}")
        for key in ("norm_first", "scale_embedding", "share_embeddings", "tie_output", "output_bias", "bias",
                    "qkv_bias", "scale_attention", "scale_output", "embedding_norm", "pooler"):
            if not isinstance(getattr(self, key), bool):
                raise AtencionError(f"{key} must be true or false, got {getattr(self, key)!r}")

    def _check_choices(self) -> None:
        """The fields that name one of a few choices, and the classification head's labels."""
        _require_choice("arch", self.arch, ARCHS)
        _require_choice("activation", self.activation, ("relu", "gelu", "gelu-tanh", "swiglu", "geglu"))
        _require_choice("norm", self.norm, ("layernorm", "rmsnorm"))
        _require_choice("pooling", self.pooling, ("first", "last", "mean"))
        if self.labels is not None:
            if (not isinstance(self.labels, list) or len(self.labels) != self.num_labels
                    or not all(isinstance(x, str) for x in self.labels) or len(set(self.labels)) != len(self.labels)):
                raise AtencionError(f"labels must be a list of num_labels ({self.num_labels}) distinct names, "
                                    f"got {self.labels!r}")
        for key in ("type_vocab_size", "num_labels"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise AtencionError(f"{key} must be an integer >= 0, got {value!r}")

    def _check_stacks(self) -> None:
        """What only some archs have: a second stack and vocabulary, token types."""
        if self.arch not in TWO_STACKS and (self.tgt_vocab_size is not None or self.n_decoder_layers is not None):
            raise AtencionError(f"arch {self.arch!r} has one stack and one vocabulary: tgt_vocab_size and "
                                f"n_decoder_layers are for arch 'encoder-decoder' or 'rnn'")
        if self.arch != "encoder" and self.type_vocab_size:
            raise AtencionError(f"type_vocab_size (token types, BERT) needs arch 'encoder', got {self.arch!r}")

    def _check_positions(self) -> None:
        """``positional`` (against POSITIONS, once nn/positional.py has filled it) and the settings
        of RoPE and T5's buckets."""
        if POSITIONS:  # filled when nn/positional.py is imported (it needs torch); a config made before
            check_positional(self)  # that is checked when its model is built (nn/positional.position_kind)
        if not isinstance(self.rope_base, (int, float)) or isinstance(self.rope_base, bool) or self.rope_base <= 1:
            raise AtencionError(f"rope_base must be a number > 1, got {self.rope_base!r}")
        if self.rope_scaling is not None:
            self.rope_scaling = _rope_scaling_settings(self.rope_scaling, self.positional)
        for key in ("relative_buckets", "relative_max_distance"):
            _require_positive_int(key, getattr(self, key))
        if self.relative_buckets < 4 or self.relative_max_distance <= self.relative_buckets // 2:
            raise AtencionError(f"relative_buckets ({self.relative_buckets}) must be >= 4 and below twice "
                                f"relative_max_distance ({self.relative_max_distance})")

    def _check_moe(self) -> None:
        """``moe`` checked and completed: experts need feed-forward layers to replace."""
        if self.moe is None:
            return
        if self.d_ff == 0:
            raise AtencionError("moe replaces the feed-forward layers with experts of width d_ff, but d_ff 0 "
                                "means no feed-forward layer: set d_ff > 0 or remove moe")
        if self.arch == "rnn":
            raise AtencionError("moe replaces a Transformer's feed-forward layers; arch 'rnn' has none")
        self.moe = _moe_settings(self.moe, self._stack_depths())

    def _check_rnn(self) -> None:
        """``rnn`` checked and completed for arch rnn, refused for the others."""
        if self.arch == "rnn":
            if self.num_labels:
                raise AtencionError("num_labels (a classification head) needs arch 'encoder' or 'decoder', not 'rnn'")
            self.rnn = _rnn_settings({} if self.rnn is None else self.rnn, self.d_model)
        elif self.rnn is not None:
            raise AtencionError(f"rnn holds the settings of arch 'rnn'; this model's arch is {self.arch!r} "
                                f"(set arch: rnn, or remove rnn)")

    def _check_token_ids(self) -> None:
        """pad, bos and eos: integers, and ids of every vocabulary the model has."""
        vocabularies = [size for size in (self.vocab_size, self.target_vocab_size) if size]  # 0: no tokens
        for key in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise AtencionError(f"{key} must be an integer, got {value!r}")
            if vocabularies and not 0 <= value < min(vocabularies):
                raise AtencionError(f"{key} must be a token id in [0, {min(vocabularies)}), got {value}")

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size if self.tgt_vocab_size is not None else self.vocab_size

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers if self.n_decoder_layers is not None else self.n_layers

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """g, the key/value heads of self-attention: ``n_kv_heads``, or h."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def _stack_depths(self) -> list[int]:
        """The number of layers of each stack the arch has."""
        return [self.n_layers, self.decoder_layers] if self.arch in TWO_STACKS else [self.n_layers]

    # size, before anything is built ----------------------------------------------------------

    def parameter_parts(self) -> dict[str, int]:
        """About how many parameters each part of the model has, counted from the config alone
        (nothing is built, so a config of 10^12 parameters costs nothing to count): ``layers``
        (attention, feed-forward, norms), ``experts`` (moe: the experts and their routers),
        ``vocabulary`` (token tables, output projection, heads), ``positions`` (learned tables,
        Linformer's projections) and ``inputs`` (an image's or a sound's front end)."""
        if self.arch == "rnn":
            return self._rnn_parts()
        d, parts = self.d_model, dict.fromkeys(("layers", "experts", "vocabulary", "positions", "inputs"), 0)
        norm = d if self.norm == "rmsnorm" else 2 * d
        self_attention = 2 * d * d + 2 * d * self.kv_heads * self.d_k + \
            (d + 2 * self.kv_heads * self.d_k if self.bias or self.qkv_bias else 0) + (d if self.bias else 0)
        cross_attention = 4 * d * d + (4 * d if self.bias else 0)
        gated = self.activation in ("swiglu", "geglu")
        ffn = (3 if gated else 2) * d * self.d_ff + ((2 if gated else 1) * self.d_ff + d if self.bias else 0)
        for stack, depth in enumerate(self._stack_depths()):
            cross = stack == 1
            experts = 0 if self.moe is None else depth if self.moe["layers"] == "all" else depth // 2
            residuals = 1 + cross + (self.d_ff > 0)
            parts["layers"] += depth * (self_attention + cross * cross_attention + residuals * norm) + \
                (depth - experts) * (ffn if self.d_ff else 0) + (norm if self.norm_first else 0)
            if experts:
                parts["experts"] += experts * self.moe["experts"] * (ffn + d)  # + the router's column
            parts["positions"] += self._position_parameters(depth)
            parts["inputs"] += 2 * d if self.embedding_norm and not (cross or self.arch == "decoder" and stack) else 0
        parts["vocabulary"] = self._vocabulary_parameters()
        parts["inputs"] += self._input_parameters()
        return parts

    def parameter_estimate(self) -> int:
        """About how many parameters the model has (the sum of ``parameter_parts``), from the config alone."""
        return sum(self.parameter_parts().values())

    def memory_parts(self, bytes_per_parameter: int) -> dict[str, int]:
        """About the bytes each part of ``parameter_parts`` takes at ``bytes_per_parameter``
        (TRAIN_BYTES or LOAD_BYTES), with what is not a parameter: the sinusoid tables (under
        ``positions``) and the Python objects of the blocks and the experts (a block or an expert
        costs kilobytes whatever its width, so a million narrow layers do not fit either)."""
        stacks = self._stack_depths()
        parts = {part: bytes_per_parameter * count for part, count in self.parameter_parts().items()}
        if self.positional == "sinusoidal" and self.arch != "rnn":  # float64, then float32, in each stack
            parts["positions"] += len(stacks) * self.max_positions * self.d_model * 12
        parts["layers"] += BLOCK_OBJECT_BYTES * sum(stacks)
        if self.moe is not None:
            parts["experts"] += EXPERT_OBJECT_BYTES * self.moe["experts"] * sum(
                depth if self.moe["layers"] == "all" else depth // 2 for depth in stacks)
        return parts

    def memory_estimate(self, bytes_per_parameter: int) -> int:
        """About the bytes the model takes at ``bytes_per_parameter`` (the sum of ``memory_parts``)."""
        return sum(self.memory_parts(bytes_per_parameter).values())

    def _position_parameters(self, depth: int) -> int:
        """The parameters one stack of ``depth`` layers spends on positions."""
        count = self.max_positions * self.d_model if self.positional == "learned" else 0
        if self.positional == "t5":
            count += self.relative_buckets * self.n_heads
        kind = (self.attention or {}).get("kind")
        if kind == "linformer":  # E and F, (proj_len, max_positions) each, shared as `sharing` says
            table = self.attention["proj_len"] * self.max_positions
            sharing = self.attention["sharing"]
            count += {"none": 2 * self.n_heads * table * depth, "headwise": 2 * table * depth,
                      "kv": table * depth, "layerwise": table}[sharing]
        return count

    def _vocabulary_parameters(self) -> int:
        """The token tables, the output projection and the heads over the vocabularies."""
        d, target = self.d_model, self.target_vocab_size
        count = self.vocab_size * d + self.type_vocab_size * d
        if self.arch in TWO_STACKS:
            count += 0 if self.share_embeddings else target * d
            count += (0 if self.tie_output else target * d) + (target if self.output_bias else 0)
        elif self.arch == "decoder":
            count += (0 if self.tie_output else target * d) + (target if self.output_bias else 0)
        elif self.vocab_size:  # BERT's masked-LM head: dense, LayerNorm, a bias over the tied table
            count += d * d + 3 * d + self.vocab_size
        if self.num_labels:
            count += (d * d + d if self.pooler else 0) + d * self.num_labels + self.num_labels
        return count

    def _input_parameters(self) -> int:
        """An image's or a sound's front end (nn/inputs.py), from ``inputs``' settings."""
        settings, d = self.inputs or {}, self.d_model
        if "patch" in settings:  # the patch projection (Shifted Patch Tokenization: 5 views), [CLS]
            width = (5 if settings.get("shifted") else 1) * settings.get("channels", 3) * settings["patch"] ** 2
            return width * d + d + d + (2 * width if settings.get("shifted") else 0)
        if "n_mels" in settings:
            return 3 * settings["n_mels"] * d + 3 * d * d + 2 * d
        return 0

    def _rnn_parts(self) -> dict[str, int]:
        """``parameter_parts`` of arch rnn (nn/rnn.py): the cells of both stacks, the decoder's
        attention, output layer and bridge, and the vocabulary."""
        r, d = self.rnn, self.d_model
        gates = 4 if r["cell"] == "lstm" else 3
        directions = 2 if r["bidirectional"] else 1
        hidden, size, kind = r["hidden"], r["decoder_hidden"], r["attention"]
        memory = hidden * directions

        def cell(inputs: int, units: int) -> int:  # one layer, one direction: W_ih, W_hh, two biases
            return gates * units * (inputs + units + 2)

        layers = directions * (cell(d, hidden) + (self.n_layers - 1) * cell(memory, hidden))
        fed = d if r["input_feeding"] else 0 if kind == "luong" else memory
        layers += cell(d + fed, size) + (self.decoder_layers - 1) * cell(size, size)
        layers += {"bahdanau": size * size + memory * size + size + size,
                   "luong": memory * size if r["score"] == "general" else 0}.get(kind, 0)
        layers += (memory + size + (0 if kind == "luong" else d)) * d + d
        states = self.decoder_layers * size * (2 if gates == 4 else 1)
        layers += memory * states + states if r["bridge"] else 0
        return {"layers": layers, "experts": 0, "vocabulary": self._vocabulary_parameters(), "positions": 0,
                "inputs": 0}

    # presets ---------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named configuration: ``base`` and ``big`` (Table 3), ``tiny`` (Transformer-Tiny),
        ``bert-base``, ``bert-tiny``, ``gpt2``, ``gpt-tiny``, ``t5-small``, ``t5-tiny``, ``llama-tiny``,
        ``smollm-135m``, ``tinyllama-1.1b``, ``mistral-7b``, ``vit-base``, ``vit-tiny``, ``whisper-tiny``."""
        if not isinstance(name, str) or name not in PRESETS:
            raise AtencionError(f"preset: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides}, source=None)

    # serialisation ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str | None = "config") -> "ModelConfig":
        """A config from a mapping; errors are prefixed with ``source`` (a file name) if given."""
        prefix = f"{source}: " if source else ""
        if not isinstance(values, dict):
            raise AtencionError(f"{prefix}expected a mapping of config keys, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise AtencionError(f"{prefix}unknown key(s) {unknown}; known keys are {sorted(known)}")
        if "vocab_size" not in values:
            raise AtencionError(f"{prefix}missing the required key 'vocab_size'")
        try:
            return cls(**_copied_with_floats(values))
        except AtencionError as err:
            raise AtencionError(f"{prefix}{err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        from .fileio import read_json

        return cls.from_dict(read_json(path, "model config"), source=str(path))


def _copied_with_floats(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config mapping (its nested settings copied too, so that checking them leaves the
    caller's alone) in which the float fields that YAML 1.1 read as strings (1e-5) are numbers; a
    string that spells none is left for __post_init__ to name."""
    values = dict(values)
    floats = [(values, key) for key in ("dropout", "attention_dropout", "layer_norm_eps", "rope_base")]
    for key in ("rnn", "attention", "rope_scaling", "inputs"):
        if isinstance(values.get(key), dict):
            values[key] = dict(values[key])
    if isinstance(values.get("moe"), dict):
        values["moe"] = dict(values["moe"])
        floats += [(values["moe"], key) for key in ("aux_loss_weight", "capacity_factor")]
    for mapping, key in floats:
        if isinstance(mapping.get(key), str):
            try:
                mapping[key] = float(mapping[key])
            except ValueError:
                pass
    return values


# The kinds of encoder input ``inputs`` may name (nn/inputs.py's InputKind: the raw input, the archs, the
# settings and their check, the module), filled by nn/inputs.py, imported before the first config that has inputs.
INPUTS: dict[str, Any] = {}
# The position kinds ``positional`` may name (nn/positional.py's PositionKind: role, module, length
# limit, check, the flags rotary and bias), filled by nn/positional.py, which importing atencion.nn loads.
POSITIONS: dict[str, Any] = {}


def check_positional(cfg: "ModelConfig") -> None:
    """``positional`` must name a kind of POSITIONS, and the config must suit it (its ``check``)."""
    _require_choice("positional", cfg.positional, tuple(POSITIONS))
    problem = POSITIONS[cfg.positional].check(cfg) if cfg.arch != "rnn" else None  # an RNN has no positions
    if problem:
        raise AtencionError(problem)


# Memory, counted before anything is allocated (ModelConfig.memory_estimate, check_memory). Training in
# fp32 holds each parameter, its gradient and Adam's two moments; loading holds the parameter alone.
TRAIN_BYTES, LOAD_BYTES = 16, 4
# The Python objects of one Transformer block (about 49 KB measured) and of one expert (about 8 KB),
# whatever their width: counted so that a million narrow layers are refused, not built for an hour.
BLOCK_OBJECT_BYTES, EXPERT_OBJECT_BYTES = 40_000, 6_000


def machine_memory() -> int | None:
    """The bytes of memory this machine (or the container's cgroup limit, if lower) has; None when
    neither can be read. The total, not what is free now: what no model larger than it can fit in."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        total = _number_in("/proc/meminfo", r"^MemTotal:\s+(\d+) kB", 1024)
    sizes = [size for size in (total, _number_in("/sys/fs/cgroup/memory.max", r"^(\d+)$")) if size]
    return min(sizes) if sizes else None


def _number_in(path: str, pattern: str, scale: int = 1) -> int | None:
    """The number ``pattern`` finds in the file ``path`` times ``scale``; None when either is missing
    (cgroup's memory.max says "max" when there is no limit)."""
    try:
        found = re.search(pattern, Path(path).read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * scale if found else None


def human_bytes(count: float) -> str:
    """``count`` bytes in decimal units, two significant digits: 16 TB, 24 GB, 512 MB."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB", "EB"):
        if count < 1000 or unit == "EB":
            return f"{count:.2g} {unit}" if count < 10 else f"{count:.0f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def check_memory(cfg: ModelConfig, bytes_per_parameter: int, memory: int | None, doing: str,
                 where: str = "this machine", without: tuple[str, ...] = ()) -> None:
    """Refuse, in one line with the figures, a model whose estimate (``ModelConfig.memory_parts``,
    less the parts named in ``without``) exceeds ``memory`` bytes (``where`` has them; None:
    unknown, nothing refused), before anything is built: a config of 10^12 parameters otherwise
    fails its allocation with a traceback, or hangs. ``doing``: what the bytes are for ("to train")."""
    parts = {part: size for part, size in cfg.memory_parts(bytes_per_parameter).items() if part not in without}
    needed = sum(parts.values())
    if memory is None or needed <= memory:
        return
    largest = max(parts, key=parts.get)
    mostly = {"layers": f"the layers: n_layers {cfg.n_layers}, d_model {cfg.d_model}, d_ff {cfg.d_ff}",
              "experts": f"the experts: moe.experts {(cfg.moe or {}).get('experts')}, d_ff {cfg.d_ff}",
              "vocabulary": f"the vocabulary: vocab_size {cfg.vocab_size}, d_model {cfg.d_model}",
              "positions": f"the positions: max_positions {cfg.max_positions}, positional {cfg.positional}",
              "inputs": f"the inputs: {cfg.inputs}"}[largest]
    count = sum(size for part, size in cfg.parameter_parts().items() if part not in without)
    mantissa, exponent = f"{count:.1e}".split("e")
    raise AtencionError(f"model: about {mantissa}e{int(exponent)} parameters in {sum(cfg._stack_depths()):,} "
                        f"layers ({human_bytes(needed)} {doing}; most of it {mostly}); {where} has "
                        f"{human_bytes(memory)}: make the model smaller")


# The keys a training config's model section may hold (train/config.py; each tower of task contrastive's):
# ModelConfig's fields and a preset's name. The vocabulary sizes and special ids come from the trained
# tokenizer, the labels from the data, the task from the config's task: key.
MODEL_KEYS = {"preset"} | {f.name for f in dataclasses.fields(ModelConfig)} - {
    "vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id", "num_labels", "labels", "task"}

ARCHS = ("encoder-decoder", "encoder", "decoder", "rnn")
TWO_STACKS = ("encoder-decoder", "rnn")   # the archs with an encoder and a decoder: translators

_BERT = dict(arch="encoder", activation="gelu", positional="learned", max_positions=512, type_vocab_size=2,
             embedding_norm=True, layer_norm_eps=1e-12, scale_embedding=False, dropout=0.1)
_GPT = dict(arch="decoder", activation="gelu-tanh", positional="learned", max_positions=1024, norm_first=True,
            scale_embedding=False, dropout=0.1)
_LLAMA = dict(arch="decoder", norm="rmsnorm", norm_first=True, positional="rope", activation="swiglu", bias=False,
              scale_embedding=False, tie_output=False, dropout=0.0)
_T5 = dict(positional="t5", norm="rmsnorm", norm_first=True, bias=False, scale_attention=False,
           scale_embedding=False, scale_output=True, layer_norm_eps=1e-6, dropout=0.1)

_VIT = dict(arch="encoder", vocab_size=0, activation="gelu", positional="learned", max_positions=197, norm_first=True,
            layer_norm_eps=1e-12, scale_embedding=False, dropout=0.0,
            inputs={"kind": "patches", "patch": 16, "size": [224, 224], "channels": 3})
# Whisper (Radford et al. 2022, §2.2, Table 1): pre-LN blocks with GELU, an encoder of log-mel frames and a text
# decoder with tied output; sinusoidal positions in both stacks here (Whisper's decoder learns its own).
_WHISPER = dict(arch="encoder-decoder", vocab_size=0, activation="gelu", norm_first=True, positional="sinusoidal",
                scale_embedding=False, share_embeddings=False, dropout=0.0, max_positions=1500,
                inputs={"kind": "spectrogram", "n_mels": 80, "max_frames": 3000})
PRESETS: dict[str, dict[str, Any]] = {
    # Vaswani et al. 2017, Table 3.
    "base": dict(n_layers=6, d_model=512, d_ff=2048, n_heads=8, dropout=0.1),
    "big": dict(n_layers=6, d_model=1024, d_ff=4096, n_heads=16, dropout=0.3),
    # Transformer-Tiny on Multi30k (Wu et al., ACL 2021).
    "tiny": dict(n_layers=4, d_model=128, d_ff=256, n_heads=4, dropout=0.3),
    # BERT (Devlin et al. 2019): 110M with the 30,522 WordPiece vocabulary; BERT-Tiny (Turc et al. 2019).
    "bert-base": dict(_BERT, n_layers=12, d_model=768, d_ff=3072, n_heads=12),
    "bert-tiny": dict(_BERT, n_layers=2, d_model=128, d_ff=512, n_heads=2),
    # GPT-2 small (Radford et al. 2019): 124M with its 50,257-token vocabulary; a CPU-sized one.
    "gpt2": dict(_GPT, n_layers=12, d_model=768, d_ff=3072, n_heads=12),
    "gpt-tiny": dict(_GPT, n_layers=4, d_model=128, d_ff=512, n_heads=4, max_positions=256),
    # T5 (Raffel et al. 2020): t5-small, 60M with its 32,128-token vocabulary; a CPU-sized one.
    "t5-small": dict(_T5, n_layers=6, d_model=512, d_ff=2048, n_heads=8),
    "t5-tiny": dict(_T5, n_layers=2, d_model=128, d_ff=512, n_heads=4),
    # Llama's decoder (Touvron et al. 2023): pre-RMSNorm, RoPE, SwiGLU, grouped-query attention; a CPU-sized one,
    # and the shapes of SmolLM-135M (Allal et al. 2024), TinyLlama-1.1B (Zhang et al. 2024) and Mistral-7B
    # (Jiang et al. 2023: v0.1, its sliding window of 4,096 keys).
    "llama-tiny": dict(_LLAMA, n_layers=4, d_model=128, d_ff=352, n_heads=4, n_kv_heads=2, max_positions=256,
                       dropout=0.1),
    "smollm-135m": dict(_LLAMA, n_layers=30, d_model=576, d_ff=1536, n_heads=9, n_kv_heads=3, max_positions=2048,
                        tie_output=True),
    "tinyllama-1.1b": dict(_LLAMA, n_layers=22, d_model=2048, d_ff=5632, n_heads=32, n_kv_heads=4,
                           max_positions=2048),
    "mistral-7b": dict(_LLAMA, n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8, max_positions=32768,
                       attention={"kind": "window", "window": 4096}),
    # ViT (Dosovitskiy et al. 2021): ViT-B/16 at 224 × 224 (86M); ViT-Ti/16 (DeiT-Ti, Touvron et al. 2021: 5.7M).
    "vit-base": dict(_VIT, n_layers=12, d_model=768, d_ff=3072, n_heads=12),
    "vit-tiny": dict(_VIT, n_layers=12, d_model=192, d_ff=768, n_heads=3),
    # Whisper tiny (39M with its 51,865-token vocabulary; 30 s of audio, 3,000 frames, 1,500 encoder positions).
    "whisper-tiny": dict(_WHISPER, n_layers=4, d_model=384, d_ff=1536, n_heads=6),
}
# vocabulary and the parameter count their papers give
PUBLISHED = {"base": (37000, "65M"), "big": (37000, "213M"), "bert-base": (30522, "110M"), "gpt2": (50257, "124M"),
             "t5-small": (32128, "60M"), "smollm-135m": (49152, "135M"), "tinyllama-1.1b": (32000, "1.1B"),
             "mistral-7b": (32000, "7.2B"), "vit-base": (0, "86M"), "whisper-tiny": (51865, "39M")}


# RoPE scaling (``rope_scaling``): each type and the keys it needs, as Hugging Face's Llama family writes them
ROPE_SCALING = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope_scaling_settings(values: Any, positional: str) -> dict[str, Any]:
    """``rope_scaling`` checked: a type of ROPE_SCALING with exactly its keys, ``factor`` >= 1 (the
    context grows by it), llama3's ``high_freq_factor`` above its ``low_freq_factor`` > 0 and its
    ``original_max_position_embeddings`` (the context it was trained for) a positive integer."""
    if not isinstance(values, dict):
        raise AtencionError(f"rope_scaling must be a mapping such as {{type: linear, factor: 2.0}} (or null), "
                            f"got {values!r}")
    kind = values.get("type")
    _require_choice("rope_scaling.type", kind, tuple(ROPE_SCALING))
    known = ["type", *ROPE_SCALING[kind]]
    unknown, missing = sorted(str(k) for k in set(values) - set(known)), [k for k in known if k not in values]
    if unknown or missing:
        raise AtencionError(f"rope_scaling.{(unknown or missing)[0]} is {'not a' if unknown else 'a missing'} "
                            f"setting of rope_scaling type {kind!r}; its keys are {known}")
    if positional != "rope":
        raise AtencionError(f"rope_scaling scales RoPE's frequencies: it needs positional 'rope', not {positional!r}")
    settings = {"type": kind}
    for key in ROPE_SCALING[kind]:
        integer = key == "original_max_position_embeddings"
        settings[key] = number(f"rope_scaling.{key}", values[key], integer)
    if settings["factor"] < 1:
        raise AtencionError(f"rope_scaling.factor must be >= 1 (the context grows by it), got {settings['factor']}")
    if kind == "llama3":
        if not 0 < settings["low_freq_factor"] < settings["high_freq_factor"]:
            raise AtencionError(f"rope_scaling: low_freq_factor ({settings['low_freq_factor']}) must be > 0 and below "
                                f"high_freq_factor ({settings['high_freq_factor']})")
        _require_positive_int("rope_scaling.original_max_position_embeddings",
                              settings["original_max_position_embeddings"])
    return settings


MOE_DEFAULTS: dict[str, Any] = {"top_k": 2, "aux_loss_weight": 0.01, "capacity_factor": 0.0, "layers": "all",
                                "gate": "renormalize"}


def _moe_settings(moe: Any, depths: list[int]) -> dict[str, Any]:
    """``moe`` checked and completed with the defaults (so config.json names every setting):
    ``experts`` (E, required), ``top_k`` (experts per token), ``aux_loss_weight`` (of the
    load-balancing loss), ``capacity_factor`` (0: no limit), ``layers`` ("all", or
    "every_other": layers 1, 3, ... of each stack, as GShard), ``gate`` ("renormalize": the
    chosen probabilities scaled to sum to 1, Mixtral's; "switch": the probabilities themselves)."""
    known = ["experts", *MOE_DEFAULTS]
    if not isinstance(moe, dict):
        raise AtencionError(f"moe must be a mapping with the keys {known} (or null), got {moe!r}")
    unknown = sorted(str(key) for key in set(moe) - set(known))
    if unknown:
        raise AtencionError(f"moe.{unknown[0]} is not a setting of moe; its keys are {known}")
    if "experts" not in moe:
        raise AtencionError(f"moe.experts is missing: the number of expert feed-forward networks (keys: {known})")
    settings = {"experts": moe["experts"], **MOE_DEFAULTS, **moe}
    for key in ("experts", "top_k"):
        value = settings[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AtencionError(f"moe.{key} must be an integer >= 1, got {value!r}")
    if settings["top_k"] > settings["experts"]:
        raise AtencionError(f"moe.top_k ({settings['top_k']}) must be at most moe.experts ({settings['experts']}): "
                            f"each token goes to top_k different experts")
    for key in ("aux_loss_weight", "capacity_factor"):
        value = settings[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise AtencionError(f"moe.{key} must be a number >= 0, got {value!r}")
        settings[key] = float(value)
    _require_choice("moe.layers", settings["layers"], ("all", "every_other"))
    _require_choice("moe.gate", settings["gate"], ("renormalize", "switch"))
    if settings["layers"] == "every_other" and max(depths) < 2:
        raise AtencionError("moe.layers every_other puts experts in layers 1, 3, ... (counting from 0), but no "
                            "stack has a second layer; use moe.layers: all")
    return settings


# The kinds of self-attention ``attention.kind`` may name (nn/kinds/'s KindSpec: settings and their defaults,
# the lowest value of each integer setting, the allowed names of the others, its check, its note, its builder),
# filled by nn/kinds/, which importing atencion.nn loads (it needs torch). Cross-attention is always eq. (1).
ATTENTION_KINDS: dict[str, Any] = {}


def attention_settings(cfg: "ModelConfig") -> dict[str, Any]:
    """``attention`` checked and completed with its kind's defaults (so config.json names every
    setting): a key that is not a setting of the kind, a number out of range, a kind that does not
    fit the arch or the positions (its ``check``) are refused in one line naming the key."""
    values = cfg.attention
    if not isinstance(values, dict):
        raise AtencionError(f"attention must be a mapping such as {{kind: flash}} (or null), got {values!r}")
    name = values.get("kind", "full")
    _require_choice("attention.kind", name, tuple(ATTENTION_KINDS))
    kind = ATTENTION_KINDS[name]
    known = ["kind", *kind.settings]
    unknown = sorted(str(key) for key in set(values) - set(known))
    if unknown:
        raise AtencionError(f"attention.{unknown[0]} is not a setting of attention kind {name!r}; its keys are {known}")
    settings = {"kind": name, **kind.settings, **values}
    for key, lowest in kind.at_least.items():
        if not (isinstance(settings[key], int) and not isinstance(settings[key], bool) and settings[key] >= lowest):
            raise AtencionError(f"attention.{key} must be an integer >= {lowest}, got {settings[key]!r}")
    for key, choices in kind.choices.items():
        _require_choice(f"attention.{key}", settings[key], choices)
    kind.check(cfg, settings)
    if cfg.arch == "rnn" and name != "full":
        raise AtencionError("attention sets a Transformer's self-attention kind; arch 'rnn' has its own "
                            "(rnn.attention)")
    return settings


def inputs_settings(cfg: "ModelConfig") -> dict[str, Any] | None:
    """``inputs`` checked and completed with its kind's defaults (so config.json names every
    setting): a bare name is ``{kind: NAME}``; tokens (the default) is None, so that a model of
    tokens writes the config.json it always did. A key that is not a setting of the kind, a missing
    one, a value out of range (the kind's ``check``), an arch whose encoder cannot read it, a
    vocabulary for an encoder that reads no tokens: refused in one line naming the key."""
    values = cfg.inputs
    if isinstance(values, str):
        values = {"kind": values}
    if not isinstance(values, dict):
        raise AtencionError(f"inputs must be a mapping such as {{kind: patches, patch: 4, size: [8, 8]}}, or a "
                            f"kind's name (null: tokens), got {values!r}")
    name = values.get("kind", "tokens")
    _require_choice("inputs.kind", name, tuple(INPUTS))
    kind = INPUTS[name]
    known = ["kind", *kind.required, *kind.defaults]
    unknown = sorted(str(key) for key in set(values) - set(known))
    if unknown:
        raise AtencionError(f"inputs.{unknown[0]} is not a setting of inputs kind {name!r}; its keys are {known}")
    missing = [key for key in kind.required if key not in values]
    if missing:
        raise AtencionError(f"inputs.{missing[0]} is missing: inputs kind {name!r} needs {list(kind.required)} "
                            f"(and takes {list(kind.defaults)})")
    if cfg.arch not in kind.archs:
        raise AtencionError(f"inputs kind {name!r} ({kind.takes}) is read by the encoder of arch "
                            f"{' or '.join(kind.archs)}, not {cfg.arch!r}")
    if kind.tokens:
        return None
    settings = {key: values[key] if key in values else kind.defaults[key] for key in known}
    settings["kind"] = name
    problem = kind.check(cfg, settings)
    if problem:
        raise AtencionError(problem)
    _require_no_source_tokens(cfg, name, kind)
    return settings


def _require_no_source_tokens(cfg: "ModelConfig", name: str, kind: Any) -> None:
    """An encoder that reads no tokens (inputs kind ``name``) has no source vocabulary nor token
    types, and its decoder (if any) needs a vocabulary of its own."""
    if cfg.vocab_size != 0:
        raise AtencionError(f"vocab_size must be 0 with inputs kind {name!r}: the encoder reads {kind.takes}, not "
                            f"tokens (a decoder's vocabulary is tgt_vocab_size), got {cfg.vocab_size!r}")
    if cfg.type_vocab_size:
        raise AtencionError(f"type_vocab_size (token types) needs inputs of tokens, not inputs kind {name!r}")
    if cfg.arch in TWO_STACKS and cfg.tgt_vocab_size is None:
        raise AtencionError(f"tgt_vocab_size is missing: the decoder writes tokens, and with inputs kind {name!r} it "
                            f"has the only vocabulary")


RNN_DEFAULTS: dict[str, Any] = {"cell": "gru", "hidden": None, "bidirectional": True, "decoder_hidden": None,
                                "bridge": True, "attention": "bahdanau", "score": None, "input_feeding": None}
RNN_SCORES = {"bahdanau": ("additive",), "luong": ("general", "dot")}   # the first is the default


def _rnn_settings(rnn: Any, d_model: int) -> dict[str, Any]:
    """``rnn`` checked and completed (so config.json names every setting): ``cell`` ("gru" or
    "lstm"), ``hidden`` (the encoder's units per direction; default d_model), ``bidirectional``
    (the encoder), ``decoder_hidden`` (default d_model), ``bridge`` (a tanh layer from the
    encoder's final states to the decoder's first; without it they must have one size),
    ``attention`` ("none", "bahdanau" or "luong"), ``score`` (Luong's "general" or "dot";
    Bahdanau's is "additive"), ``input_feeding`` (Luong's; default true with luong)."""
    known = [*RNN_DEFAULTS, "decoder_bidirectional"]
    if not isinstance(rnn, dict):
        raise AtencionError(f"rnn must be a mapping with the keys {known[:-1]} (or null), got {rnn!r}")
    unknown = sorted(str(key) for key in set(rnn) - set(known))
    if unknown:
        raise AtencionError(f"rnn.{unknown[0]} is not a setting of rnn; its keys are {known[:-1]}")
    if rnn.get("decoder_bidirectional", False) is not False:
        raise AtencionError("rnn.decoder_bidirectional: a decoder writes left to right and cannot read the words it "
                            "has not written yet; only the encoder can be bidirectional (rnn.bidirectional)")
    settings = {**RNN_DEFAULTS, **{key: value for key, value in rnn.items() if key != "decoder_bidirectional"}}
    _require_choice("rnn.cell", settings["cell"], ("gru", "lstm"))
    _require_choice("rnn.attention", settings["attention"], ("none", "bahdanau", "luong"))
    for key in ("hidden", "decoder_hidden"):
        settings[key] = d_model if settings[key] is None else settings[key]
        _require_positive_int(f"rnn.{key}", settings[key])
    for key in ("bidirectional", "bridge"):
        if not isinstance(settings[key], bool):
            raise AtencionError(f"rnn.{key} must be true or false, got {settings[key]!r}")
    _rnn_scoring(settings)
    _rnn_sizes(settings)
    return settings


def _rnn_scoring(settings: dict[str, Any]) -> None:
    """``score`` and ``input_feeding`` completed for ``attention`` (its first score, Luong's input
    feeding), or refused where that attention has none such."""
    kind = settings["attention"]
    scores = RNN_SCORES.get(kind, ())
    if settings["score"] is None:
        settings["score"] = scores[0] if scores else None
    elif not scores:
        raise AtencionError("rnn.score: attention 'none' scores nothing; remove rnn.score")
    else:
        _require_choice(f"rnn.score (of attention {kind!r})", settings["score"], scores)
    feeding = settings["input_feeding"]
    if feeding is None:
        settings["input_feeding"] = kind == "luong"
    elif not isinstance(feeding, bool):
        raise AtencionError(f"rnn.input_feeding must be true or false, got {feeding!r}")
    elif feeding and kind != "luong":
        fed = "its context by construction" if kind == "bahdanau" else "none"
        raise AtencionError(f"rnn.input_feeding is Luong's (the last attentional vector fed to the next step); "
                            f"attention {kind!r} feeds {fed}: use attention: luong or input_feeding: false")


def _rnn_sizes(settings: dict[str, Any]) -> None:
    """The encoder's final state and the decoder's must have one size without a bridge, and the dot
    score multiplies the decoder's state with the encoder's."""
    memory = settings["hidden"] * (2 if settings["bidirectional"] else 1)
    if not settings["bridge"] and memory != settings["decoder_hidden"]:
        raise AtencionError(f"rnn.decoder_hidden ({settings['decoder_hidden']}) must equal the encoder's final state "
                            f"({memory}: rnn.hidden {settings['hidden']} x {2 if settings['bidirectional'] else 1} "
                            f"direction(s)) without a bridge; set rnn.bridge: true or make the sizes match")
    if settings["score"] == "dot" and memory != settings["decoder_hidden"]:
        raise AtencionError(f"rnn.score 'dot' multiplies the decoder state ({settings['decoder_hidden']}) with the "
                            f"encoder states ({memory}): the sizes must match; use score: general")


def _require_positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AtencionError(f"{key} must be a positive integer, got {value!r}")


def _require_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise AtencionError(f"{key} must be one of {list(choices)}, got {value!r}")


def number(key: str, value: Any, integer: bool) -> int | float:
    """``value`` as a finite number. YAML 1.1 reads ``3e-3`` (no dot) as a string, so strings that
    spell a number are numbers too; an integer field takes only whole numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise AtencionError(f"{key}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise AtencionError(f"{key}: expected {'an integer' if integer else 'a number'}, "
                                f"got {value!r}") from None
    if not math.isfinite(value):
        raise AtencionError(f"{key}: expected a finite number, got {value!r}")
    if integer:
        if value != int(value):
            raise AtencionError(f"{key}: expected an integer, got {value!r}")
        return int(value)
    return float(value)
