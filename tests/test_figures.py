"""The course's figures: what they claim (§3.5 positions, Table 1, √d_k) holds in the numbers behind them."""

import json
import sys

import pytest
import torch

from atencion.cli import main
from atencion.nn.attention import scaled_dot_product_attention
from atencion.viz import figures, table1
from atencion.viz.figures import FigureSettings

PROMISED = ["pe_heatmap.png", "pe_curves.png", "pe_dot_offset.png", "positional.json", "path_length.png",
            "path_length.json", "variance_scaling.png", "entropy_scaling.png", "scaling.json",
            "table1_time.png", "table1_memory.png", "table1.json", "table1.md"]

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak memory is read from /proc")


@linux_only
def test_figures_command_writes_every_file_it_promises(tmp_path, monkeypatch, capsys):
    tiny = FigureSettings(table1_ns=(8, 16, 32), repeats=1, d_model=16, n_heads=2, r=4, d_ks=(1, 4, 16, 64),
                          n_samples=500, n_queries=20, pe_positions=20, pe_d_model=16)
    monkeypatch.setattr(FigureSettings, "quick", classmethod(lambda cls: tiny))
    assert main(["figures", "--out", str(tmp_path), "--quick"]) == 0
    printed = capsys.readouterr().out
    for name in PROMISED:
        path = tmp_path / name
        assert path.stat().st_size > 0, name
        assert str(path) in printed
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((tmp_path / "table1.json").read_text())
    assert list(results["layers"]) == list(table1.PAPER)
    assert all(len(row["seconds"]) == 3 for row in results["layers"].values())
    assert "| self-attention | O(n²·d) |" in (tmp_path / "table1.md").read_text()


def test_pe_dot_product_depends_only_on_the_offset():
    """§3.5 (and the course): relative positions — PE(p)·PE(p+k) = Σ_i cos(ω_i k), whatever p is."""
    dots = figures.pe_dot_by_offset(64, starts=[0, 7, 300], max_offset=150)
    assert torch.allclose(dots[1:], dots[0].expand(2, -1), atol=1e-4)
    assert dots[0, 0] == pytest.approx(32.0, abs=1e-4)  # d_model/2 pairs of sin² + cos²
    assert dots[0, 1:].max() < dots[0, 0] - 1  # the nearest position is the most similar but itself


def test_unscaled_dot_product_variance_grows_as_d_k_and_scaling_brings_it_to_one():
    """§3.2.1: q·k of unit-variance components has variance d_k; divided by √d_k it has variance 1."""
    data = figures.dot_product_variance([4, 64, 256], n_samples=4000, seed=0)
    for d_k, unscaled, scaled in zip(data["d_k"], data["unscaled"], data["scaled"]):
        assert unscaled == pytest.approx(d_k, rel=0.12)
        assert scaled == pytest.approx(1.0, rel=0.12)


def test_without_scaling_the_softmax_saturates_as_d_k_grows():
    """The course: large scores push the softmax to concentrated rows; 1/√d_k keeps the entropy."""
    data = figures.softmax_saturation([4, 256], n_keys=32, n_queries=100, seed=0)
    assert data["entropy_unscaled"][1] < 0.5 < 2.5 < data["entropy_scaled"][1]
    assert data["max_weight_unscaled"][1] > 0.8 > 0.3 > data["max_weight_scaled"][1]
    assert abs(data["entropy_scaled"][1] - data["entropy_scaled"][0]) < 0.3


@pytest.mark.parametrize("exponent", [1.0, 2.0, 0.5])
def test_fitted_slope_recovers_a_known_exponent(exponent):
    ns = [64, 128, 256, 512, 1024]
    assert table1.fit_exponent(ns, [3e-6 * n**exponent for n in ns]) == pytest.approx(exponent, abs=1e-9)
    noisy = [3e-6 * n**exponent * (1.05 if i % 2 else 0.95) for i, n in enumerate(ns)]
    assert table1.fit_exponent(ns, noisy) == pytest.approx(exponent, abs=0.05)


def test_path_lengths_follow_their_definitions():
    """Table 1, last column: O(n), O(1), O(log_k n), O(n/k), O(n/r) from each layer's reach."""
    assert [table1.rnn_path_length(n) for n in (1, 10, 4096)] == [1, 10, 4096]
    assert [table1.self_attention_path_length(n) for n in (1, 10, 4096)] == [1, 1, 1]
    # dilated kernels of width k: L layers see k^L positions
    assert [table1.dilated_conv_path_length(n, 2) for n in (1, 2, 8, 9, 4096)] == [1, 1, 3, 4, 12]
    assert [table1.dilated_conv_path_length(n, 3) for n in (3, 9, 10, 27, 28)] == [1, 2, 3, 3, 4]
    # contiguous kernels: L layers see 1 + L(k−1) positions
    assert [table1.contiguous_conv_path_length(n, 3) for n in (3, 4, 9, 4096)] == [1, 2, 4, 2048]
    # neighbourhood r = 32: 16 positions each side per layer
    assert [table1.restricted_attention_path_length(n, 32) for n in (17, 18, 4096)] == [1, 2, 256]


def test_blocked_restricted_attention_equals_full_attention_with_a_band_mask():
    """The O(r·n·d) blocked computation gives exactly attention over |i − j| ≤ r/2."""
    torch.manual_seed(0)
    layer = table1.RestrictedSelfAttention(16, 2, r=6)
    for n in (1, 5, 12, 37):
        x = torch.randn(2, n, 16)
        q, k, v = layer._heads(layer.in_proj(x), 3).unbind(0)
        i = torch.arange(n)
        band = ((i[:, None] - i[None, :]).abs() <= 3).view(1, 1, n, n)
        out, _ = scaled_dot_product_attention(q, k, v, band, need_weights=True)
        expected = layer.out_proj(out.transpose(1, 2).reshape(2, n, 16))
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@linux_only
def test_peak_memory_measurement_sees_a_tensor_of_known_size():
    mib = 48

    def allocate():
        torch.ones(mib * 2**20 // 4) + 1  # the tensor and the sum: two of them at the peak

    measured = table1.measure_peak_memory(allocate) / 2**20
    assert measured == pytest.approx(2 * mib, rel=0.1)
    assert table1.measure_peak_memory(lambda: None) < 2**20
