"""§3.5: sinusoidal positional encoding."""

import torch

from atencion.nn.positional import SinusoidalPositionalEncoding, sinusoidal_table


def test_table_follows_the_formula():
    d_model = 16
    table = sinusoidal_table(50, d_model)
    for pos in (0, 1, 17, 49):
        for i in range(d_model // 2):
            angle = torch.tensor(pos / 10000 ** (2 * i / d_model), dtype=torch.float64)
            assert abs(table[pos, 2 * i] - torch.sin(angle)) < 1e-6
            assert abs(table[pos, 2 * i + 1] - torch.cos(angle)) < 1e-6


def test_pe_at_pos_plus_k_is_a_fixed_linear_function_of_pe_at_pos():
    """§3.5: "for any fixed offset k, PE_{pos+k} can be represented as a linear function of PE_pos"
    — a rotation by k·ω_i in each (sin, cos) pair, the same matrix for every pos."""
    d_model, n = 32, 200
    table = sinusoidal_table(n, d_model).double()
    freqs = 1.0 / 10000 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    for k in (1, 5, 40):
        m = torch.zeros(d_model, d_model, dtype=torch.float64)
        for i, w in enumerate(freqs):
            c, s = torch.cos(k * w), torch.sin(k * w)
            # sin(a+b) = sin a cos b + cos a sin b ; cos(a+b) = cos a cos b - sin a sin b
            m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = c, s
            m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = -s, c
        predicted = table[: n - k] @ m.T
        assert (predicted - table[k:]).abs().max() < 1e-5


def test_encoding_extends_beyond_its_initial_table():
    pe = SinusoidalPositionalEncoding(8, n_positions=10)
    torch.testing.assert_close(pe(5, offset=20), sinusoidal_table(25, 8)[20:25])
