"""What every model of the family shares, whatever its architecture: the checks on token ids,
the parameter count, and the files (config.json + model.safetensors, or LoRA adapters over a
base), read back as the architecture the config names (``build_model``, ``load_model``)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_write, atomic_write_bytes, atomic_write_text
from .layers import rename_legacy
from .lora import ADAPTERS_FILE, KEYS, LORA_FILE, LoraSpec, apply_lora, check_base, read_lora_file, trainable_state

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def build_model(cfg: ModelConfig) -> "Model":
    """A freshly initialised model of the architecture ``cfg.arch`` names: the RNN
    encoder-decoder (nn/rnn.py) for ``rnn``, the Transformer (nn/transformer.py) for the others."""
    if not isinstance(cfg, ModelConfig):
        raise AtencionError(f"build_model(cfg): expected a ModelConfig, got {type(cfg).__name__}")
    if cfg.arch == "rnn":
        from .rnn import RNNSeq2Seq

        return RNNSeq2Seq(cfg)
    from .transformer import Transformer

    return Transformer(cfg)


def load_model(directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> "Model":
    """The model saved in ``directory``, of whatever architecture its config.json names."""
    return Model.load(directory, map_location)


class Model(nn.Module):
    """The base of the Transformer and the RNN encoder-decoder: ``cfg``, ``lora`` (LoRA
    adapters and the base they adapt, nn/lora.py) and what does not depend on the layers."""

    cfg: ModelConfig

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise AtencionError(f"{type(self).__name__}(cfg): expected a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.lora = None

    def padding_mask(self, ids: Tensor) -> Tensor:
        """(batch, 1, 1, length): True at real tokens, False at padding."""
        return (ids != self.cfg.pad_id)[:, None, None, :]

    # checks, sizes, files --------------------------------------------------------------------

    @staticmethod
    def _check_ids(name: str, ids: Tensor, vocab_size: int) -> None:
        if not isinstance(ids, Tensor):
            raise AtencionError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise AtencionError(f"{name} must hold integer token ids (torch.long), got dtype {ids.dtype}")
        if ids.dim() != 2 or ids.size(1) == 0 or ids.size(0) == 0:
            raise AtencionError(f"{name} must have shape (batch, length) with both > 0, got {tuple(ids.shape)}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise AtencionError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")

    def num_parameters(self) -> int:
        """Trainable parameters, each tied tensor counted once (as Table 3 counts them)."""
        return sum(p.numel() for p in self.parameters())

    def _canonical_names(self) -> dict[str, str]:
        """Every parameter/buffer name → the first name of the same tensor (tied weights share one)."""
        first: dict[int, str] = {}
        names = {}
        for name, tensor in self.state_dict(keep_vars=True).items():
            names[name] = first.setdefault(id(tensor), name)
        return names

    def start_from(self, other: "Model", where: str) -> list[str]:
        """Copy ``other``'s weights into this model of the same shape; only a classification head
        may be new (missing from ``other``, or of another size). Returns the new head's names."""
        own = self.state_dict()
        state = {name: value for name, value in other.state_dict().items()
                 if not name.startswith("classifier.") or (name in own and own[name].shape == value.shape)}
        missing, unexpected = self.load_state_dict(state, strict=False)
        new = [name for name in missing if not name.startswith("classifier.")]
        if new or unexpected:
            raise AtencionError(f"{where}: its weights do not fit the model; missing {new[:3]}, "
                                f"unexpected {unexpected[:3]}")
        return missing

    def save(self, directory: str | os.PathLike) -> None:
        """Write config.json and model.safetensors into ``directory`` (each atomically); a model
        with LoRA adapters writes adapters.safetensors and lora.json instead of its weights."""
        from safetensors.torch import save

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            self._save_adapters(directory)
            return
        state = self.state_dict()
        tensors = {name: state[name].detach().contiguous().cpu()
                   for name, canonical in self._canonical_names().items() if name == canonical}
        bad = non_finite(tensors)
        if bad:
            raise AtencionError(f"{directory}: not saved: {bad} (the model diverged)")
        atomic_write_bytes(directory / WEIGHTS_FILE, save(tensors))  # our write: a full disk is an OSError
        atomic_write(directory / CONFIG_FILE, self.cfg.save)

    @classmethod
    def load(cls, directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> "Model":
        """Rebuild a model saved by :meth:`save`, of the architecture its config names (called on
        a subclass, that class only); never unpickles anything."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not directory.is_dir():
            raise MissingFileError(f"{directory}: model directory not found")
        if (directory / LORA_FILE).is_file():
            return cls._load_adapted(directory, map_location)
        model = build_model(ModelConfig.load(directory / CONFIG_FILE))
        cls._check_class(model, directory)
        path = directory / WEIGHTS_FILE
        if not path.is_file():
            raise MissingFileError(f"{path}: model weights not found")
        try:
            tensors = rename_legacy(load_file(str(path), device=str(map_location)))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise AtencionError(f"{path}: not a readable safetensors file ({err})") from None
        canonical = model._canonical_names()
        expected = {name for name, first in canonical.items() if name == first}
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or unexpected:
            raise AtencionError(f"{path}: weights do not match {directory / CONFIG_FILE}; "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        state = model.state_dict()
        for name, first in canonical.items():
            if tuple(tensors[first].shape) != tuple(state[name].shape):
                raise AtencionError(f"{path}: tensor {first!r} has shape {tuple(tensors[first].shape)}, "
                                 f"the config expects {tuple(state[name].shape)}")
        bad = non_finite(tensors)
        if bad:
            raise AtencionError(f"{path}: {bad}; this model diverged in training and cannot be used "
                                f"(take an earlier checkpoint)")
        model.load_state_dict({name: tensors[first] for name, first in canonical.items()})
        return model

    def _save_adapters(self, directory: Path) -> None:
        from safetensors.torch import save

        info = self.lora
        tensors = trainable_state(self)
        bad = non_finite(tensors)
        if bad:
            raise AtencionError(f"{directory}: not saved: {bad} (the model diverged)")
        atomic_write_bytes(directory / ADAPTERS_FILE, save(tensors))
        record = {"base": info.base, "base_sha256": info.base_sha256, **asdict(info.spec), "modules": info.modules}
        atomic_write_text(directory / LORA_FILE, json.dumps(record, indent=2) + "\n")
        atomic_write(directory / CONFIG_FILE, self.cfg.save)

    @classmethod
    def _check_class(cls, model: "Model", directory: Path) -> None:
        if not isinstance(model, cls):
            raise AtencionError(f"{directory / CONFIG_FILE}: arch {model.cfg.arch!r} is a {type(model).__name__}, "
                                f"not a {cls.__name__}; load it with atencion.load")

    @classmethod
    def _load_adapted(cls, directory: Path, map_location) -> "Model":
        """A LoRA model: its base (checked against the recorded checksum), then the adapters."""
        from safetensors.torch import load_file

        record = read_lora_file(directory)
        spec = LoraSpec.from_config({key: record[key] for key in KEYS}, where=str(directory / LORA_FILE))
        base_dir = check_base(directory, record)
        if (base_dir / LORA_FILE).is_file():
            raise AtencionError(f"{directory / LORA_FILE}: its base {base_dir} is itself a LoRA model; "
                                f"a base must hold plain weights")
        model = build_model(ModelConfig.load(directory / CONFIG_FILE)).to(map_location)
        cls._check_class(model, directory)
        new = model.start_from(cls.load(base_dir, map_location), f"{directory / LORA_FILE}: base {base_dir}")
        names = apply_lora(model, spec, base_dir, record["base_sha256"], trainable=new)
        if names != record["modules"]:
            raise AtencionError(f"{directory / LORA_FILE}: its targets now select {names[:3]}…, "
                                f"not the layers it adapted {record['modules'][:3]}…")
        path = directory / ADAPTERS_FILE
        if not path.is_file():
            raise MissingFileError(f"{path}: LoRA adapters not found")
        try:
            tensors = load_file(str(path), device=str(map_location))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise AtencionError(f"{path}: not a readable safetensors file ({err})") from None
        expected = {name: p for name, p in model.named_parameters() if p.requires_grad}
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise AtencionError(f"{path}: adapters do not match {directory / LORA_FILE}; "
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
        return model


def non_finite(tensors: dict[str, Tensor]) -> str | None:
    """None if every floating-point tensor is finite, else which tensor holds NaN or inf values."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            return f"tensor {name!r} holds {count} non-finite value(s) (NaN or inf)"
    return None

