"""§5.4: label-smoothed cross-entropy that ignores padding."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def label_smoothed_loss(logits: Tensor, target: Tensor, pad_id: int, epsilon: float) -> tuple[Tensor, Tensor]:
    """Summed over real target tokens: (label-smoothed loss, plain negative log-likelihood).

    With ε_ls = epsilon the target distribution puts 1 − ε on the reference token and spreads ε
    uniformly over the vocabulary (torch's definition); padding positions count for nothing.
    """
    logits = logits.reshape(-1, logits.size(-1)).float()
    target = target.reshape(-1)
    keep = target != pad_id
    logits, target = logits[keep], target[keep]
    log_probs = F.log_softmax(logits, dim=-1)
    nll = F.nll_loss(log_probs, target, reduction="sum")
    if epsilon == 0:
        return nll, nll.detach()
    smooth = -log_probs.mean(dim=-1).sum()
    return (1 - epsilon) * nll + epsilon * smooth, nll.detach()
