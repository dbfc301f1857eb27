"""Scaling laws (viz/scaling.py): the fits recover known laws from synthetic points, the frontier is
the lower envelope, the bootstrap's interval holds the true exponent, and N and C are counted as
Kaplan et al. count them."""

import math

import numpy as np
import pytest

from atencion import ModelConfig, Transformer
from atencion.viz.scaling import (
    PowerLaw,
    bootstrap,
    chinchilla_parameters,
    fit_power_law,
    fit_power_law_with_floor,
    fit_runs,
    frontier,
    held_out_error,
    interval,
    non_embedding_parameters,
    training_flops_per_token,
)

SIZES = np.geomspace(1e4, 5e6, 8)


def test_the_power_law_fit_recovers_kaplans_exponent_from_exact_points():
    truth = PowerLaw(scale=8.8e13, alpha=0.076)     # Kaplan et al.'s L(N)
    law = fit_power_law(SIZES, truth(SIZES))
    assert law.alpha == pytest.approx(0.076, rel=1e-9)
    assert law.scale == pytest.approx(8.8e13, rel=1e-6)
    assert law.floor == 0.0


def test_the_fit_with_a_floor_recovers_all_three_where_the_plain_fit_is_biased():
    truth = PowerLaw(scale=3e3, alpha=0.35, floor=1.2)
    loss = truth(SIZES)
    law = fit_power_law_with_floor(SIZES, loss)
    assert law.floor == pytest.approx(1.2, rel=1e-4)
    assert law.alpha == pytest.approx(0.35, rel=1e-3)
    assert law.scale == pytest.approx(3e3, rel=1e-2)
    plain = fit_power_law(SIZES, loss)
    assert plain.alpha < 0.2                       # the floor flattens the curve the plain law sees
    assert held_out_error(SIZES, loss, [7], fit_power_law_with_floor)[0] < 1e-4
    assert held_out_error(SIZES, loss, [7], fit_power_law)[0] > 1e-3


def test_a_pure_power_law_fitted_with_a_floor_keeps_the_floor_near_zero():
    truth = PowerLaw(scale=5e5, alpha=0.1)
    law = fit_power_law_with_floor(SIZES, truth(SIZES))
    assert law.alpha == pytest.approx(0.1, rel=1e-3)
    assert law.floor < 1e-3 * truth(SIZES).min()


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="two or more points"):
        fit_power_law([1e4], [3.0])
    with pytest.raises(ValueError, match="positive"):
        fit_power_law([1e4, 0], [3.0, 2.0])
    with pytest.raises(ValueError, match="three or more points"):
        fit_power_law_with_floor([1e4, 1e5], [3.0, 2.0])


def test_the_frontier_keeps_the_points_no_cheaper_point_beats():
    points = [(1, 5.0), (2, 4.0), (3, 4.5), (4, 3.0), (4, 3.5), (8, 3.2), (9, 2.0)]
    assert frontier(points) == [(1, 5.0), (2, 4.0), (4, 3.0), (9, 2.0)]


def test_the_bootstraps_95_percent_interval_holds_the_true_exponent_about_95_times_in_100():
    truth = PowerLaw(scale=2e8, alpha=0.12)
    rng = np.random.default_rng(1)
    held, widths = 0, []
    for trial in range(60):      # 60 data sets, each of 8 sizes × 200 rows with 5% noise per row
        rows = truth(SIZES)[:, None] * np.exp(rng.normal(0, 0.05, (len(SIZES), 200)))
        median, low, high = interval([law.alpha for law in bootstrap(SIZES, rows, samples=200, seed=trial)])
        held += low < 0.12 < high
        widths.append(high - low)
    assert 50 <= held                              # 57 expected; binomial(60, 0.95) < 50: 2 in 10,000
    assert np.median(widths) < 0.005


def test_non_embedding_parameters_leave_out_the_token_and_position_tables():
    cfg = ModelConfig(vocab_size=100, arch="decoder", task="lm", n_layers=3, d_model=32, n_heads=2, d_ff=128,
                      dropout=0.0, norm_first=True, positional="learned", max_positions=64)
    model = Transformer(cfg)
    d, layers = 32, 3
    per_layer = 4 * d * d + 4 * d + 2 * d * 128 + 128 + d + 2 * 2 * d    # attention, feed-forward, two norms
    assert non_embedding_parameters(model) == layers * per_layer + 2 * d  # and the final norm
    assert model.num_parameters() - non_embedding_parameters(model) == (100 + 64) * d
    assert non_embedding_parameters(model) == pytest.approx(12 * layers * d * d, rel=0.05)   # Kaplan's 12 n d²


def test_compute_is_counted_as_kaplans_table_1_and_chinchilla_gives_twenty_tokens_a_parameter():
    assert training_flops_per_token(1000, 2, 128, 32) == 3 * (2 * 1000 + 2 * 2 * 128 * 32)
    n = 4.7e6
    assert chinchilla_parameters(6 * n * 20 * n) == pytest.approx(n)


def _runs(truth: PowerLaw, rows: int = 200, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    runs = []
    for n in SIZES:
        row_losses = (truth(n) * np.exp(rng.normal(0, 0.02, rows))).tolist()
        curve = [{"step": step, "tokens": t, "valid_loss": truth(n) + 3.0 / math.sqrt(t / 1e4), "train_loss": 0.0}
                 for step, t in enumerate((1e4, 1e5, 1e6), start=1)]
        runs.append({"layers": 1, "d_model": 1, "heads": 1, "non_embedding": int(n), "lr": 1e-3, "minutes": 0.0,
                     "flops_per_token": 6 * int(n), "valid_loss": float(np.mean(row_losses)),
                     "row_losses": row_losses, "checkpoints": curve})
    return runs


def test_fit_runs_reports_the_exponent_its_interval_the_held_out_errors_and_the_frontier():
    table = fit_runs(_runs(PowerLaw(scale=1e9, alpha=0.09, floor=0.0)), samples=50, after_step=1)
    plain = table["power_law"]
    assert plain["alpha"] == pytest.approx(0.09, abs=0.005)
    assert plain["alpha_bootstrap"]["low"] < plain["alpha"] < plain["alpha_bootstrap"]["high"]
    assert len(plain["error_each_left_out"]) == len(SIZES)
    assert max(plain["error_each_left_out"]) < 0.01
    front = table["frontier"]["points"]
    assert [p["compute"] for p in front] == sorted(p["compute"] for p in front)
    assert all(a["valid_loss"] > b["valid_loss"] for a, b in zip(front, front[1:], strict=False))
    assert {p["non_embedding"] for p in front} <= {int(n) for n in SIZES}
    assert all(p["chinchilla_non_embedding"] == round(chinchilla_parameters(p["compute"])) for p in front)
    assert all(p["fitted"] == (p["step"] > 1) for p in front)         # the first update's points are not fitted
    assert not all(p["fitted"] for p in front)
    every = fit_runs(_runs(PowerLaw(scale=1e9, alpha=0.09, floor=0.0)), samples=2)["frontier"]
    assert all(p["fitted"] for p in every["points"]) and every["alpha"] != table["frontier"]["alpha"]
