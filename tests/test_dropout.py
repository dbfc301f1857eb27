"""nn/dropout.py: the CPU dropout mask drawn as 16-bit integers behaves as dropout with
p rounded to 1/65536, unbiased, reproducible under the seed, and with the right gradient."""

import math

import pytest
import torch

from atencion.nn.dropout import LEVELS, Dropout, fast_dropout


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_drop_rate_and_scale_match_p(p):
    torch.manual_seed(0)
    x = torch.ones(1000, 1000)
    out = fast_dropout(x, p)
    p_used = round(p * LEVELS) / LEVELS
    kept = out != 0
    rate = 1 - kept.float().mean().item()
    sigma = math.sqrt(p_used * (1 - p_used) / x.numel())
    assert abs(rate - p_used) < 5 * sigma, (rate, p_used)
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p_used)))
    assert abs(out.mean().item() - 1) < 5 * sigma / (1 - p_used)   # unbiased


def test_mask_bits_are_independent_of_position():
    """Each 64-bit draw feeds four neighbours: their drops must not be correlated."""
    torch.manual_seed(0)
    dropped = (fast_dropout(torch.ones(4_000_000), 0.5) == 0).view(-1, 4).float()
    for j in range(4):
        assert abs(dropped[:, j].mean().item() - 0.5) < 0.002
    together = (dropped[:, 0] * dropped[:, 3]).mean().item()    # P(both) = 0.25 if independent
    assert abs(together - 0.25) < 0.002


def test_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    out = fast_dropout(x, 0.2)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(out != 0, out / x, torch.zeros_like(x)))


def test_seed_reproduces_the_mask_and_eval_mode_is_identity():
    layer = Dropout(0.1)
    x = torch.randn(10, 10)
    torch.manual_seed(3)
    a = layer(x)
    torch.manual_seed(3)
    b = layer(x)
    assert torch.equal(a, b) and not torch.equal(a, x)
    assert torch.equal(layer.eval()(x), x)


def test_probabilities_that_round_to_zero_or_one_use_torch_dropout():
    x = torch.randn(100, 100)
    assert torch.equal(Dropout(0.0)(x), x)
    assert torch.equal(Dropout(1.0)(x), torch.zeros_like(x))
    rare = Dropout(1e-7)(x)   # rounds to 0 / 65536; torch's dropout keeps p = 1e-7 (the seed drops none)
    torch.testing.assert_close(rare, x / (1 - 1e-7))


def test_bad_probability_is_refused():
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)
