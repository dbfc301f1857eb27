"""What every model of the family shares, whatever its architecture: the checks on token ids,
the parameter count, starting from another model's weights, and the files, which model_dir.py
writes and reads (``save``, ``load``)."""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..errors import AtencionError
from .model_dir import load_model, save_model


class Model(nn.Module):
    """The base of the Transformer and the RNN encoder-decoder: ``cfg``, ``lora`` (LoRA
    adapters and the base they adapt, nn/lora.py), ``virtual`` (prefix-tuning's or prompt
    tuning's, nn/prefix.py) and what does not depend on the layers."""

    cfg: ModelConfig

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise AtencionError(f"{type(self).__name__}(cfg): expected a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.lora = None
        self.virtual = None  # prefix-tuning's or prompt tuning's virtual tokens and their base (nn/prefix.py)

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
        for name, value in state.items():  # load_state_dict would raise a RuntimeError listing every one
            if name in own and own[name].shape != value.shape:
                raise AtencionError(f"{where}: its weights do not fit the model; {name} is "
                                    f"{tuple(value.shape)} there, {tuple(own[name].shape)} in this model's config")
        missing, unexpected = self.load_state_dict(state, strict=False)
        new = [name for name in missing if not name.startswith("classifier.")]
        if new or unexpected:
            raise AtencionError(f"{where}: its weights do not fit the model; missing {new[:3]}, "
                                f"unexpected {unexpected[:3]}")
        return missing

    def save(self, directory: str | os.PathLike) -> None:
        """Write config.json and model.safetensors (or LoRA adapters) into ``directory``
        (model_dir.save_model)."""
        save_model(self, directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> "Model":
        """Rebuild a model saved by :meth:`save`, of the architecture its config names (called on
        a subclass, that class only); never unpickles anything (model_dir.load_model)."""
        return load_model(directory, map_location, expect=cls)
