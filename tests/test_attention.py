"""Eq. (1) and §3.2.2: scaled dot-product and multi-head attention."""

import math

import pytest
import torch

from atencion.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from atencion.nn.positional import sinusoidal_table


def _qkv(b=2, h=3, tq=5, tk=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, tq, d, generator=g), torch.randn(b, h, tk, d, generator=g),
            torch.randn(b, h, tk, d, generator=g))


def _masks():
    key_pad = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    key_pad[1, ..., 4:] = False
    causal = torch.ones(5, 6, dtype=torch.bool).tril(diagonal=1)[None, None]
    all_masked_row = key_pad & causal
    all_masked_row = all_masked_row.expand(2, 1, 5, 6).clone()
    all_masked_row[0, 0, 2] = False   # a query that may attend to nothing
    return {"none": None, "padding": key_pad, "causal": causal & key_pad, "empty-row": all_masked_row}


def test_explicit_attention_is_equation_one():
    q, k, v = _qkv()
    out, weights = scaled_dot_product_attention(q, k, v, need_weights=True)
    expected_weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    torch.testing.assert_close(weights, expected_weights)
    torch.testing.assert_close(out, expected_weights @ v)


@pytest.mark.parametrize("mask_name", list(_masks()))
def test_fast_path_equals_explicit_path(mask_name):
    q, k, v = _qkv()
    mask = _masks()[mask_name]
    fast, none = scaled_dot_product_attention(q, k, v, mask)
    explicit, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert none is None
    torch.testing.assert_close(fast, explicit, atol=1e-6, rtol=1e-5)


def test_masked_keys_get_exactly_zero_weight_and_rows_sum_to_one():
    q, k, v = _qkv()
    mask = _masks()["causal"]
    _, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert torch.all(weights.masked_select(~mask.expand_as(weights)) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


def test_query_with_every_key_masked_gives_zeros_not_nan():
    q, k, v = _qkv()
    mask = _masks()["empty-row"]
    for need_weights in (False, True):
        out, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
        assert not torch.isnan(out).any()
        assert torch.all(out[0, :, 2] == 0)
        if weights is not None:
            assert torch.all(weights[0, :, 2] == 0)


def test_scaling_keeps_logit_variance_near_one():
    """§3.2.1: q·k of unit-variance vectors has variance d_k; dividing by √d_k brings it to 1."""
    g = torch.Generator().manual_seed(0)
    d_k = 256
    q, k = torch.randn(20000, d_k, generator=g), torch.randn(20000, d_k, generator=g)
    dots = (q * k).sum(-1)
    assert abs(dots.var().item() / d_k - 1) < 0.05
    assert abs((dots / math.sqrt(d_k)).var().item() - 1) < 0.05


def test_self_attention_is_permutation_equivariant_without_positions():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 7, 16)
    perm = torch.randperm(7)
    out, _ = mha(x)
    out_perm, _ = mha(x[:, perm])
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-6, rtol=1e-5)


def test_self_attention_with_positions_is_not_permutation_equivariant():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 7, 16)
    pe = sinusoidal_table(7, 16)[None]
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    out, _ = mha(x + pe)
    out_perm, _ = mha(x[:, perm] + pe)
    assert (out_perm - out[:, perm]).abs().max() > 1e-2


def test_multi_head_attention_matches_torch_multihead_attention():
    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 4).eval()
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.in_proj.weight)
        theirs.in_proj_bias.copy_(ours.in_proj.bias)
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 6, 16)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4:] = False
    cross = MultiHeadAttention(16, 4, cross=True).eval()
    cross.load_state_dict(ours.state_dict())
    out, weights = cross(x, memory, mask=keep[:, None, None, :], need_weights=True)
    expected, expected_weights = theirs(x, memory, memory, key_padding_mask=~keep, average_attn_weights=False)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad_mask, message", [
    (torch.ones(2, 1, 1, 7, dtype=torch.bool), "keys=6"),
    (torch.ones(2, 6, dtype=torch.bool), "4 dimensions"),
    (torch.ones(2, 1, 1, 6), "torch.bool"),
])
def test_mask_of_wrong_shape_or_dtype_is_refused(bad_mask, message):
    from atencion.nn.attention import check_mask
    with pytest.raises(ValueError, match=message):
        check_mask(bad_mask, "src_mask", 2, 1, 6)
