"""§5.4: label-smoothed cross-entropy that ignores padding.

Two implementations of one loss, tested against each other: ``label_smoothed_loss`` on logits
(the readable one), and ``generator_loss``, which applies the generator itself chunk by chunk
and never keeps the (tokens × vocabulary) logits: the training path (less memory traffic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def label_smoothed_loss(logits: Tensor, target: Tensor, pad_id: int, epsilon: float) -> tuple[Tensor, Tensor]:
    """Summed over real target tokens: (label-smoothed loss, plain negative log-likelihood).

    With ε_ls = epsilon the target distribution puts 1 − ε on the reference token and spreads ε
    uniformly over the vocabulary (torch's definition); padding positions count for nothing.
    ``logits`` are (..., vocab) for every position of ``target``, or (n, vocab) for its n real
    tokens only (what ``model(..., select=target != pad_id)`` returns).
    """
    logits = logits.reshape(-1, logits.size(-1)).float()
    target = target.reshape(-1)
    keep = target != pad_id
    if logits.size(0) == target.numel() and not bool(keep.all()):  # logits of every position
        logits = logits[keep]
    target = target[keep]
    log_probs = F.log_softmax(logits, dim=-1)
    nll = F.nll_loss(log_probs, target, reduction="sum")
    if epsilon == 0:
        return nll, nll.detach()
    smooth = -log_probs.mean(dim=-1).sum()
    return (1 - epsilon) * nll + epsilon * smooth, nll.detach()


def generator_loss(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, pad_id: int,
                   epsilon: float, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """``label_smoothed_loss(hidden @ weightᵀ + bias, target)`` for the n real tokens, with
    ``hidden`` (n, d_model) already restricted to them (``model(..., select=..., project=False)``).

    Per row, loss = logsumexp(z) − (1 − ε)·z_y − ε·mean(z), and its gradient with respect to the
    logits is softmax(z) − ε/V − (1 − ε)·onehot(y): both are computed ``chunk`` rows at a time,
    the logits recomputed in the backward pass instead of stored.
    """
    target = target.reshape(-1)
    target = target[target != pad_id]
    if target.numel() != hidden.size(0):
        raise ValueError(f"hidden has {hidden.size(0)} rows for {target.numel()} real target tokens")
    return _GeneratorLoss.apply(hidden, weight, bias, target, float(epsilon), int(chunk))


class _GeneratorLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, epsilon, chunk):
        lse = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        loss = nll = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.size(0), chunk):
            rows = slice(start, start + chunk)
            z = F.linear(hidden[rows], weight, bias).float()
            lse[rows] = torch.logsumexp(z, dim=-1)
            z_y = z.gather(1, target[rows, None]).squeeze(1)
            nll = nll + (lse[rows] - z_y).sum()
            loss = loss + (lse[rows] - (1 - epsilon) * z_y - epsilon * z.mean(dim=-1)).sum()
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.epsilon, ctx.chunk = epsilon, chunk
        # Autograd runs backward outside autocast: the recomputed logits must see the precision
        # the forward pass saw, or softmax = exp(z − lse) mixes bf16 and fp32 logits.
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        eps, vocab = ctx.epsilon, weight.size(0)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if bias is not None else None
        for start in range(0, hidden.size(0), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows]
            with torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1], enabled=ctx.autocast[2]):
                z = F.linear(h, weight, bias)
            g = z.float().sub_(lse[rows, None]).exp_().sub_(eps / vocab)
            g.scatter_add_(1, target[rows, None], g.new_full((g.size(0), 1), eps - 1.0))
            g.mul_(grad_loss)
            grad_hidden[rows] = (g @ weight.float()).to(hidden.dtype)
            grad_weight.addmm_(g.t(), h.float())
            if grad_bias is not None:
                grad_bias += g.sum(0)
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None
