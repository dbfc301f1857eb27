"""§5.4: label-smoothed cross-entropy that ignores padding.

Two implementations of one loss, tested against each other: ``label_smoothed_loss`` on logits
(the readable one), and ``generator_loss``, which applies the generator itself chunk by chunk,
never keeps the (tokens × vocabulary) logits and computes the gradient as it goes: the training
path (less memory traffic, one vocabulary-sized matrix product fewer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import AtencionError


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

    Per row, with log-probabilities l = log_softmax(z): loss = −(1 − ε)·l_y − ε·mean(l), and its
    gradient with respect to the logits is softmax(z) − ε/V − (1 − ε)·onehot(y). Both are
    computed ``chunk`` rows at a time in the forward pass, and the gradient goes straight on to
    ``hidden``, ``weight`` and ``bias`` there: the logits are never stored nor computed twice,
    and the backward pass only scales the stored gradients by the incoming one (the loss is
    linear in it). Without autograd (``torch.no_grad()``, or no input requiring a gradient) only
    the loss is computed.
    """
    target = target.reshape(-1)
    target = target[target != pad_id]
    if target.numel() != hidden.size(0):
        raise AtencionError(f"hidden has {hidden.size(0)} rows for {target.numel()} real target tokens")
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _GeneratorLoss.apply(hidden, weight, bias, target, float(epsilon), int(chunk), wants_grad)


SAFE_PROB = 1e-30  # below this (near float32's smallest normal), log p_y is taken from log_softmax


def _log_likelihoods(z: Tensor, y: Tensor, need_probs: bool) -> tuple[Tensor | None, Tensor, Tensor]:
    """For logits z (rows, V) and targets y (rows, 1): softmax(z) when ``need_probs`` (else
    None), the log-probabilities l_y of the targets and the mean log-probability of each row.

    With the probabilities needed anyway (for the gradient), a CPU takes them from softmax, one
    pass, and gets the rest without a log_softmax pass: log p_y = log(p_y),
    logsumexp(z) = z_y − log p_y and mean(l) = mean(z) − logsumexp(z). That is exact as long as
    p_y is a normal float; a chunk where some p_y is below ``SAFE_PROB`` takes log_softmax.
    """
    if need_probs and z.device.type == "cpu":
        probs = torch.softmax(z, dim=-1)
        p_y = probs.gather(1, y).squeeze(1)
        if bool((p_y >= SAFE_PROB).all()):
            l_y = p_y.log()
            return probs, l_y, z.mean(dim=-1) - (z.gather(1, y).squeeze(1) - l_y)
    log_probs = F.log_softmax(z, dim=-1)
    l_y, mean_l = log_probs.gather(1, y).squeeze(1), log_probs.mean(dim=-1)
    return (log_probs.exp_() if need_probs else None), l_y, mean_l


class _GeneratorLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, epsilon, chunk, wants_grad):
        vocab, device = weight.size(0), hidden.device.type
        loss = nll = hidden.new_zeros((), dtype=torch.float32)
        if wants_grad:
            weight32 = weight.float()
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
            grad_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if bias is not None else None
        for start in range(0, hidden.size(0), chunk):
            rows = slice(start, start + chunk)
            h, y = hidden[rows], target[rows, None]
            z = F.linear(h, weight, bias).float()  # in autocast's precision, then float32
            probs, l_y, mean_l = _log_likelihoods(z, y, need_probs=wants_grad)
            nll = nll - l_y.sum()
            loss = loss - ((1 - epsilon) * l_y + epsilon * mean_l).sum()
            if wants_grad:
                # Gradients in float32 whatever autocast does around this forward pass.
                with torch.autocast(device, enabled=False):
                    g = probs.sub_(epsilon / vocab)
                    g.scatter_add_(1, y, g.new_full((g.size(0), 1), epsilon - 1.0))
                    grad_hidden[rows] = (g @ weight32).to(hidden.dtype)
                    grad_weight.addmm_(g.t(), h.float())
                    if grad_bias is not None:
                        grad_bias += g.sum(0)
        if wants_grad:
            ctx.grads = (grad_hidden, grad_weight.to(weight.dtype),
                         grad_bias.to(bias.dtype) if grad_bias is not None else None)
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.grads)
        return grads + (None, None, None, None)


def vocabulary_projection(model) -> tuple[Tensor, Tensor | None]:
    """The weight and bias of ``model``'s last projection to the vocabulary: the generator's,
    or for an encoder-only model the masked-LM head's."""
    head = model.mlm_head if model.cfg.arch == "encoder" else model.generator
    return head.weight, head.bias


def sequence_loss(forward, model, input_ids: Tensor, targets: Tensor, epsilon: float = 0.0) -> tuple[Tensor, Tensor]:
    """The training loss of a single-stack model (decoder: next-token prediction; encoder:
    masked-token prediction), summed over the positions where ``targets`` is not padding:
    (label-smoothed loss, negative log-likelihood), as ``generator_loss``. ``forward`` is the
    model or its DistributedDataParallel wrapper; ``model`` the model itself."""
    pad = model.cfg.pad_id
    hidden = forward(input_ids, select=targets != pad, project=False)
    weight, bias = vocabulary_projection(model)
    return generator_loss(hidden, weight, bias, targets, pad, epsilon)
