"""FlashAttention (nn/kinds/flash.py): tiled attention with the online softmax equals eq. (1) in
values and gradients, under masks, causality, position biases and dropout, in O(n) memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atencion.errors import AtencionError
from atencion.nn.attention import _explicit_attention
from atencion.nn.kinds import flash as flash_module
from atencion.nn.kinds.flash import draw_dropout_seed, dropout_keep_mask, flash_attention
from atencion.nn.positional import AlibiPositions, RotaryPositions, T5Positions, rotate_half
from atencion.viz.table1 import can_measure_memory

SRC = Path(__file__).resolve().parents[1] / "src"


def _qkv(b, h, tq, tk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=dtype).requires_grad_() for n in (tq, tk, tk))


def _future_hidden(tq, tk):
    """Query i, at position tk − tq + i, sees keys j ≤ that position: (1, 1, tq, tk)."""
    return (torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq))[:, None])[None, None]


def _assert_same(q, k, v, flash_kwargs, mask=None, bias=None, scale=None, leaves=(), atol=None, rtol=None):
    """flash_attention and eq. (1) give the same output and the same gradients of q, k, v and
    ``leaves`` for a random upstream gradient."""
    flash = flash_attention(q, k, v, scale=scale, **flash_kwargs)
    explicit, _ = _explicit_attention(q, k, v, mask, 0.0, bias, scale)
    tol = dict(atol=atol, rtol=rtol) if atol else {}
    torch.testing.assert_close(flash, explicit, **tol)
    d_out = torch.randn_like(flash)
    inputs = (q, k, v, *leaves)
    for got, want in zip(torch.autograd.grad(flash, inputs, d_out), torch.autograd.grad(explicit, inputs, d_out)):
        torch.testing.assert_close(got, want, **tol)
    return flash


SHAPES = [  # batch, heads, q_len, k_len, d_k, q_tile, k_tile
    (2, 3, 8, 8, 4, 4, 4),        # tiles divide n
    (2, 2, 7, 11, 5, 3, 4),       # q_len != k_len, last tiles shorter
    (1, 4, 12, 5, 8, 5, 2),       # more queries than keys
    (3, 1, 6, 9, 3, 1, 1),        # tiles of one
    (1, 2, 5, 7, 6, 64, 100),     # tiles longer than the sequence
    (2, 2, 33, 40, 16, 16, 8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiled_attention_equals_equation_one_in_values_and_gradients(shape, dtype):
    b, h, tq, tk, d, qt, kt = shape
    q, k, v = _qkv(b, h, tq, tk, d, dtype)
    tol = (1e-12, 1e-10) if dtype == torch.float64 else (1e-5, 1e-5)
    _assert_same(q, k, v, dict(q_tile=qt, k_tile=kt), atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_a_given_scale_replaces_one_over_root_d_k(scale):
    q, k, v = _qkv(2, 2, 6, 7, 4)
    _assert_same(q, k, v, dict(q_tile=4, k_tile=3), scale=scale)


@pytest.mark.parametrize("tq, tk, qt, kt", [(9, 9, 4, 3), (5, 11, 2, 4), (3, 12, 1, 5), (10, 6, 3, 2), (7, 7, 1, 1)])
def test_causal_attention_equals_equation_one_with_the_future_hidden(tq, tk, qt, kt):
    q, k, v = _qkv(2, 2, tq, tk, 4)
    out = _assert_same(q, k, v, dict(causal=True, q_tile=qt, k_tile=kt), mask=_future_hidden(tq, tk))
    if tq > tk:  # the first queries come before every key: they see nothing
        assert torch.all(out[:, :, : tq - tk] == 0)


def test_causal_attention_skips_the_tiles_entirely_in_the_future(monkeypatch):
    computed = []
    scores = flash_module.Tiles.scores

    def counting(self, qi, kj, i, j, fn_bias=None):
        computed.append((i, j))
        return scores(self, qi, kj, i, j, fn_bias)

    monkeypatch.setattr(flash_module.Tiles, "scores", counting)
    q, k, v = _qkv(1, 1, 8, 8, 4)
    flash_attention(q, k, v, causal=True, q_tile=2, k_tile=2).sum().backward()
    visible = [(i, j) for i in range(4) for j in range(i + 1)]  # 10 of the 16 tiles
    assert sorted(computed) == sorted(visible * 2)  # once forward, once backward


def test_key_padding_mask_matches_equation_one_and_is_sliced_not_expanded():
    q, k, v = _qkv(3, 2, 6, 10, 4)
    padding = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    padding[1, ..., 7:] = False
    padding[2, ..., 3:] = False
    _assert_same(q, k, v, dict(mask=padding, q_tile=4, k_tile=3), mask=padding)
    tile = flash_module._tile_of(padding, 4, 6, 3, 6)
    assert tile.shape == (3, 1, 1, 3) and tile.data_ptr() == padding[..., 3:].data_ptr()  # a view


@pytest.mark.parametrize("causal", [False, True])
def test_general_mask_with_rows_that_see_nothing_gives_zeros_and_zero_gradients(causal):
    q, k, v = _qkv(2, 3, 9, 9, 4)
    mask = torch.rand(2, 3, 9, 9, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[0, 1, 2] = False
    mask[1, :, 7] = False
    explicit_mask = mask & _future_hidden(9, 9) if causal else mask
    out = _assert_same(q, k, v, dict(mask=mask, causal=causal, q_tile=4, k_tile=2), mask=explicit_mask)
    assert torch.all(out[0, 1, 2] == 0) and torch.all(out[1, :, 7] == 0)
    q.grad = None
    flash_attention(q, k, v, mask=mask, causal=causal, q_tile=4, k_tile=2).sum().backward()
    assert not torch.isnan(q.grad).any()
    assert torch.all(q.grad[0, 1, 2] == 0) and torch.all(q.grad[1, :, 7] == 0)


def test_every_key_masked_gives_zeros_not_nan():
    q, k, v = _qkv(1, 2, 4, 5, 3)
    mask = torch.zeros(1, 1, 1, 5, dtype=torch.bool)
    out = flash_attention(q, k, v, mask=mask, q_tile=2, k_tile=2)
    out.sum().backward()
    assert torch.all(out == 0)
    for x in (q, k, v):
        assert torch.all(x.grad == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_bias_computed_per_tile_equals_equation_one_with_the_whole_bias(causal):
    b, h, tq, tk = 2, 4, 7, 10
    alibi = AlibiPositions(h)
    offset = tk - tq if causal else 0  # the queries are the last tq positions

    def bias(q_index, k_index):
        return alibi.bias(q_index + offset, k_index, causal)

    whole = bias(torch.arange(tq), torch.arange(tk))[None]
    q, k, v = _qkv(b, h, tq, tk, 4)
    mask = _future_hidden(tq, tk) if causal else None
    _assert_same(q, k, v, dict(bias=bias, causal=causal, q_tile=3, k_tile=4), mask=mask, bias=whole)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_t5_bias_and_the_gradient_of_its_table_equal_autograd_of_equation_one(causal, dtype):
    b, h, n = 2, 3, 11
    t5 = T5Positions(h, num_buckets=8, max_distance=6).to(dtype)

    def bias(q_index, k_index):
        return t5.bias(q_index, k_index, causal)

    whole = bias(torch.arange(n), torch.arange(n))[None]
    q, k, v = _qkv(b, h, n, n, 4, dtype)
    mask = _future_hidden(n, n) if causal else None
    tol = (1e-12, 1e-10) if dtype == torch.float64 else (1e-5, 1e-5)
    _assert_same(q, k, v, dict(bias=bias, bias_params=(t5.weight,), causal=causal, q_tile=4, k_tile=3),
                 mask=mask, bias=whole, scale=1.0, leaves=(t5.weight,), atol=tol[0], rtol=tol[1])


def test_t5_table_gets_its_gradient_through_backward():
    t5 = T5Positions(2, num_buckets=8, max_distance=6).double()
    q, k, v = _qkv(1, 2, 6, 6, 4)
    flash_attention(q, k, v, bias=lambda qi, ki: t5.bias(qi, ki, False), bias_params=(t5.weight,),
                    q_tile=4, k_tile=4).sum().backward()
    assert t5.weight.grad is not None and t5.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", [(2, 3, 6, 8), (1, 3, 6, 8), (2, 1, 1, 8), (3, 6, 8)])
def test_tensor_bias_gets_its_gradient_reduced_to_its_own_shape(shape):
    q, k, v = _qkv(2, 3, 6, 8, 4)
    bias = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    explicit_bias = bias.reshape((1,) * (4 - bias.dim()) + shape)
    _assert_same(q, k, v, dict(bias=bias, q_tile=4, k_tile=3), bias=explicit_bias, leaves=(bias,))


def test_rotated_queries_and_keys_still_match_equation_one():
    q, k, v = _qkv(2, 2, 9, 9, 8)
    cos, sin = RotaryPositions(8).angles(torch.arange(9))
    q_rot, k_rot = (x * cos.double() + rotate_half(x) * sin.double() for x in (q, k))
    flash = flash_attention(q_rot, k_rot, v, causal=True, q_tile=4, k_tile=4)
    explicit, _ = _explicit_attention(q_rot, k_rot, v, _future_hidden(9, 9), 0.0)
    torch.testing.assert_close(flash, explicit)
    d_out = torch.randn_like(flash)
    flash_grads = torch.autograd.grad(flash, (q, k, v), d_out, retain_graph=True)  # the rotation is shared
    for got, want in zip(flash_grads, torch.autograd.grad(explicit, (q, k, v), d_out)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_equals_equation_one_with_the_regenerated_masks(causal):
    b, h, tq, tk, p, qt, kt = 2, 3, 9, 11, 0.3, 4, 3
    q, k, v = _qkv(b, h, tq, tk, 4)
    torch.manual_seed(7)
    flash = flash_attention(q, k, v, causal=causal, dropout_p=p, q_tile=qt, k_tile=kt)
    torch.manual_seed(7)
    keep = dropout_keep_mask(draw_dropout_seed(), b, h, tq, tk, p, qt, kt)
    mask = _future_hidden(tq, tk) if causal else None
    _, weights = _explicit_attention(q, k, v, mask, 0.0)
    explicit = (weights * keep / (1 - p)) @ v
    torch.testing.assert_close(flash, explicit)
    d_out = torch.randn_like(flash)
    for got, want in zip(torch.autograd.grad(flash, (q, k, v), d_out), torch.autograd.grad(explicit, (q, k, v), d_out)):
        torch.testing.assert_close(got, want)


def test_dropout_keeps_about_one_minus_p_and_draws_new_masks_each_call():
    keep = dropout_keep_mask(draw_dropout_seed(), 2, 4, 100, 100, 0.25, 32, 48)
    assert keep.shape == (2, 4, 100, 100)
    assert abs(keep.float().mean().item() - 0.75) < 0.01  # 80,000 draws: the standard error is 0.0015
    q, k, v = _qkv(1, 2, 6, 6, 4)
    with torch.no_grad():
        first, second = (flash_attention(q, k, v, dropout_p=0.5, q_tile=4, k_tile=4) for _ in range(2))
    assert not torch.equal(first, second)


def test_dropout_of_one_drops_everything():
    q, k, v = _qkv(1, 2, 6, 6, 4)
    out = flash_attention(q, k, v, dropout_p=1.0, q_tile=4, k_tile=4)
    assert torch.all(out == 0)


def test_inference_under_no_grad_equals_equation_one_and_builds_no_graph():
    q, k, v = _qkv(2, 2, 7, 9, 4)
    with torch.no_grad():
        out = flash_attention(q, k, v, q_tile=3, k_tile=4)
        explicit, _ = _explicit_attention(q, k, v, None, 0.0)
    assert out.grad_fn is None
    torch.testing.assert_close(out, explicit)


def test_bfloat16_runs_and_stays_close_to_float32():
    q, k, v = _qkv(1, 2, 40, 40, 16, torch.float32)
    reference = flash_attention(q, k, v, causal=True, q_tile=16, k_tile=16)
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    out = flash_attention(*low, causal=True, q_tile=16, k_tile=16)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and low[0].grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name, value", [("q_tile", 0), ("k_tile", -3), ("q_tile", 2.5)])
def test_tile_sizes_below_one_are_refused_naming_the_setting(name, value):
    q, k, v = _qkv(1, 1, 4, 4, 2)
    with pytest.raises(AtencionError, match=f"model.attention.{name}"):
        flash_attention(q, k, v, **{name: value})


MEMORY_SCRIPT = """
import json, torch
torch.set_num_threads(1)
from atencion.nn.attention import _explicit_attention
from atencion.nn.kinds.flash import flash_attention
from atencion.viz.table1 import measure_peak_memory

def step(kind, n):
    q, k, v = (torch.randn(1, 1, n, 64, requires_grad=True) for _ in range(3))
    if kind == "flash":
        out = flash_attention(q, k, v, q_tile=256, k_tile=256)
    else:
        out = _explicit_attention(q, k, v, None, 0.0)[0]
    out.sum().backward()

step("flash", 300), step("explicit", 300)  # load the code of every kernel before measuring
print(json.dumps({f"{kind} {n}": measure_peak_memory(lambda: step(kind, n))
                  for kind, n in (("flash", 2048), ("flash", 8192), ("explicit", 8192))}))
"""


@pytest.mark.skipif(not can_measure_memory(), reason="peak memory needs Linux /proc/self/clear_refs")
def test_peak_memory_grows_linearly_with_length_not_quadratically():
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    # Four times the length: ×16 for the n × n matrices of eq. (1), ×4 for what is O(n).
    assert peaks["flash 8192"] < 6 * peaks["flash 2048"], peaks
    assert peaks["flash 8192"] < peaks["explicit 8192"] / 4, peaks
    assert peaks["explicit 8192"] > 2 * 8192 ** 2 * 4, peaks  # the reference did hold n × n floats
