"""Scaling laws (Kaplan et al. 2020; Hoffmann et al. 2022): what a model's size and compute are
counted as, the power laws fitted to losses, the compute frontier and the fit's uncertainty.

- :func:`non_embedding_parameters`: Kaplan et al.'s N, the parameters less the token and position
  embeddings (an output projection tied to the embedding is the same tensor, counted out once).
- :func:`training_flops_per_token`: their Table 1, 2N + 2 n_layer n_ctx d_model for the forward
  pass, three times that with the backward.
- :func:`fit_power_law`: L(x) = (x_c / x)^α by least squares on log L against log x, Kaplan's form
  (their α_N = 0.076 for WebText2 in BPE tokens).
- :func:`fit_power_law_with_floor`: L(x) = L_∞ + (x_c / x)^α, the same in log L, with L_∞ found by a
  search of the profile (for each L_∞ the rest is the log-linear fit of L − L_∞).
- :func:`frontier`: the (compute, loss) points no smaller-compute point beats.
- :func:`bootstrap`: the fit again on resampled held-out rows, the same rows for every model.
- :func:`chinchilla_parameters`: the size the Chinchilla rule (20 tokens a parameter, C = 6 N D)
  gives a compute budget.
- :func:`fit_runs`: all of these on the runs of benchmarks/scaling.py, as one table.

benchmarks/scaling.py trains the models and draws the fits; the notebooks call these too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
from torch import nn

from ..nn.positional import LearnedPositionalEmbedding, TokenEmbedding

EMBEDDINGS = (nn.Embedding, TokenEmbedding, LearnedPositionalEmbedding)


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters less the token and learned position embeddings (Kaplan et al.'s N). A tied output
    projection is the embedding's tensor and is left out with it."""
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, EMBEDDINGS)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


def training_flops_per_token(non_embedding: int, n_layers: int, context: int, d_model: int) -> int:
    """Training compute per token: 3 × (2N + 2 n_layer n_ctx d_model) (Kaplan et al.'s Table 1,
    the backward pass twice the forward)."""
    return 3 * (2 * non_embedding + 2 * n_layers * context * d_model)


def chinchilla_parameters(compute: float, tokens_per_parameter: float = 20.0) -> float:
    """The model size the Chinchilla rule gives compute C: C = 6 N D with D = 20 N."""
    return float(np.sqrt(compute / (6.0 * tokens_per_parameter)))


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = floor + (scale / x) ** alpha."""

    scale: float
    alpha: float
    floor: float = 0.0

    def __call__(self, x):
        return self.floor + (self.scale / np.asarray(x, dtype=float)) ** self.alpha

    def to_dict(self) -> dict:
        return {"scale": self.scale, "alpha": self.alpha, "floor": self.floor}


def _arrays(x: Sequence[float], loss: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x, loss = np.asarray(x, dtype=float), np.asarray(loss, dtype=float)
    if x.shape != loss.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"a fit needs two or more points, x and loss alike, got {x.shape} and {loss.shape}")
    if (x <= 0).any() or (loss <= 0).any():
        raise ValueError("a power law fits positive sizes and losses only")
    return x, loss


def fit_power_law(x: Sequence[float], loss: Sequence[float], floor: float = 0.0) -> PowerLaw:
    """L = floor + (x_c / x)^α, floor given: log(L − floor) is a line in log x, slope −α."""
    x, loss = _arrays(x, loss)
    if (loss <= floor).any():
        raise ValueError(f"every loss must lie above the floor {floor}")
    slope, intercept = np.polyfit(np.log(x), np.log(loss - floor), 1)
    alpha = -slope
    return PowerLaw(scale=float(np.exp(intercept / alpha)), alpha=float(alpha), floor=float(floor))


def _log_error(law: PowerLaw, x: np.ndarray, loss: np.ndarray) -> float:
    return float(np.sum((np.log(law(x)) - np.log(loss)) ** 2))


def fit_power_law_with_floor(x: Sequence[float], loss: Sequence[float], grid: int = 400,
                             rounds: int = 6) -> PowerLaw:
    """L = L_∞ + (x_c / x)^α, least squares in log L: L_∞ searched on a grid in [0, min L), the grid
    narrowed around the best point ``rounds`` times; for each L_∞ the rest is :func:`fit_power_law`."""
    x, loss = _arrays(x, loss)
    if len(x) < 3:
        raise ValueError("a power law with a floor has three parameters: it needs three or more points")
    low, high = 0.0, float(loss.min())
    best = fit_power_law(x, loss)
    for _ in range(rounds):
        floors = np.linspace(low, high, grid + 1)[:-1]          # high itself is min L: L − L_∞ would be 0 there
        laws = [fit_power_law(x, loss, floor) for floor in floors]
        errors = [_log_error(law, x, loss) for law in laws]
        i = int(np.argmin(errors))
        if errors[i] <= _log_error(best, x, loss):
            best = laws[i]
        step = (high - low) / grid
        low, high = max(0.0, floors[i] - step), min(float(loss.min()), floors[i] + step)
    return best


def frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (compute, loss) points that no point of less or equal compute beats, by compute."""
    kept: list[tuple[float, float]] = []
    for compute, loss in sorted(points, key=lambda p: (p[0], p[1])):
        if not kept or loss < kept[-1][1]:
            kept.append((compute, loss))
    return kept


def held_out_error(x: Sequence[float], loss: Sequence[float], left_out: Sequence[int],
                   fit: Callable[..., PowerLaw] = fit_power_law) -> list[float]:
    """The fit made without the points ``left_out``, its relative error at each of them."""
    x, loss = _arrays(x, loss)
    kept = [i for i in range(len(x)) if i not in set(left_out)]
    law = fit(x[kept], loss[kept])
    return [float(abs(law(x[i]) - loss[i]) / loss[i]) for i in left_out]


def bootstrap(x: Sequence[float], row_losses: Sequence[Sequence[float]], fit: Callable[..., PowerLaw] = fit_power_law,
              samples: int = 1000, seed: int = 0) -> list[PowerLaw]:
    """The fit on ``samples`` resamplings of the held-out rows: row_losses[i][r] is model i's loss on
    row r; each resampling draws the rows with replacement, the same rows for every model."""
    rows = np.asarray(row_losses, dtype=float)
    if rows.ndim != 2 or rows.shape[0] != len(x):
        raise ValueError(f"row_losses must be one row of losses per model, got shape {rows.shape} for {len(x)} models")
    rng = np.random.default_rng(seed)
    laws = []
    for _ in range(samples):
        pick = rng.integers(0, rows.shape[1], rows.shape[1])
        laws.append(fit(x, rows[:, pick].mean(axis=1)))
    return laws


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median and the central ``level`` interval (percentiles) of ``values``."""
    tail = 100 * (1 - level) / 2
    low, median, high = np.percentile(np.asarray(values, dtype=float), [tail, 50, 100 - tail])
    return float(median), float(low), float(high)


def fit_runs(runs: list[dict], samples: int = 1000, seed: int = 0, after_step: int = 0) -> dict:
    """The fits of models trained on the same tokens (benchmarks/scaling.py's runs: each with its
    ``non_embedding`` N, ``valid_loss`` and ``row_losses`` on the same held-out rows,
    ``flops_per_token``, and ``checkpoints`` of ``tokens`` and ``valid_loss``): L(N) without and with
    L_∞, each with its bootstrap interval (``samples`` resamplings of the rows) and its relative
    error at the largest size and at each size left out of the fit in turn; the compute frontier
    with L(C) fitted to its points after update ``after_step`` (a warm-up's early fall is no power
    law); beside each frontier point, the size the Chinchilla rule gives."""
    models = sorted(runs, key=lambda m: m["non_embedding"])
    n = [m["non_embedding"] for m in models]
    loss = [m["valid_loss"] for m in models]
    quick_floor = partial(fit_power_law_with_floor, grid=100, rounds=4)
    out = {"sizes": [{key: m[key] for key in ("layers", "d_model", "heads", "non_embedding", "lr", "minutes")}
                     | {"valid_loss": round(m["valid_loss"], 5),
                        "train_loss": m["checkpoints"][-1]["train_loss"],
                        "tokens_per_parameter": round(m["checkpoints"][-1]["tokens"] / m["non_embedding"], 1)}
                     for m in models]}
    for name, fit in (("power_law", fit_power_law), ("with_floor", fit_power_law_with_floor)):
        law = fit(n, loss)
        laws = bootstrap(n, [m["row_losses"] for m in models], quick_floor if name == "with_floor" else fit,
                         samples=samples, seed=seed)
        median, low, high = interval([law.alpha for law in laws])
        last = len(n) - 1
        one_out = [held_out_error(n, loss, [i], fit)[0] for i in range(len(n))]
        out[name] = {**{key: round(value, 5) for key, value in law.to_dict().items()},
                     "alpha_bootstrap": {"median": round(median, 5), "low": round(low, 5), "high": round(high, 5),
                                         "samples": samples, "level": 0.95},
                     "error_largest_left_out": round(held_out_error(n, loss, [last], fit)[0], 4),
                     "error_each_left_out": [round(e, 4) for e in one_out],
                     "predicted": [round(float(law(x)), 5) for x in n]}
    points = [(m["flops_per_token"] * c["tokens"], c["valid_loss"]) for m in models for c in m["checkpoints"]]
    front = frontier(points)
    owner = {(m["flops_per_token"] * c["tokens"], c["valid_loss"]): m["non_embedding"]
             for m in models for c in m["checkpoints"]}
    step = {(m["flops_per_token"] * c["tokens"], c["valid_loss"]): c.get("step", after_step + 1)
            for m in models for c in m["checkpoints"]}
    fitted = [(compute, value) for compute, value in front if step[(compute, value)] > after_step]
    law = fit_power_law([compute for compute, _ in fitted], [value for _, value in fitted])
    out["frontier"] = {"scale": law.scale, "alpha": round(law.alpha, 5), "after_step": after_step,
                       "points": [{"compute": compute, "valid_loss": value, "non_embedding": owner[(compute, value)],
                                   "step": step[(compute, value)], "fitted": (compute, value) in fitted,
                                   "chinchilla_non_embedding": round(chinchilla_parameters(compute))}
                                  for compute, value in front]}
    return out
