"""§5.3: the optimizer (Adam, or AdamW with decoupled decay: ``build_optimizer``) and its rate,
lrate = d_model^-0.5 · min(step_num^-0.5, step_num · warmup_steps^-1.5), times a factor; and the
cosine and constant schedules language models are usually trained with."""

from __future__ import annotations

import math

import torch


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0, peak: float | None = None) -> float:
    """The learning rate at update ``step`` (counted from 1): linear warm-up, then ∝ 1/√step.

    ``peak``, if given, replaces ``factor · d_model^-0.5`` so that the rate at step = warmup
    is exactly ``peak`` (how fairseq's inverse_sqrt schedule is usually written).
    """
    step = max(step, 1)
    shape = min(step ** -0.5, step * warmup ** -1.5)
    if peak is not None:
        return peak * warmup ** 0.5 * shape
    return factor * d_model ** -0.5 * shape


def learning_rate(step: int, d_model: int, t) -> float:
    """The rate at update ``step`` under ``t`` (the train section): linear warm-up to the peak
    (``lr_peak``, or §5.3's ``lr_factor · d_model^-0.5 · warmup^-0.5``), then ``t.schedule``:
    ∝ 1/√step (inverse_sqrt), a cosine down to ``lr_min`` at ``max_steps`` (cosine), or flat."""
    if t.schedule == "inverse_sqrt":
        return noam_lr(step, d_model, t.warmup, t.lr_factor, t.lr_peak)
    peak = t.lr_peak if t.lr_peak is not None else t.lr_factor * (d_model * t.warmup) ** -0.5
    step = max(step, 1)
    if step < t.warmup:
        return peak * step / t.warmup
    if t.schedule == "constant":
        return peak
    progress = min(1.0, (step - t.warmup) / max(1, t.max_steps - t.warmup))
    return t.lr_min + 0.5 * (peak - t.lr_min) * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, train_cfg) -> torch.optim.Optimizer:
    """Adam over the trainable parameters (§5.3, weight_decay an L2 term), or AdamW with decoupled decay."""
    t = train_cfg
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters and a new head
    if t.optimizer == "adamw":  # decoupled decay of the matrices only, not of biases and norms (GPT-2's groups)
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=0.0, betas=t.adam_betas, eps=t.adam_eps, fused=True)
    return torch.optim.Adam(params, lr=0.0, betas=t.adam_betas, eps=t.adam_eps, weight_decay=t.weight_decay,
                            fused=True)  # lr=0: the schedule sets each update's rate
