"""Training configuration: typed dataclasses, loaded from YAML, overridable with ``--set key=value``.

configs/reference.yaml documents every key and its default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import LOAD_BYTES, MODEL_KEYS, PRESETS, TRAIN_BYTES, TWO_STACKS, ModelConfig, check_memory, machine_memory
from ..config import number as _number  # strings that spell numbers are numbers (YAML 1.1)
from ..decode.settings import DecodeConfig
from ..errors import AtencionError, MissingFileError
from ..nn.inputs import input_kind, input_kind_named
from ..nn.lora import LoraSpec
from ..nn.positional import position_limit
from ..nn.prefix import spec_from_config
from ..tasks import TASKS
from ..tasks.base import TaskSpec


@dataclass
class DataConfig:
    train_src: str | None = None        # translate: two aligned files (plain or .gz) ...
    train_tgt: str | None = None
    train_tsv: str | None = None        # ... or one TSV file: source TAB target; classify: label TAB text
    valid_src: str | None = None
    valid_tgt: str | None = None
    valid_tsv: str | None = None
    train_text: str | list[str] | None = None   # lm, mlm: plain-text files (one path or a list)
    valid_text: str | list[str] | None = None   # lm, mlm: validation text; if absent, the held-out tail
    valid_fraction: float = 0.1         # lm, mlm without valid_text: the last this share of the text validates
    train_tokens: str | list[str] | None = None  # lm: token files (`atencion tokenize`), memory-mapped, in
                                        # place of train_text
    valid_tokens: str | list[str] | None = None  # lm: validation token files; if absent, the held-out tail
    tokenizer_dir: str | None = None    # lm: use this directory's tokenizer (a model's, a run's, a Hugging Face
                                        # tokenizer's) instead of training one; token files need theirs
    block_size: int = 256               # lm: tokens per training block (the context length)
    mask_probability: float = 0.15      # mlm: share of the tokens chosen for prediction (BERT: 15%)
    header: str = "auto"                # classify TSV: "auto" (a first line whose label is no label), "yes", "no"
    tokenizer: str = "sentencepiece"    # "sentencepiece" (model_type, vocab_size), "subword-nmt" (joint BPE of
                                        # vocab_size merges, on whitespace-tokenized text), "char" (one per
                                        # character) or "whitespace" (one per whitespace-separated symbol)
    empty_lines: str = "skip"           # "skip" (drop and count) or "error"
    max_len: int = 256                  # pairs (mlm, classify: sentences) longer than this many tokens are
                                        # dropped (counted)
    vocab_size: int = 8000              # SentencePiece vocabulary (joint: one for both sides); subword-nmt: merges
    model_type: str = "bpe"             # "bpe" or "unigram"
    joint: bool = True                  # one vocabulary for source and target
    character_coverage: float = 1.0
    shift: int = 0                      # classify on images: each training image moved by a random whole number of
                                        # pixels in [-shift, shift] along each axis, zero-filled (augmentation)
    rotate: float = 0.0                 # classify on images: each training image turned by a random angle in
                                        # [-rotate, rotate] degrees, bilinear, zero-filled (augmentation)


@dataclass
class OptimConfig:
    seed: int = 1
    max_tokens: int = 4096              # padded source (and target) tokens per micro-batch
    accum_steps: int = 1                # micro-batches per update (per process)
    max_steps: int = 0                  # stop after this many updates (0: no limit)
    max_epochs: int = 10
    time_limit_minutes: float = 0.0     # stop after this wall time (0: no limit)
    lr_factor: float = 1.0              # lrate = lr_factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)
    lr_peak: float | None = None        # alternatively: the learning rate reached at step = warmup
    warmup: int = 4000
    schedule: str = "inverse_sqrt"      # after warm-up: "inverse_sqrt" (§5.3), "cosine" (down to lr_min at
                                        # max_steps, as nanoGPT) or "constant"
    lr_min: float = 0.0                 # cosine: the rate reached at max_steps
    optimizer: str = "adam"             # "adam" (§5.3; weight_decay is an L2 term) or "adamw" (decoupled decay)
    init_from: str | None = None        # start from this trained model directory (its weights and tokenizer)
    lora: dict[str, Any] | None = None  # LoRA adapters over the frozen init_from weights: {rank, alpha, dropout,
                                        # targets} (nn/lora.py)
    prefix: dict[str, Any] | None = None  # prefix-tuning over the frozen init_from weights: {length, projection,
                                        # hidden} (nn/prefix.py); one of lora, prefix, prompt
    prompt: dict[str, Any] | None = None  # prompt tuning over the frozen init_from weights: {length, init}
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float | None = None  # ε_ls; default 0.1 (§5.4) for translate, 0 for the other tasks
    clip_norm: float = 0.0              # gradient norm clipping (0: off)
    valid_every: int = 0                # validate every N updates (0: at the end of each epoch)
    valid_bleu: bool = True             # translate: also decode the validation set and compute BLEU
    valid_bleu_sentences: int = 0       # decode at most this many validation sentences (0: all)
    early_stop_metric: str | None = None  # "bleu", "accuracy", "exact_match" (higher is better) or "loss";
                                          # default by task: bleu (translate), accuracy (classify), exact_match
                                          # (transcribe), loss (lm, mlm)
    patience: int = 0                   # stop after this many validations without improvement (0: off)
    keep_last: int = 5                  # checkpoints kept (the best model is kept apart)
    log_every: int = 50                 # updates between log lines
    device: str = "auto"                # "auto", "cpu", "cuda", "cuda:1", ...
    bf16: bool = False                  # bf16 autocast (GPUs; on CPUs bf16 is far slower than fp32)
    threads: int = 0                    # torch intra-op threads (0: torch's default)
    distributed: str = "ddp"            # under torchrun: "ddp" (each process holds the whole model) or "fsdp"
                                        # (FSDP2: each holds 1/world of the weights, gradients, Adam moments)
    activation_checkpointing: bool = False  # keep each block's input only; its activations are computed
                                        # again in backward (less memory, more time: docs/scale_out.md)
    progress: bool = True               # a progress bar on stderr
    tensorboard: bool = True            # TensorBoard event files in OUT/tensorboard


@dataclass
class TrainConfig:
    task: str = "translate"             # "translate", "lm" (GPT), "mlm" (BERT's masking), "classify"
    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    @property
    def label_smoothing(self) -> float:
        ls = self.train.label_smoothing
        return ls if ls is not None else TASKS[self.task].label_smoothing

    @property
    def early_stop_metric(self) -> str:
        return self.train.early_stop_metric or TASKS[self.task].metric

    def model_config(self, vocab_size: int, tgt_vocab_size: int | None, task_values: dict[str, Any] | None = None,
                     start: ModelConfig | None = None) -> ModelConfig:
        """The run's model: the model section's over these vocabularies, or train.init_from's (``start``) re-headed."""
        task_values = task_values or {}  # what the data decides (a classifier's labels)
        if start is None:
            return self._new_model(vocab_size, tgt_vocab_size, task_values)
        return self._started_model(start, task_values)

    def _new_model(self, vocab_size: int, tgt_vocab_size: int | None, task_values: dict[str, Any]) -> ModelConfig:
        """A new model: the model section over the task's preset (or its input kind's), with what the
        task adds to a model of its arch (``TaskSpec.model_defaults``)."""
        values = {**self.model, **task_values}
        preset = values.pop("preset", None if self.train.init_from else self._default_preset(values))
        base = PRESETS.get(preset, {})
        kind = input_kind_named(values.get("inputs", base.get("inputs")))  # the section's, else its preset's
        tokens = kind is None or kind.tokens
        arch = values.get("arch", base.get("arch", "encoder-decoder") if preset in PRESETS else None)
        for key, value in TASKS[self.task].model_defaults.get(arch, {}).items():
            values.setdefault(key, value)
        values["vocab_size"] = vocab_size if tokens else 0  # images, sounds: no vocabulary
        if not tokens and arch in TWO_STACKS:  # the decoder's vocabulary is the run's only one
            tgt_vocab_size = tgt_vocab_size or vocab_size
        if tgt_vocab_size is not None and tgt_vocab_size != values["vocab_size"]:
            values["tgt_vocab_size"] = tgt_vocab_size
            values.setdefault("share_embeddings", False)
        if preset is None:
            return ModelConfig.from_dict(values, source=None)
        return ModelConfig.preset(preset, **values)

    def _default_preset(self, values: dict[str, Any]) -> str:
        """The preset of a model section that names none: its input kind's (images, sounds), else the task's."""
        named = input_kind_named(values.get("inputs"))
        return TASKS[self.task].preset if named is None or named.tokens else named.preset

    def _started_model(self, start: ModelConfig, task_values: dict[str, Any]) -> ModelConfig:
        """A model started from train.init_from (``start``): its shape and vocabularies (its
        tokenizer's), with the dropout and the head the config and the task ask for."""
        values = start.to_dict()
        where = f"train.init_from {self.train.init_from}"
        if self.model:
            self._check_started_shape(start, task_values, where)
        values.update({key: value for key, value in self.model.items() if key in INIT_FROM_KEYS})
        spec = TASKS[self.task]
        if "num_labels" not in spec.stand_in:  # a task whose data decides no labels: no classification head
            values.update(num_labels=0, labels=None)
        for key, value in spec.model_defaults.get(start.arch, {}).items():
            if key not in self.model:
                values[key] = value
        values.update(task_values)
        try:
            model_cfg = ModelConfig.from_dict(values, source=None)
        except AtencionError as err:
            raise AtencionError(f"{where}: {err}") from None
        check_task_model(self, model_cfg, where)
        return model_cfg

    def _check_started_shape(self, start: ModelConfig, task_values: dict[str, Any], where: str) -> None:
        """The config's model must be the one it starts from, but for dropout and the head."""
        values = start.to_dict()
        try:  # completed as config.json is (e.g. a partial moe mapping with its defaults)
            given = (ModelConfig.from_dict({**values, **self.model}, source=None) if "preset" not in self.model
                     else self.model_config(start.vocab_size, start.tgt_vocab_size, task_values))
        except AtencionError as err:
            raise AtencionError(f"{where}: model.{err}") from None
        for key, value in given.to_dict().items():
            if key not in INIT_FROM_KEYS | {"num_labels", "labels", "task"} and value != values[key]:
                raise AtencionError(f"model.{key} is {value!r} in the config but {values[key]!r} in {where}; "
                                    f"a model started from train.init_from keeps its shape (the model section "
                                    f"may change {sorted(INIT_FROM_KEYS)})")

    def stand_in_values(self) -> dict[str, Any]:
        """What the task's data will decide about the model (``Task.model_values``), stood in for
        before the data is read: the task, and what its spec stands in (a classifier's two labels)."""
        return {"task": self.task, **TASKS[self.task].stand_in}

    def model_inputs(self) -> dict[str, Any] | None:
        """What the model this run trains reads (``ModelConfig.inputs``; None: tokens), known
        before its data: train.init_from's, or the model section's over its preset."""
        if self.train.init_from is not None:
            from ..fileio import need_dir
            from ..nn.model_dir import load_config as load_model_config

            return load_model_config(need_dir(self.train.init_from, "train.init_from")).inputs
        return self.model_config(self.data.vocab_size, None, self.stand_in_values()).inputs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {"data": DataConfig, "train": OptimConfig, "decode": DecodeConfig}
# Choices spelled yes and no beside other words ("auto"), which YAML 1.1 reads as true and false.
YES_NO = {"data.header"}
# What a model started from train.init_from may change (regularisation and the new head); any
# other model key the config gives must agree with the model it starts from.
INIT_FROM_KEYS = {"dropout", "attention_dropout", "pooling"}
ADAPTER_KEYS = ("lora", "prefix", "prompt")  # the ways train adapts a frozen train.init_from (one at a time)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or start from the defaults) and apply ``key=value`` overrides."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        raw, source = _read_config(path), str(path)
    for item in overrides:
        _override(raw, item, source)
    return _build(raw, source)


def _read_config(path: Path) -> dict[str, Any]:
    """The mapping a YAML config file holds; a file that is missing, not UTF-8, not YAML or not a
    mapping is refused in one line."""
    if path.is_dir():
        raise AtencionError(f"{path}: is a directory; expected a YAML config file")
    if not path.is_file():
        raise MissingFileError(f"{path}: config file not found")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise AtencionError(f"{path} line {line}: not valid UTF-8 (byte 0x{data[err.start]:02x})") from None
    raw = _yaml(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise AtencionError(f"{path}: expected a mapping with sections model/data/train/decode")
    return raw


def _override(raw: dict[str, Any], item: str, source: str) -> None:
    """Apply one ``--set`` override (``task=NAME`` or ``SECTION.KEY=VALUE``; ``model.moe.experts=4``
    inside a key's mapping) to the raw config."""
    key, sep, value = item.partition("=")
    if sep and key == "task":
        raw["task"] = _yaml(value, f"--set {item!r}")
        return
    if not sep or "." not in key:
        raise AtencionError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. train.max_steps=100")
    section, name = key.split(".", 1)
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
        raise AtencionError(f"{source}: section {section!r} must be a mapping")
    target = raw[section]
    if section in ("model", "train") and "." in name:  # inside a key's mapping: model.moe.experts=4
        outer, name = name.split(".", 1)
        if isinstance(target.get(outer), str):  # a kind by its bare name (inputs: patches): {kind: patches}
            target[outer] = {"kind": target[outer]}
        if not isinstance(target.get(outer), dict):
            target[outer] = {}
        target = target[outer]
    target[name] = _yaml(value, f"--set {item!r}")


def _yaml(text: str, where: str) -> Any:
    """``text`` parsed as YAML (safe loader); any failure is one line naming ``where``."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = f" line {err.problem_mark.line + 1}" if err.problem_mark is not None else ""
        raise AtencionError(f"{where}{mark}: not valid YAML ({err.problem or err.context})") from None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError, OverflowError) as err:
        # e.g. a date YAML reads as a timestamp but that does not exist (2020-13-45), deep nesting
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AtencionError(f"{where}: not valid YAML ({text})") from None


def _string_keys(mapping: dict, where: str) -> None:
    for key in mapping:
        if not isinstance(key, str):
            raise AtencionError(f"{where}: key {key!r} is not a name; expected SECTION: {{KEY: VALUE}}")


def _build(raw: dict[str, Any], source: str) -> TrainConfig:
    _string_keys(raw, source)
    unknown = sorted(set(raw) - {"task", "model", *SECTIONS})
    if unknown:
        raise AtencionError(f"{source}: unknown section(s) {unknown}; expected task, model, data, train, decode")
    task = raw.get("task", TrainConfig.task)
    if task not in TASKS:
        raise AtencionError(f"{source}: task must be one of {list(TASKS)}, got {task!r}")
    model = raw.get("model") or {}
    _check_model_section(TASKS[task], model, source)
    sections = {name: _section(name, cls, raw.get(name), source) for name, cls in SECTIONS.items()}
    cfg = TrainConfig(task=task, model=model, **sections)
    _validate(cfg, source)
    return cfg


def _check_model_section(spec: TaskSpec, model: Any, source: str) -> None:
    """The model section: a mapping of known model keys, or the one the task checks itself
    (``TaskSpec.check_model_section``: contrastive's towers)."""
    if not isinstance(model, dict):
        raise AtencionError(f"{source}: section 'model' must be a mapping")
    _string_keys(model, f"{source}: section 'model'")
    if not isinstance(model.get("preset", ""), str):
        raise AtencionError(f"{source}: model.preset must be a preset name, got {model['preset']!r}")
    if spec.check_model_section is not None:
        spec.check_model_section(model, source)
        return
    bad = sorted(set(model) - MODEL_KEYS)
    if bad:
        raise AtencionError(f"{source}: unknown key(s) model.{bad[0]}" + (f" (and {bad[1:]})" if bad[1:] else "")
                            + f"; known model keys: {sorted(MODEL_KEYS)}")


def _section(name: str, cls: type, values: Any, source: str) -> Any:
    """Section ``name`` (data, train, decode) of the raw config as its dataclass ``cls``: known keys,
    each value checked against its field's type."""
    values = values or {}
    if not isinstance(values, dict):
        raise AtencionError(f"{source}: section {name!r} must be a mapping")
    _string_keys(values, f"{source}: section {name!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in fields:
            raise AtencionError(f"{source}: unknown key {name}.{key}; known keys in {name}: {sorted(fields)}")
        if f"{name}.{key}" in YES_NO and isinstance(value, bool):  # YAML 1.1 reads yes and no as booleans
            value = "yes" if value else "no"
        values[key] = _coerce(f"{source}: {name}.{key}", value, fields[key])
    return cls(**values)


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    """Check ``value`` against the field's type: numbers (from numbers or numeric strings),
    booleans, strings (paths and choices), the Adam betas pair; ``None`` where the field allows it."""
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = str(f.type)
    if value is None and "None" in kind:
        return None
    if "dict" in kind:
        if not isinstance(value, dict):
            raise AtencionError(f"{key}: expected a mapping, got {value!r}")
        return value
    if isinstance(value, list) and "list" in kind:
        if not value or not all(isinstance(v, str) for v in value):
            raise AtencionError(f"{key}: expected a path or a non-empty list of paths, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            raise AtencionError(f"{key}: expected a list of {len(default)} numbers, got {value!r}")
        return tuple(_number(key, v, integer=False) for v in value)
    return _coerce_scalar(key, value, default, kind)


def _coerce_scalar(key: str, value: Any, default: Any, kind: str) -> Any:
    """A boolean, a number or a string, as the field's default and type (``kind``) say."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise AtencionError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int) or kind.startswith("int"):
        return _number(key, value, integer=True)
    if isinstance(default, float) or kind.startswith("float"):
        return _number(key, value, integer=False)
    if not isinstance(value, str):
        raise AtencionError(f"{key}: expected {'a path' if 'None' in kind else 'a string'}, got {value!r}")
    return value


# (key, lowest allowed, whether the lowest is allowed): every number the sections hold.
RANGES = {
    "data.max_len": (1, True), "data.vocab_size": (1, True), "data.character_coverage": (0.0, False),
    "train.seed": (0, True), "train.max_tokens": (1, True), "train.accum_steps": (1, True),
    "train.max_steps": (0, True), "train.max_epochs": (1, True), "train.time_limit_minutes": (0.0, True),
    "train.lr_factor": (0.0, False), "train.lr_peak": (0.0, False), "train.warmup": (1, True),
    "train.adam_eps": (0.0, False), "train.weight_decay": (0.0, True), "train.label_smoothing": (0.0, True),
    "train.clip_norm": (0.0, True), "train.valid_every": (0, True), "train.valid_bleu_sentences": (0, True),
    "train.patience": (0, True), "train.keep_last": (1, True), "train.log_every": (1, True),
    "train.threads": (0, True), "train.lr_min": (0.0, True), "data.block_size": (1, True),
    "data.valid_fraction": (0.0, False), "data.mask_probability": (0.0, False), "decode.beam": (1, True),
    "decode.alpha": (0.0, True), "data.shift": (0, True), "data.rotate": (0.0, True),
    "decode.max_len_a": (0.0, True), "decode.max_len_b": (0, True), "decode.batch_tokens": (1, True),
}


def _validate(cfg: TrainConfig, source: str) -> None:
    """Refuse, in one line naming ``source``, a config that cannot train: each check in turn, then
    the task's own (``TaskSpec.check_config``) and the model the config describes."""
    for check in (_check_choices, _check_ranges, _check_settings, _check_vocabularies, _check_data_keys,
                  _check_adapters):
        check(cfg, source)
    spec = TASKS[cfg.task]
    if spec.check_config is not None:
        spec.check_config(cfg, source)
    if spec.check_model_section is None and cfg.train.init_from is None:
        # (a model of train.init_from is checked against the model section when it is read)
        _check_model(cfg, source)


def _check_choices(cfg: TrainConfig, source: str) -> None:
    d, t = cfg.data, cfg.train
    choices = [("data.empty_lines", d.empty_lines, ("skip", "error")),
               ("data.model_type", d.model_type, ("bpe", "unigram")),
               ("data.header", d.header, ("auto", "yes", "no")),
               ("data.tokenizer", d.tokenizer, ("sentencepiece", "subword-nmt", "char", "whitespace")),
               ("train.early_stop_metric", cfg.early_stop_metric,
                tuple(dict.fromkeys(m for spec in TASKS.values() for m in ("loss", *spec.metrics)))),
               ("train.schedule", t.schedule, ("inverse_sqrt", "cosine", "constant")),
               ("train.optimizer", t.optimizer, ("adam", "adamw")),
               ("train.distributed", t.distributed, ("ddp", "fsdp"))]
    for key, value, allowed in choices:
        if value not in allowed:
            raise AtencionError(f"{source}: {key} must be one of {list(allowed)}, got {value!r}")


def _check_ranges(cfg: TrainConfig, source: str) -> None:
    """Every number within its range: RANGES' lowest values, and the shares and Adam's betas below 1."""
    for key, (lowest, inclusive) in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and (value < lowest or (value == lowest and not inclusive)):
            bound = f">= {lowest}" if inclusive else f"> {lowest}"
            raise AtencionError(f"{source}: {key} must be {bound}, got {value}")
    d, t = cfg.data, cfg.train
    upper = [("data.character_coverage", d.character_coverage, 1.0, True),
             ("train.label_smoothing", cfg.label_smoothing, 1.0, False),
             ("data.valid_fraction", d.valid_fraction, 1.0, False),
             ("data.mask_probability", d.mask_probability, 1.0, False)]
    upper += [(f"train.adam_betas[{i}]", beta, 1.0, False) for i, beta in enumerate(t.adam_betas)]
    for key, value, highest, inclusive in upper:
        if value > highest or (value == highest and not inclusive) or value < 0:
            bound = f"in [0, {highest}]" if inclusive else f"in [0, {highest})"
            raise AtencionError(f"{source}: {key} must be {bound}, got {value}")


def _check_settings(cfg: TrainConfig, source: str) -> None:
    """The device, the metric early stopping watches (one the task measures), the schedule's end."""
    t = cfg.train
    if not (t.device == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?|mps", t.device)):
        raise AtencionError(f"{source}: train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}")
    if cfg.early_stop_metric not in ("loss", *TASKS[cfg.task].metrics):
        raise AtencionError(f"{source}: train.early_stop_metric {cfg.early_stop_metric!r} is not measured by "
                            f"task {cfg.task!r}; use {TASKS[cfg.task].metric!r}")
    if t.schedule == "cosine" and not t.max_steps:
        raise AtencionError(f"{source}: train.schedule cosine decays to train.lr_min at train.max_steps; "
                            f"set train.max_steps")


def _check_vocabularies(cfg: TrainConfig, source: str) -> None:
    """Shared embeddings and subword-nmt need one joint vocabulary."""
    d = cfg.data
    if not d.joint and cfg.model.get("share_embeddings") is True:
        raise AtencionError(f"{source}: model.share_embeddings: true needs data.joint: true (one vocabulary)")
    if d.tokenizer == "subword-nmt" and not d.joint:
        raise AtencionError(f"{source}: data.tokenizer: subword-nmt learns one joint vocabulary; set data.joint: true")


# data keys refused in words of their own when the task does not read them (the others: "is for task ...")
UNREAD = {key: f"data.{key} {does} the images a classifier trains on; task {{task!r}} reads none: set data.{key}: 0"
          for key, does in (("shift", "moves"), ("rotate", "turns"))}


def _check_data_keys(cfg: TrainConfig, source: str) -> None:
    """Refuse a data key that the task does not read (``TaskSpec.data_keys``) given a value other
    than its default, naming the tasks that read it. (A key at its default is not refused: a run's
    config.yaml, written whole, trains again.)"""
    readers = TASKS[cfg.task].data_keys
    defaults = DataConfig()
    for f in dataclasses.fields(DataConfig):
        key = f.name
        if key in readers or getattr(cfg.data, key) == getattr(defaults, key):
            continue
        if key in UNREAD:
            raise AtencionError(f"{source}: " + UNREAD[key].format(task=cfg.task))
        tasks = [name for name, spec in TASKS.items() if key in spec.data_keys]
        named = f"task{'s' if len(tasks) > 1 else ''} {_and(tasks)}" if tasks else "no task"
        raise AtencionError(f"{source}: data.{key} is for {named}; task {cfg.task!r} does not read it: leave it out")


def _and(names: list[str]) -> str:
    """``names`` in words: "lm", "lm and mlm", "translate, classify and transcribe"."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def _check_adapters(cfg: TrainConfig, source: str) -> None:
    """train.lora, train.prefix, train.prompt: one at most, well formed, over train.init_from, under ddp."""
    t = cfg.train
    adapters = [key for key in ADAPTER_KEYS if getattr(t, key) is not None]
    if len(adapters) > 1:
        raise AtencionError(f"{source}: train.{adapters[0]} and train.{adapters[1]} are given; a run adapts a "
                            f"model one way: keep one of train.lora, train.prefix, train.prompt")
    for key in adapters:
        try:
            LoraSpec.from_config(t.lora) if key == "lora" else spec_from_config(key, getattr(t, key))
        except AtencionError as err:
            raise AtencionError(f"{source}: {err}") from None
        if t.init_from is None:
            raise AtencionError(f"{source}: train.{key} adapts a trained model: set train.init_from to it")
        if t.distributed == "fsdp":
            raise AtencionError(f"{source}: train.{key} trains under train.distributed ddp only (its adapters are "
                                f"small: sharding them saves little)")


def _check_model(cfg: TrainConfig, source: str) -> None:
    """The model section, checked now with a stand-in vocabulary: before anything is written."""
    d = cfg.data
    try:
        built = cfg.model_config(d.vocab_size, None if d.joint else d.vocab_size, cfg.stand_in_values())
    except AtencionError as err:
        raise AtencionError(f"{source}: model.{err}") from None
    check_task_model(cfg, built, source)
    check_model_fits(cfg, built, source, vocabulary=False)  # again with the tokenizer's, before the model is built
    if cfg.train.activation_checkpointing and built.arch == "rnn":
        raise AtencionError(f"{source}: train.activation_checkpointing recomputes Transformer blocks; arch rnn has "
                            f"none")


def check_model_fits(cfg: TrainConfig, model: ModelConfig, source: str | None, vocabulary: bool = True) -> None:
    """Refuse, in one line with the figures (after ``source``, if any) and before anything is built,
    a model that cannot be built in this machine's memory (every model is built on the CPU first)
    or trained on the run's device (its weights, gradients and Adam's two moments). Without
    ``vocabulary`` its token tables are left out: before the tokenizer is trained, data.vocab_size
    is the most it may hold, not what it holds (a corpus of 40 symbols gives 40 whatever it says)."""
    without = () if vocabulary else ("vocabulary",)
    try:
        memory, where = _training_memory(cfg.train)
        check_memory(model, TRAIN_BYTES, memory, "to train: weights, gradients, Adam's two moments", where, without)
        check_memory(model, LOAD_BYTES, machine_memory(), "to build", without=without)
    except AtencionError as err:
        raise AtencionError(f"{source}: {err}" if source else str(err)) from None


def _training_memory(t) -> tuple[int | None, str]:
    """The bytes the run trains in, and where they are: the GPU's (under train.distributed fsdp,
    all the processes' GPUs together: each holds a share), else this machine's."""
    import torch

    device = t.device if t.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return machine_memory(), "this machine"
    index = int(device.partition(":")[2] or os.environ.get("LOCAL_RANK", "0"))
    try:
        memory = torch.cuda.get_device_properties(min(index, torch.cuda.device_count() - 1)).total_memory
    except (RuntimeError, AssertionError):
        return None, "the GPU"  # resolve_device names what is wrong with the device
    world = int(os.environ.get("WORLD_SIZE", "1")) if t.distributed == "fsdp" else 1
    return memory * world, f"the GPU ({device})" if world == 1 else f"the {world} GPUs"


def check_task_model(cfg: TrainConfig, model: ModelConfig, source: str, virtual: int = 0) -> None:
    """The model must be one the task can train: its arch, and positions long enough for the data
    (and for the ``virtual`` places before it: train.prefix, train.prompt)."""
    spec = TASKS[cfg.task]
    archs = spec.archs
    if model.arch not in archs:
        raise AtencionError(f"{source}: model.arch {model.arch!r} cannot be trained by task {cfg.task!r}, which "
                            f"takes arch {' or '.join(archs)} (the config's task: key chooses "
                            f"{', '.join(list(TASKS)[:-1])} or {list(TASKS)[-1]})")
    limit = position_limit(model)  # None: no table to run out of (relative kinds, sinusoids, an RNN)
    # an encoder of another kind: its length is its settings' (checked in ModelConfig); a decoder still writes tokens
    if limit is None or spec.longest is None or not (input_kind(model).tokens or model.arch in TWO_STACKS):
        return
    longest, key = spec.longest(cfg)  # the longest sequence its data gives
    if longest + virtual > limit:
        after = f" after the {virtual} virtual places of train.prefix or train.prompt" if virtual else ""
        raise AtencionError(f"{source}: {key} gives sequences of up to {longest} tokens{after} but the model's "
                            f"learned positions stop at model.max_positions={limit}")


def dump_config(cfg: TrainConfig) -> str:
    data = cfg.to_dict()
    data["train"]["adam_betas"] = list(data["train"]["adam_betas"])
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
