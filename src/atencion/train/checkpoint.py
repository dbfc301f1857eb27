"""Checkpoints as safetensors + JSON, written atomically; a checkpoint is also a model directory.

A checkpoint directory holds the model (config.json, model.safetensors), the tokenizer, and for
resuming: optimizer.safetensors (Adam's moments), rng.safetensors (torch's generator states)
and trainer_state.json (step, position in the data, best score, ...).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from ..data.tokenizer import INFO_FILE, JOINT_FILE, SRC_FILE, TGT_FILE, Tokenizer
from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_directory, atomic_write_text, need_dir
from ..nn.lora import merge_lora
from ..nn.model import Model
from ..nn.model_dir import load_model, load_model_dir, save_model

OPTIMIZER_FILE, RNG_FILE, STATE_FILE = "optimizer.safetensors", "rng.safetensors", "trainer_state.json"
# A training run's directory: RUN_FILE marks it as one (written first), the rest is what a run writes.
RUN_FILE = "run.json"
RUN_ENTRIES = {RUN_FILE, "config.yaml", "log.jsonl", "tensorboard", "checkpoints", "best", JOINT_FILE, SRC_FILE,
               TGT_FILE, INFO_FILE}


def prepare_run_dir(out: Path, check_only: bool = False) -> list[str]:
    """Make ``out`` ready for a new run and mark it with RUN_FILE. It must be new, empty, or a run
    that stopped before its first checkpoint (its files are removed and their names returned:
    such a run is started over). Anything else is refused before a file is written; so is a
    directory holding a file a run does not write. ``check_only``: refuse or return, change nothing."""
    if out.exists() and not out.is_dir():
        raise AtencionError(f"--out {out}: is a file; expected a directory")
    if list_checkpoints(out / "checkpoints"):
        raise AtencionError(f"--out {out} already holds a training run; pass --resume to continue it "
                            f"or choose another --out (nothing was overwritten)")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if entries and not (out / RUN_FILE).is_file():
        raise AtencionError(f"--out {out}: exists, is not empty and is not a training run (no {RUN_FILE}); "
                            f"choose a new or empty directory (nothing was overwritten)")
    foreign = [e.name for e in entries if e.name not in RUN_ENTRIES and not e.name.startswith(".")]
    if foreign:
        raise AtencionError(f"--out {out}: holds a run that stopped before its first checkpoint and also "
                            f"{foreign[0]!r}, which a run does not write; move it away or choose another "
                            f"--out (nothing was overwritten)")
    if check_only:
        return []
    removed = []
    for entry in entries:
        if entry.name != RUN_FILE and entry.name in RUN_ENTRIES:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            removed.append(entry.name)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / RUN_FILE, json.dumps({"atencion": "training run",
                                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    return removed


def save_checkpoint(path: Path, model: Model, tokenizer: Tokenizer | None, optimizer_state: dict | None = None,
                    trainer_state: dict[str, Any] | None = None) -> None:
    """Write a checkpoint (or, without optimizer state and trainer state, a plain model directory)
    atomically; a model without a vocabulary (a ViT) has no ``tokenizer``. ``optimizer_state``: the
    optimizer's ``state_dict()`` as one process holds it (its "state", by parameter index).
    Non-finite weights are refused by ``save_model`` inside the temporary directory, so nothing
    takes the checkpoint's place."""

    def fill(tmp: Path) -> None:
        save_model(model, tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if optimizer_state is not None:
            (tmp / OPTIMIZER_FILE).write_bytes(save(_optimizer_tensors(optimizer_state)))  # a full disk: OSError
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
            (tmp / RNG_FILE).write_bytes(save(rng))
        if trainer_state is not None:
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n", encoding="utf-8")

    atomic_directory(path, fill)


def _optimizer_tensors(optimizer_state: dict) -> dict[str, torch.Tensor]:
    state = optimizer_state["state"]
    return {f"{index}.{key}": value.detach().cpu().contiguous()
            for index, values in state.items() for key, value in values.items() if torch.is_tensor(value)}


def load_training_state(path: Path, load_optimizer: Callable[[dict], None]) -> dict[str, Any]:
    """Restore the optimizer and RNG states from checkpoint ``path``; return its trainer state.
    ``load_optimizer({"state": {index: {name: tensor}}})`` gives the optimizer its state, whole
    or, under fsdp, each process its shard (distributed.Parallel.load_optimizer_state)."""
    for name in (OPTIMIZER_FILE, RNG_FILE, STATE_FILE):
        if not (path / name).is_file():
            raise MissingFileError(f"{path / name}: missing, so this checkpoint cannot be resumed")
    try:
        tensors = load_file(str(path / OPTIMIZER_FILE))
        rng = load_file(str(path / RNG_FILE))
        trainer_state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except Exception as err:  # damaged files: say which checkpoint
        raise AtencionError(f"{path}: damaged checkpoint ({err})") from None
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    load_optimizer({"state": state})
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


def average_checkpoints(paths: list[str | Path], out: str | Path, force: bool = False) -> None:
    """Average the weights of several model directories into ``out`` (§6.1: the last checkpoints),
    which must be new or empty unless ``force``, and none of them. One model is held at a time (a
    running sum in float64), so any number of checkpoints fits. LoRA checkpoints are averaged as
    the merged models they stand for (the average of the products B A, not the product of
    averages): the result holds plain weights."""
    if not paths:
        raise AtencionError("average: give at least one checkpoint directory")
    paths = [need_dir(p, "CKPT") for p in paths]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AtencionError(f"--out {out}: is a file; expected a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise AtencionError(f"--out {out} exists and is not empty; pass --force to replace it")
    if any(out.resolve() == p.resolve() for p in paths):
        raise AtencionError(f"--out {out} is one of the checkpoints being averaged; choose another directory")
    first, tokenizer = load_model_dir(paths[0], what="CKPT")  # LoRA checkpoints: adapters folded in
    sums = {name: value.double() for name, value in first.state_dict().items() if value.is_floating_point()}
    for path in paths[1:]:
        # the weights only: its tokenizer must be the first's, byte for byte
        model = merge_lora(load_model(path))
        if model.cfg != first.cfg:
            key = next(k for k, v in first.cfg.to_dict().items() if getattr(model.cfg, k) != v)
            raise AtencionError(f"{path / 'config.json'}: {key} is {getattr(model.cfg, key)!r} but "
                                f"{paths[0] / 'config.json'} has {getattr(first.cfg, key)!r}; only "
                                f"checkpoints of one model can be averaged")
        _same_tokenizer(path, paths[0])
        for name, value in model.state_dict().items():
            if name in sums:
                sums[name] += value.double()
        del model
    averaged = {name: (sums[name] / len(paths)).to(value.dtype) if name in sums else value
                for name, value in first.state_dict().items()}
    first.load_state_dict(averaged)
    save_checkpoint(out, first, tokenizer)


def _same_tokenizer(path: Path, reference: Path) -> None:
    """Checkpoints averaged together must share their subword models byte for byte."""
    for name in (JOINT_FILE, SRC_FILE, TGT_FILE):
        mine, theirs = path / name, reference / name
        if mine.is_file() != theirs.is_file() or (mine.is_file() and mine.read_bytes() != theirs.read_bytes()):
            raise AtencionError(f"{mine}: differs from {theirs}; checkpoints of one run share their "
                                f"tokenizer, so these cannot be averaged")
