"""Checkpoints as safetensors + JSON, written atomically; a checkpoint is also a model directory.

A checkpoint directory holds the model (config.json, model.safetensors), the tokenizer, and for
resuming: optimizer.safetensors (Adam's moments), rng.safetensors (torch's generator states)
and trainer_state.json (step, position in the data, best score, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..data.tokenizer import Tokenizer
from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_directory
from ..nn.transformer import Transformer

OPTIMIZER_FILE, RNG_FILE, STATE_FILE = "optimizer.safetensors", "rng.safetensors", "trainer_state.json"


def save_checkpoint(path: Path, model: Transformer, tokenizer: Tokenizer, optimizer=None,
                    trainer_state: dict[str, Any] | None = None) -> None:
    """Write a checkpoint (or, without optimizer and state, a plain model directory) atomically."""

    def fill(tmp: Path) -> None:
        model.save(tmp)
        tokenizer.save(tmp)
        if optimizer is not None:
            save_file(_optimizer_tensors(optimizer), str(tmp / OPTIMIZER_FILE))
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
            save_file(rng, str(tmp / RNG_FILE))
        if trainer_state is not None:
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n", encoding="utf-8")

    atomic_directory(path, fill)


def _optimizer_tensors(optimizer) -> dict[str, torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return {f"{index}.{key}": value.detach().cpu().contiguous()
            for index, values in state.items() for key, value in values.items() if torch.is_tensor(value)}


def load_training_state(path: Path, optimizer) -> dict[str, Any]:
    """Restore optimizer and RNG states from checkpoint ``path``; return its trainer state."""
    for name in (OPTIMIZER_FILE, RNG_FILE, STATE_FILE):
        if not (path / name).is_file():
            raise MissingFileError(f"{path / name}: missing, so this checkpoint cannot be resumed")
    try:
        tensors = load_file(str(path / OPTIMIZER_FILE))
        rng = load_file(str(path / RNG_FILE))
        trainer_state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except Exception as err:  # damaged files: say which checkpoint
        raise AtencionError(f"{path}: damaged checkpoint ({err})") from None
    current = optimizer.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    current["state"] = state
    optimizer.load_state_dict(current)
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    return trainer_state


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint directories under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step_"))


def average_checkpoints(paths: list[Path], out: Path) -> None:
    """Average the weights of several model directories into ``out`` (§6.1: the last checkpoints)."""
    if not paths:
        raise AtencionError("average: give at least one checkpoint directory")
    models = [Transformer.load(p) for p in paths]
    first = models[0]
    for path, model in zip(paths[1:], models[1:]):
        if model.cfg != first.cfg:
            raise AtencionError(f"{path}: its config.json differs from {paths[0]}; only checkpoints of one "
                             f"model can be averaged")
    states = [m.state_dict() for m in models]
    averaged = {name: torch.stack([state[name].double() for state in states]).mean(0).to(value.dtype)
                if value.is_floating_point() else value
                for name, value in states[0].items()}
    first.load_state_dict(averaged)
    save_checkpoint(out, first, Tokenizer.load(paths[0]))
