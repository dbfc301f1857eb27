"""A model directory, in one place: what its files are called, how a model is written into one
and read back, and which class each ``arch`` builds.

An atencion model directory holds:

    config.json                        the ModelConfig, with the arch and the task it was trained for
    model.safetensors                  the weights (tied tensors stored once)
    lora.json, adapters.safetensors    instead of the weights: LoRA adapters over a base directory,
                                       named by path and by the SHA-256 of its weights (nn/lora.py)
    prefix.json or prompt.json,        instead of the weights: prefix-tuning's or prompt tuning's virtual
    adapters.safetensors               tokens over a base directory, named alike (nn/prefix.py)
    the tokenizer's files              data/tokenizer.py (tokenizer.json and the subword models); none
                                       for a model without a vocabulary (a ViT reads images: ``has_vocabulary``)

Nothing is ever unpickled. ``save_model``/``load_model`` write and read the model
(``Model.save``/``Model.load`` call them), ``load_model_dir`` reads a model with its tokenizer,
checked against each other, as every command does, and ``save_model_dir`` writes both.

Seams for what comes next:
- a new architecture is a ``Model`` subclass (nn/model.py) decorated with
  ``@register_arch("name")``; ``build_model`` finds it in ``ARCHS``, and nn/__init__.py imports
  every architecture module so that the table is full whatever was imported first;
- ``directory_kind`` tells an atencion directory from a Hugging Face one (config.json with a
  ``model_type``) and from a directory of several towers (``towers.json``, as CLIP's image and
  text encoders); ``load_model`` reads all three (a towers directory through nn/towers.py's
  ``load_towers``), ``load_config`` the first two (a towers directory has one config per tower).
  A kind of directory another library writes is read by the module that knows that library's
  names (``READERS``: a Hugging Face directory by interop/hf_dir.py, which maps each family's
  tensors onto atencion's); that module sits above nn, so it is imported on first use, as
  config.py imports nn/positional.py.

A model is built with its parameters on the meta device (no memory, no initialisation) and
then given the tensors read from the file (``model_from_tensors``): no parameter is allocated
and initialised only to be overwritten, and a checkpoint keeps its stored dtype until
``load_model``'s ``dtype`` (float32 unless told otherwise) is applied.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from importlib import import_module
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import ModelConfig, human_bytes
from ..data.tokenizer import INFO_FILE, Tokenizer
from ..devices import resolve_device
from ..errors import AtencionError, MissingFileError
from ..fileio import (
    atomic_directory,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    json_line,
    need_dir,
    need_output_dir,
    read_json,
)
from .lora import KEYS, LoraSpec, apply_lora, merge_lora, trainable_state
from .prefix import SPECS, apply_virtual, spec_from_config, unmergeable
from .quantize import quantize_int8
from .towers import LOG_SCALE_MAX, Towers

# A model is an nn.Module here: nn/model.py imports this module (Model.save, Model.load).

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's table of tensor → shard (Hugging Face)
LORA_FILE, ADAPTERS_FILE = "lora.json", "adapters.safetensors"
VIRTUAL_FILES = {kind: f"{kind}.json" for kind in SPECS}  # prefix.json, prompt.json (nn/prefix.py)
TOWERS_FILE = "towers.json"

# arch → the Model subclass that builds it; filled by @register_arch on each class
ARCHS: dict[str, type] = {}


def register_arch(*names: str) -> Callable[[type], type]:
    """Class decorator: ``build_model`` builds this class for a config whose arch is one of ``names``."""
    def register(cls: type) -> type:
        for name in names:
            ARCHS[name] = cls
        return cls
    return register


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model of the architecture ``cfg.arch`` names (``ARCHS``)."""
    if not isinstance(cfg, ModelConfig):
        raise AtencionError(f"build_model(cfg): expected a ModelConfig, got {type(cfg).__name__}")
    if cfg.arch not in ARCHS:
        raise AtencionError(f"arch {cfg.arch!r}: no model class is registered for it; known: {sorted(ARCHS)}")
    return ARCHS[cfg.arch](cfg)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within: every parameter a module registers goes to the meta device (its initialisation
    costs nothing), while buffers (position tables, RoPE frequencies) are computed as usual.
    accelerate's ``init_empty_weights`` does the same."""
    register = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref, nn.Parameter]] = {}  # id of an original → (the original, its meta twin)

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # one registered twice (tied) gets the same twin
            seen = moved.get(id(param))
            if seen is None or seen[0]() is not param:  # an id may be reused once its original is gone
                seen = moved[id(param)] = (weakref.ref(param), nn.Parameter(param.to("meta"), param.requires_grad))
            param = seen[1]
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def check_size(cfg: ModelConfig, held: int, where: os.PathLike, config: os.PathLike) -> None:
    """Refuse, before the model is built, a config that describes far more parameters than the
    ``held`` bytes of its weights (``where``) can hold at one byte or more each (10^9 layers or a
    vocabulary of 10^12 would hang the build or fail its allocation; ``ModelConfig.memory_estimate``
    counts them without building anything): the two files come from different models, or one was
    edited."""
    needed = cfg.memory_estimate(1)  # parameters, at a byte each, and what is not a weight
    if needed > 2 * held + (64 << 20):  # room for buffers and the blocks' objects
        raise AtencionError(f"{config}: describes a model of about {cfg.parameter_estimate():.1e} parameters, but "
                            f"{where} holds {human_bytes(held)}; the files come from different models")


def model_from_tensors(cfg: ModelConfig, tensors: dict[str, Tensor], where: os.PathLike, config: os.PathLike,
                       expect: type | None = None) -> nn.Module:
    """The model of ``cfg`` holding ``tensors`` (one per parameter or saved buffer; tied
    parameters under their first name, or under each when the tensors are equal), in their dtype
    and on their device; the model is built without memory for its parameters
    (``_parameters_on_meta``), and ``tensors`` is emptied as it takes them, each freed once copied.
    ``where`` (the weights) and ``config`` name the files in messages: a missing or unexpected
    tensor, a shape the config does not give, a non-finite value. ``expect``: refuse, in one
    line, a model that is not of this class."""
    check_size(cfg, sum(t.numel() * t.element_size() for t in tensors.values()), where, config)
    with _parameters_on_meta():
        model = build_model(cfg)
    _check_class(model, config, expect)
    canonical = model._canonical_names()
    expected = {name for name, first in canonical.items() if name == first}
    twice = {name: canonical[name] for name in tensors if canonical.get(name, name) != name}  # tied, given again
    for name, first in twice.items():
        if first in tensors and tensors[name] is not tensors[first] and not torch.equal(tensors[name], tensors[first]):
            raise AtencionError(f"{where}: {name!r} and {first!r} are one tensor in this model (tied) but differ "
                                f"in the file")
    for name in twice:
        del tensors[name]
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise AtencionError(f"{where}: weights do not match {config}; missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
    state = model.state_dict()
    for name in expected:
        if tuple(tensors[name].shape) != tuple(state[name].shape):
            raise AtencionError(f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                f"the config expects {tuple(state[name].shape)}")
    bad = non_finite(tensors)
    if bad:
        raise AtencionError(f"{where}: {bad}; this model diverged in training and cannot be used "
                            f"(take an earlier checkpoint)")
    # each copied once into memory of its own: a tensor read from a file may be a view of its bytes (memory-mapped,
    # read-only) that lies off the alignment vectorised kernels expect, and they would sum in another order there
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # the rest: saved buffers
    owned = {}
    for name in sorted(expected):
        tensor = tensors.pop(name).clone(memory_format=torch.contiguous_format)
        owned[name] = nn.Parameter(tensor) if name in parameters else tensor  # a tied one is one Parameter
    model.load_state_dict({name: owned[first] for name, first in canonical.items()}, assign=True)
    return model


# which kind of directory ------------------------------------------------------------------------


def directory_kind(directory: str | os.PathLike) -> str:
    """"towers" (a towers.json naming several model directories), "huggingface" (a config.json
    with a ``model_type``, as transformers writes) or "atencion" (anything else: its own reader
    says what is wrong with it)."""
    directory = Path(directory)
    if (directory / TOWERS_FILE).is_file():
        return "towers"
    try:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return "atencion"
    return "huggingface" if isinstance(config, dict) and "model_type" in config else "atencion"


# kind → the module that reads it: ``read_config(directory)`` and ``read_model(directory)``
READERS = {"huggingface": "..interop.hf_dir"}


def _reader(directory: Path):
    """The module that reads ``directory``, if another library wrote it; None for an atencion
    directory. A directory of several towers is refused in one line."""
    kind = directory_kind(directory)
    if kind == "towers":
        raise AtencionError(f"{directory}: a directory of several towers ({TOWERS_FILE}), not one model: it has one "
                            f"config per tower; give one tower's directory")
    return import_module(READERS[kind], __package__) if kind in READERS else None


def load_config(directory: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of the model directory ``directory``, of any kind, without its weights."""
    directory = Path(directory)
    reader = _reader(directory)
    return reader.read_config(directory) if reader is not None else ModelConfig.load(directory / CONFIG_FILE)


# the model: config.json + model.safetensors, or LoRA adapters over a base -------------------------


def save_model(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write config.json and model.safetensors into ``directory`` (each atomically); a model with
    LoRA adapters writes adapters.safetensors and lora.json instead of its weights; towers
    (nn/towers.py) write towers.json and a model directory per tower."""
    from safetensors.torch import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(model, Towers):
        for name, tower in model.towers.items():
            save_model(tower, directory / name)
        atomic_write_text(directory / TOWERS_FILE, json.dumps(model.record(), indent=2) + "\n")
        return
    if model.lora is not None or model.virtual is not None:
        _save_adapters(model, directory)
        return
    state = model.state_dict()
    tensors = {name: state[name].detach().contiguous().cpu()
               for name, canonical in model._canonical_names().items() if name == canonical}
    bad = non_finite(tensors)
    if bad:
        raise AtencionError(f"{directory}: not saved: {bad} (the model diverged)")
    atomic_write_bytes(directory / WEIGHTS_FILE, save(tensors))  # our write: a full disk is an OSError
    atomic_write(directory / CONFIG_FILE, model.cfg.save)


def load_model(directory: str | os.PathLike, map_location: str | torch.device = "cpu",
               expect: type | None = None, dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """The model saved in ``directory`` by :func:`save_model`, of the architecture its config
    names, or the model of a Hugging Face directory, converted (``READERS``); ``expect``:
    refuse, in one line, one that is not of this class. ``dtype``: what its floating-point
    tensors become (None: as stored, e.g. a Hugging Face checkpoint's bfloat16)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not directory.is_dir():
        raise MissingFileError(f"{directory}: model directory not found")
    if directory_kind(directory) == "towers":
        model = load_towers(directory, map_location)
        if expect is not None and not isinstance(model, expect):
            raise AtencionError(f"{directory}: a directory of several towers ({TOWERS_FILE}), not a "
                                f"{expect.__name__}")
        return model.to(map_location, dtype) if dtype is not None else model
    reader = _reader(directory)
    if reader is not None:
        model = reader.read_model(directory)
        _check_class(model, directory / CONFIG_FILE, expect)
    elif (directory / LORA_FILE).is_file() or virtual_file(directory) is not None:
        model = _load_adapted(directory, map_location, expect)
    else:
        cfg = ModelConfig.load(directory / CONFIG_FILE)
        path = directory / WEIGHTS_FILE
        if not path.is_file():
            raise MissingFileError(f"{path}: model weights not found")
        try:
            tensors = rename_legacy(load_file(str(path), device=str(map_location)))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise AtencionError(f"{path}: not a readable safetensors file ({err})") from None
        model = model_from_tensors(cfg, tensors, path, directory / CONFIG_FILE, expect)
    return model.to(map_location, dtype) if dtype is not None else model.to(map_location)


def rename_legacy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Weights saved before the encoder's layers became Blocks named their self-attention's
    residual ``res_attn``; it is ``res_self`` now."""
    return {name.replace(".res_attn.", ".res_self."): value for name, value in state.items()}


def _check_class(model: nn.Module, where, expect: type | None) -> None:
    if expect is not None and not isinstance(model, expect):
        raise AtencionError(f"{where}: arch {model.cfg.arch!r} is a {type(model).__name__}, "
                            f"not a {expect.__name__}; load it with atencion.load")


def virtual_file(directory: Path) -> Path | None:
    """The prefix.json or prompt.json of a directory of virtual tokens (nn/prefix.py), or None."""
    return next((directory / name for name in VIRTUAL_FILES.values() if (directory / name).is_file()), None)


def _save_adapters(model: nn.Module, directory: Path) -> None:
    """LoRA's adapters and lora.json, or the virtual tokens and prefix.json or prompt.json (with a
    new head, as trainable_state gives it)."""
    from safetensors.torch import save

    info = model.lora or model.virtual
    tensors = trainable_state(model)
    bad = non_finite(tensors)
    if bad:
        raise AtencionError(f"{directory}: not saved: {bad} (the model diverged)")
    atomic_write_bytes(directory / ADAPTERS_FILE, save(tensors))
    record = {"base": info.base, "base_sha256": info.base_sha256, **asdict(info.spec)}
    if model.lora is not None:
        record["modules"] = info.modules
    name = LORA_FILE if model.lora is not None else VIRTUAL_FILES[info.spec.kind]
    atomic_write_text(directory / name, json.dumps(record, indent=2) + "\n")
    atomic_write(directory / CONFIG_FILE, model.cfg.save)


def _load_adapted(directory: Path, map_location, expect: type | None) -> nn.Module:
    """A LoRA model or one of virtual tokens: its base (checked against the recorded checksum),
    then the adapters."""
    lora = (directory / LORA_FILE).is_file()
    description = directory / LORA_FILE if lora else virtual_file(directory)
    record = read_lora_file(directory) if lora else _read_virtual_file(description)
    base_dir = check_base(description, record)
    if (base_dir / LORA_FILE).is_file() or virtual_file(base_dir) is not None:
        raise AtencionError(f"{description}: its base {base_dir} is itself an adapted model (LoRA, prefix or "
                            f"prompt); a base must hold plain weights")
    model = build_model(ModelConfig.load(directory / CONFIG_FILE)).to(map_location)
    _check_class(model, directory / CONFIG_FILE, expect)
    new = model.start_from(load_model(base_dir, map_location, expect), f"{description}: base {base_dir}")
    if lora:
        spec = LoraSpec.from_config({key: record[key] for key in KEYS}, where=str(description))
        names = apply_lora(model, spec, base_dir, record["base_sha256"], trainable=new)
        if names != record["modules"]:
            raise AtencionError(f"{description}: its targets now select {names[:3]}…, "
                                f"not the layers it adapted {record['modules'][:3]}…")
    else:
        kind = description.stem
        spec = spec_from_config(kind, {key: value for key, value in record.items() if key not in BASE_KEYS},
                                where=str(description))
        try:
            apply_virtual(model, spec, base_dir, record["base_sha256"], trainable=new)
        except AtencionError as err:
            raise AtencionError(f"{description}: {err}") from None
    _load_adapters(model, directory / ADAPTERS_FILE, description, map_location)
    return model


def _load_adapters(model: nn.Module, path: Path, description: Path, map_location) -> None:
    """Copy the adapters saved in ``path`` into the trainable parameters of ``model``, checked first."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise MissingFileError(f"{path}: adapters not found ({description.name} names them)")
    try:
        tensors = load_file(str(path), device=str(map_location))
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise AtencionError(f"{path}: not a readable safetensors file ({err})") from None
    expected = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise AtencionError(f"{path}: adapters do not match {description}; "
                            f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise AtencionError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                f"expected {tuple(expected[name].shape)}")
    bad = non_finite(tensors)
    if bad:
        raise AtencionError(f"{path}: {bad}; these adapters diverged in training and cannot be used")
    with torch.no_grad():
        for name, tensor in tensors.items():
            expected[name].copy_(tensor)


def non_finite(tensors: dict[str, Tensor]) -> str | None:
    """None if every floating-point tensor is finite, else which tensor holds NaN or inf values."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            return f"tensor {name!r} holds {count} non-finite value(s) (NaN or inf)"
    return None


# LoRA's base, named by lora.json ------------------------------------------------------------------


def weights_files(directory: str | os.PathLike) -> list[Path]:
    """The files that hold a directory's weights: model.safetensors, or the shards that a sharded
    Hugging Face checkpoint's model.safetensors.index.json names, each there (a missing one is
    named)."""
    directory = Path(directory)
    if (directory / WEIGHTS_FILE).is_file() or not (directory / INDEX_FILE).is_file():
        if not (directory / WEIGHTS_FILE).is_file():
            raise MissingFileError(f"{directory / WEIGHTS_FILE}: model weights not found (nor {INDEX_FILE})")
        return [directory / WEIGHTS_FILE]
    index = read_json(directory / INDEX_FILE, "sharded checkpoint index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise AtencionError(f"{directory / INDEX_FILE}: its \"weight_map\" must map each tensor to a shard file")
    shards = [directory / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if shard.parent != directory or not shard.is_file():
            raise MissingFileError(f"{shard}: shard not found ({directory / INDEX_FILE} names it)")
    return shards


def weights_checksum(directory: str | os.PathLike) -> str:
    """SHA-256 of a model directory's weights: model.safetensors, or its shards in order."""
    digest = hashlib.sha256()
    for path in weights_files(directory):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def read_lora_file(directory: Path) -> dict:
    """lora.json of ``directory``, with every key it must hold, of the right types."""
    record = read_json(directory / LORA_FILE, "LoRA description")
    for key in ("base", "base_sha256", "modules", *KEYS):
        if key not in record:
            raise AtencionError(f"{directory / LORA_FILE}: missing the key {key!r}")
    for key, kind in (("base", str), ("base_sha256", str), ("modules", list)):
        if not isinstance(record[key], kind):
            raise AtencionError(f"{directory / LORA_FILE}: {key!r} must be a {kind.__name__}, got {record[key]!r}")
    return record


BASE_KEYS = ("base", "base_sha256")  # what an adapter's description holds beside its spec


def _read_virtual_file(path: Path) -> dict:
    """prefix.json or prompt.json, with the base's keys of the right types."""
    record = read_json(path, "virtual tokens' description")
    if not isinstance(record, dict):
        raise AtencionError(f"{path}: expected a JSON object with {list(BASE_KEYS)} and the spec's keys")
    for key in BASE_KEYS:
        if not isinstance(record.get(key), str):
            raise AtencionError(f"{path}: {key!r} must be a str, got {record.get(key)!r}")
    return record


def check_base(description: Path, record: dict) -> Path:
    """The base model directory that ``record`` (read from ``description``: lora.json,
    prefix.json, prompt.json) names, present and with the weights the adapters were trained on."""
    base = Path(record["base"])
    try:
        weights_files(base)
    except MissingFileError:
        raise MissingFileError(f"{description}: its base model {base} is missing (no {WEIGHTS_FILE}); "
                               f"put the base back there, or give its new place as \"base\" in "
                               f"{description.name}") from None
    if weights_checksum(base) != record["base_sha256"]:
        raise AtencionError(f"{description}: the base model {base} has changed since these adapters "
                            f"were trained (SHA-256 of {WEIGHTS_FILE} differs); the adapters fit only the "
                            f"original weights")
    return base


# the model with its tokenizer ---------------------------------------------------------------------


def has_vocabulary(cfg: ModelConfig) -> bool:
    """Whether a model reads or writes tokens, and so has a tokenizer: every model but an encoder
    of another kind of input (a ViT's images) with no decoder (``vocab_size`` 0 and no target's)."""
    return bool(cfg.vocab_size or cfg.target_vocab_size)


def load_model_dir(path: str | os.PathLike, device: str = "cpu", int8: bool = False,
                   what: str = "--model", merge: bool = True,
                   dtype: torch.dtype | None = torch.float32,
                   towers: bool = False) -> tuple[nn.Module, Tokenizer | None]:
    """The model (in eval mode) and tokenizer of the model directory ``path``, atencion's or
    Hugging Face's (converted); ``what`` names the option it came from in messages. The
    tokenizer's vocabularies must be the model's; a model without a vocabulary (``has_vocabulary``)
    has no tokenizer: None. The LoRA adapters of an adapted model are folded into its weights
    unless ``merge`` is False. ``dtype``: that of the model's tensors (None: as stored). A towers
    directory (nn/towers.py) is read only when ``towers`` (its ``Towers``, no tokenizer), and
    otherwise refused in one line: the commands of one model cannot use it."""
    path = need_dir(path, what)
    if directory_kind(path) == "towers" and not towers:
        raise AtencionError(f"{what} {path}: a directory of several towers ({TOWERS_FILE}, task contrastive); "
                            f"this command takes one model: score towers with atencion evaluate")
    tokenizer_files = any((path / name).is_file() for name in (INFO_FILE, "source.spm"))
    if directory_kind(path) == "huggingface" and not tokenizer_files and has_vocabulary(load_config(path)):
        raise MissingFileError(f"{path / INFO_FILE}: not found; a Hugging Face model directory needs its tokenizer "
                               f"(tokenizer.json, or Marian's source.spm, target.spm and vocab.json)")
    model = load_model(path, map_location=resolve_device(device), dtype=dtype).eval()
    if merge:
        merge_lora(model)
    if directory_kind(path) == "towers":  # towers of images and sounds: no vocabulary (nn/towers.py)
        return model, None
    if not has_vocabulary(model.cfg):
        return (quantize_int8(model) if int8 else model), None
    tokenizer = Tokenizer.load(path)
    check_vocabularies(path, model, tokenizer)
    if int8:
        model = quantize_int8(model)
    return model, tokenizer


def save_model_dir(directory: str | os.PathLike, model: nn.Module, tokenizer: Tokenizer | None) -> None:
    """Write the model and its tokenizer (None for a model without a vocabulary) into
    ``directory``, atomically (the files go to a temporary directory renamed to ``directory``
    when complete): what ``load_model_dir`` reads."""
    def fill(tmp: Path) -> None:
        save_model(model, tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)

    atomic_directory(directory, fill)


def merge_lora_dir(model: str | os.PathLike, out: str | os.PathLike) -> int:
    """Fold the LoRA adapters of the model directory ``model`` into its base weights and write a
    plain model directory ``out`` (new or empty); returns its parameter count."""
    model_dir = need_dir(model, "--model")
    if virtual_file(model_dir) is not None:
        raise unmergeable(f"--model {model_dir}", virtual_file(model_dir).stem)
    if not (model_dir / LORA_FILE).is_file():
        raise AtencionError(f"--model {model_dir}: has no {LORA_FILE}, so it holds no LoRA adapters to merge")
    out = need_output_dir(out, "--out")
    merged, tokenizer = load_model_dir(model_dir)  # adapters folded in
    save_model_dir(out, merged, tokenizer)
    return merged.num_parameters()


def import_dir(model: str | os.PathLike, out: str | os.PathLike) -> dict:
    """`atencion import`: convert the Hugging Face model directory ``model`` once into an atencion
    model directory ``out`` (new or empty): config.json, model.safetensors under atencion's names
    in the stored dtype, and the tokenizer's files as they were. Returns what was written."""
    model_dir = need_dir(model, "DIR")
    if directory_kind(model_dir) != "huggingface":
        raise AtencionError(f"{model_dir}: not a Hugging Face model directory (its {CONFIG_FILE} has no "
                            f"model_type); an atencion directory needs no import")
    out = need_output_dir(out, "--out")
    converted, tokenizer = load_model_dir(model_dir, what="DIR", dtype=None)
    save_model_dir(out, converted, tokenizer)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in converted.parameters()})
    return {"imported": str(model_dir), "out": str(out), "arch": converted.cfg.arch, "task": converted.cfg.task,
            "parameters": converted.num_parameters(), "dtype": "/".join(dtypes)}


def check_vocabularies(path: Path, model: nn.Module, tokenizer: Tokenizer) -> None:
    """The tokenizer's vocabularies must be the sizes the model's config gives; one of another
    library (``Tokenizer.foreign``) must fit in them (Hugging Face's models often round their
    embedding tables up). An encoder of another input kind (recordings) reads no tokens: only the
    decoder's vocabulary is checked, when there is a decoder."""
    cfg = model.cfg
    sides = (("source", tokenizer.src_vocab_size, "vocab_size", cfg.vocab_size),
             ("target", tokenizer.tgt_vocab_size, "tgt_vocab_size", cfg.target_vocab_size))
    if cfg.vocab_size == 0:  # model.inputs other than tokens (nn/inputs.py)
        sides = sides[1:] if cfg.tgt_vocab_size else ()
    for side, pieces, key, size in sides:
        if tokenizer.foreign and pieces > size:
            raise AtencionError(f"{path}: the {side} tokenizer has {pieces} tokens but the model's {key} is "
                                f"{size}; the files come from different models")
        if not tokenizer.foreign and pieces != size:
            shown = key if key == "vocab_size" or cfg.tgt_vocab_size is not None else "vocab_size"
            raise AtencionError(f"{path / INFO_FILE}: the {side} tokenizer has {pieces} pieces but "
                                f"{path / CONFIG_FILE} line {json_line(path / CONFIG_FILE, shown)} gives the "
                                f"model {size}; the files come from different runs")


# a directory of several towers (CLIP: nn/towers.py) ------------------------------------------


def save_towers(model: Towers, directory: str | os.PathLike) -> None:
    """Write the towers directory ``directory`` atomically: towers.json and each tower's model
    directory (nn/towers.py)."""
    atomic_directory(directory, lambda tmp: save_model(model, tmp))


def read_towers_file(directory: Path) -> dict:
    """towers.json of ``directory``, checked: any fault is one line naming the file."""
    path = directory / TOWERS_FILE
    expected = ('expected {"task": NAME, "towers": [two or more directory names], "projection": WIDTH, '
                '"log_scale": NUMBER}')
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MissingFileError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise AtencionError(f"{path}: not readable JSON ({str(err).splitlines()[0]}); {expected}") from None
    if not isinstance(record, dict) or set(record) != {"task", "towers", "projection", "log_scale"}:
        raise AtencionError(f"{path}: {expected}")
    names, width, scale = record["towers"], record["projection"], record["log_scale"]
    if not (isinstance(names, list) and len(names) >= 2 and len(set(names)) == len(names)
            and all(isinstance(n, str) and n and n == Path(n).name and not n.startswith(".") for n in names)):
        raise AtencionError(f"{path}: towers must list two or more distinct directory names, got {names!r}")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise AtencionError(f"{path}: projection must be a positive integer, got {width!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) \
            or scale > LOG_SCALE_MAX + 1e-6:
        raise AtencionError(f"{path}: log_scale must be a finite number at most log 100, got {scale!r}")
    if not isinstance(record["task"], str):
        raise AtencionError(f"{path}: task must be a task's name, got {record['task']!r}")
    return record


def load_towers(directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> Towers:
    """The towers saved by ``save_towers`` in ``directory``; each tower must project to the
    width towers.json gives."""
    directory = Path(directory)
    record = read_towers_file(directory)
    towers = {}
    for name in record["towers"]:
        tower = load_model(directory / name, map_location)
        if tower.cfg.num_labels != record["projection"] or tower.cfg.arch != "encoder":
            raise AtencionError(f"{directory / name / 'config.json'}: expected an encoder projecting to "
                                f"{record['projection']} (towers.json), got arch {tower.cfg.arch!r} with "
                                f"num_labels {tower.cfg.num_labels}")
        towers[name] = tower
    return Towers(towers, record["log_scale"], record["task"]).to(map_location)
