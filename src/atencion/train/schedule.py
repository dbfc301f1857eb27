"""§5.3: lrate = d_model^-0.5 · min(step_num^-0.5, step_num · warmup_steps^-1.5), times a factor."""

from __future__ import annotations


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
