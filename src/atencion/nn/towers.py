"""Two encoder towers in one shared space, as CLIP (Radford et al. 2021, §2.3 and Figure 3):
each tower an atencion encoder of one modality (``model.inputs``: image patches, spectrogram
frames), pooled ([CLS] or the mean over the real positions) and linearly projected to the shared
space by its classification head (``num_labels`` = the projection's width), then L2-normalised;
the logits of a batch of pairs are exp(t) · I_e · A_eᵀ with a learned log-temperature t,
initialised to log(1 / 0.07) and clipped at log 100 ("to prevent scaling the logits by more than
100", §2.5), and the loss is the symmetric InfoNCE loss of Figure 3: the cross-entropy of each
row (which recording goes with this image) and of each column (which image with this recording),
averaged.

``forward`` embeds a batch of each named tower's inputs and gives the logits' scale in one
call, as DistributedDataParallel and FSDP need (their hooks run around the root module's
forward); the temperature is a one-element tensor, as FSDP shards no scalar.

A towers directory (``directory_kind`` "towers", nn/model_dir.py) holds towers.json
({"task", "towers": [names], "projection", "log_scale"}) and one ordinary atencion model directory
per tower, named after it: model_dir.py's ``save_towers`` writes it and ``load_towers`` reads it
back (``load_model`` does, for such a directory).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import AtencionError

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
        self.log_scale = nn.Parameter(torch.tensor([float(log_scale)]))
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

    def scale(self) -> Tensor:
        """exp(t), the logits' scale (1,): at most 100, as CLIP's is."""
        return self.log_scale.clamp(max=LOG_SCALE_MAX).exp()

    def logits(self, first: Tensor, second: Tensor) -> Tensor:
        """exp(t) · first · secondᵀ, the temperature clipped at 100 as CLIP's is."""
        return self.scale() * first @ second.t()

    def forward(self, batches: dict[str, tuple[Tensor, Tensor | None]]) -> tuple[dict[str, Tensor], Tensor]:
        """The embeddings of each named tower's batch (inputs, lengths) and the logits' scale."""
        return {name: self.embed(name, *batch) for name, batch in batches.items()}, self.scale()

    @torch.no_grad()
    def clamp_(self) -> None:
        """After each update, as CLIP's training does: t ≤ log 100."""
        self.log_scale.clamp_(max=LOG_SCALE_MAX)

    def record(self) -> dict:
        return {"task": self.task, "towers": self.names, "projection": self.projection,
                "log_scale": self.log_scale.item()}
