"""Two encoder towers in one shared space, as CLIP (Radford et al. 2021, §2.3 and Figure 3):
each tower an atencion encoder of one modality (``model.inputs``: image patches, spectrogram
frames), pooled ([CLS] or the mean over the real positions) and linearly projected to the shared
space by its classification head (``num_labels`` = the projection's width), then L2-normalised;
the logits of a batch of pairs are exp(t) · I_e · A_eᵀ with a learned log-temperature t,
initialised to log(1 / 0.07) and clipped at log 100 ("to prevent scaling the logits by more than
100", §2.5), and the loss is the symmetric InfoNCE loss of Figure 3: the cross-entropy of each
row (which recording goes with this image) and of each column (which image with this recording),
averaged.

A towers directory (``directory_kind`` "towers", nn/model_dir.py) holds towers.json
({"task", "towers": [names], "projection", "log_scale"}) and one ordinary atencion model directory
per tower, named after it; ``load_towers`` reads it back (``load_model`` does, for such a directory).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_directory
from .model_dir import TOWERS_FILE, load_model, save_model

LOG_SCALE_INIT = math.log(1 / 0.07)  # CLIP §2.5: "initialized to the equivalent of 0.07"
LOG_SCALE_MAX = math.log(100.0)      # and clipped so that the logits are scaled by at most 100


def info_nce(logits: Tensor) -> Tensor:
    """CLIP's symmetric loss (Figure 3): pair i is row i's and column i's answer; the mean of the
    cross-entropy over the rows and over the columns of ``logits`` (n, n)."""
    targets = torch.arange(logits.size(0), device=logits.device)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2


class Towers(nn.Module):
    """Named encoder towers (each a Transformer whose classification head is its projection) and
    the learned log-temperature ``log_scale``."""

    def __init__(self, towers: dict[str, nn.Module], log_scale: float = LOG_SCALE_INIT, task: str = "contrastive"):
        super().__init__()
        widths = {name: tower.cfg.num_labels for name, tower in towers.items()}
        if len(towers) < 2 or len(set(widths.values())) != 1 or 0 in widths.values():
            raise AtencionError(f"towers: expected two or more towers projecting to one width, got {widths}")
        self.towers = nn.ModuleDict(towers)
        self.log_scale = nn.Parameter(torch.tensor(float(log_scale)))
        self.task = task

    @property
    def names(self) -> list[str]:
        return list(self.towers)

    @property
    def projection(self) -> int:
        return next(iter(self.towers.values())).cfg.num_labels

    def embed(self, name: str, inputs: Tensor, lengths: Tensor | None = None) -> Tensor:
        """The L2-normalised embeddings (batch, projection) of a batch of tower ``name``'s inputs."""
        return F.normalize(self.towers[name].classify(inputs, lengths=lengths).float(), dim=-1)

    def logits(self, first: Tensor, second: Tensor) -> Tensor:
        """exp(t) · first · secondᵀ, the temperature clipped at 100 as CLIP's is."""
        return self.log_scale.clamp(max=LOG_SCALE_MAX).exp() * first @ second.t()

    @torch.no_grad()
    def clamp_(self) -> None:
        """After each update, as CLIP's training does: t ≤ log 100."""
        self.log_scale.clamp_(max=LOG_SCALE_MAX)

    def record(self) -> dict:
        return {"task": self.task, "towers": self.names, "projection": self.projection,
                "log_scale": self.log_scale.item()}


    def save(self, directory: str | os.PathLike) -> None:
        """Write towers.json and each tower's model directory into ``directory`` (as a checkpoint's
        model is written, inside its temporary directory; ``save_towers`` writes atomically)."""
        directory = Path(directory)
        for name, tower in self.towers.items():
            save_model(tower, directory / name)
        (directory / TOWERS_FILE).write_text(json.dumps(self.record(), indent=2) + "\n", encoding="utf-8")


def save_towers(model: Towers, directory: str | os.PathLike) -> None:
    """Write the towers directory ``directory`` atomically."""
    atomic_directory(directory, model.save)


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
