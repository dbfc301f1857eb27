"""Linformer (Wang et al. 2020): eq. (1) over keys and values projected along the length by E and F."""

import math

import pytest
import torch
from torch import nn

from atencion.errors import AtencionError
from atencion.nn.attention import _explicit_attention
from atencion.nn.kinds.linformer import LinformerProjection, linformer_attention


def _qkv(b=2, h=3, tq=6, tk=6, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, t, d, generator=g, dtype=dtype).requires_grad_() for t in (tq, tk, tk))


def _reference(q, k, v, e, f, scale):
    """Eq. (7) written out: softmax(Q (E K)ᵀ · scale) (F V), E and F (h, p, n) or (p, n)."""
    pattern = "hpn,bhnd->bhpd" if e.dim() == 3 else "pn,bhnd->bhpd"
    ek, fv = torch.einsum(pattern, e, k), torch.einsum(pattern, f, v)
    return torch.softmax(q @ ek.transpose(-1, -2) * scale, dim=-1) @ fv


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv"])
def test_identity_projections_give_equation_one_in_values_and_gradients(sharing):
    q, k, v = _qkv(dtype=torch.float64)
    n = k.size(-2)
    projection = LinformerProjection(3, n, n, sharing).double()
    with torch.no_grad():
        for p in projection.parameters():
            p.copy_(torch.eye(n, dtype=torch.float64).expand_as(p))
    out, weights = linformer_attention(q, k, v, projection, need_weights=True)
    expected, expected_weights = _explicit_attention(q, k, v, None, 0.0)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(weights, expected_weights, atol=1e-12, rtol=1e-12)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_sharing_options_have_the_papers_parameter_shapes():
    shapes = {sharing: {name: tuple(p.shape) for name, p in LinformerProjection(4, 32, 8, sharing).named_parameters()}
              for sharing in ("none", "headwise", "kv", "layerwise")}
    assert shapes["none"] == {"E": (4, 8, 32), "F": (4, 8, 32)}
    assert shapes["headwise"] == {"E": (8, 32), "F": (8, 32)}
    assert shapes["kv"] == {"E": (8, 32)}
    assert shapes["layerwise"] == {"E": (8, 32)}


def test_kv_sharing_projects_keys_and_values_with_the_same_matrix():
    q, k, v = _qkv()
    projection = LinformerProjection(3, 10, 4, "kv")
    out, _ = linformer_attention(q, k, v, projection)
    e = projection.E[:, :6]
    torch.testing.assert_close(out, _reference(q, k, v, e, e, 1 / math.sqrt(8)), atol=1e-6, rtol=1e-5)


def test_layerwise_sharing_is_one_tensor_for_every_layer():
    shared = LinformerProjection(3, 6, 4, "layerwise")
    layers = nn.ModuleList(nn.ModuleDict({"projection": shared}) for _ in range(2))
    assert layers[0]["projection"].E is layers[1]["projection"].E
    assert [name for name, _ in layers.named_parameters()] == ["0.projection.E"]
    q, k, v = _qkv()
    first, _ = linformer_attention(q, k, v, layers[0]["projection"])
    second, _ = linformer_attention(first, first, first, layers[1]["projection"])
    second.sum().backward()
    e = shared.E.detach().clone().requires_grad_()
    again = _reference(q, k, v, e, e, 1 / math.sqrt(8))
    _reference(again, again, again, e, e, 1 / math.sqrt(8)).sum().backward()
    torch.testing.assert_close(shared.E.grad, e.grad, atol=1e-5, rtol=1e-5)  # both layers' gradients, summed


@pytest.mark.parametrize("sharing", ["none", "headwise"])
def test_gradients_reach_e_and_f_as_autograd_of_the_written_out_equation(sharing):
    q, k, v = _qkv(tk=5, dtype=torch.float64)
    projection = LinformerProjection(3, 9, 4, sharing).double()
    out, _ = linformer_attention(q, k, v, projection, scale=0.3)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (projection.E, projection.F, q, k, v), grad_out)
    e = projection.E.detach().clone().requires_grad_()
    f = projection.F.detach().clone().requires_grad_()
    expected = _reference(q, k, v, e[..., :5], f[..., :5], 0.3)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    want = torch.autograd.grad(expected, (e, f, q, k, v), grad_out)
    assert got[0][..., 5:].abs().max() == 0  # columns past the input's length get no gradient
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_masked_keys_and_values_have_no_effect():
    q, k, v = _qkv(tk=7)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., 4:] = False
    projection = LinformerProjection(3, 7, 3)
    out, _ = linformer_attention(q, k, v, projection, mask)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[1, :, 4:] = 100 * torch.randn(3, 3, 8)
    v2[1, :, 4:] = 100 * torch.randn(3, 3, 8)
    again, _ = linformer_attention(q, k2, v2, projection, mask)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    # and the padding counts as zero keys and values, as the reference implementations pad
    zeroed, _ = linformer_attention(q, k * mask[..., 0, :, None], v * mask[..., 0, :, None], projection)
    torch.testing.assert_close(out, zeroed, atol=1e-6, rtol=1e-5)


def test_a_shorter_input_equals_zero_padding_to_max_len():
    q, k, v = _qkv(tk=5)
    projection = LinformerProjection(3, 12, 4)
    out, _ = linformer_attention(q, k, v, projection)
    pad = torch.zeros(2, 3, 7, 8)
    padded, _ = linformer_attention(q, torch.cat([k, pad], 2), torch.cat([v, pad], 2), projection)
    torch.testing.assert_close(out, padded, atol=1e-6, rtol=1e-5)


def test_an_input_longer_than_max_len_is_refused_naming_both():
    q, k, v = _qkv(tk=9)
    with pytest.raises(AtencionError, match="9 positions.*max_len = 8"):
        linformer_attention(q, k, v, LinformerProjection(3, 8, 4))


def test_causal_linformer_is_refused():
    message = "linformer projects keys along the whole length, so it cannot be causal"
    with pytest.raises(AtencionError, match=message):
        LinformerProjection(3, 8, 4, causal=True)
    q, k, v = _qkv()
    with pytest.raises(AtencionError, match=message):
        linformer_attention(q, k, v, LinformerProjection(3, 8, 4), causal=True)


def test_a_mask_that_differs_by_query_is_refused():
    q, k, v = _qkv()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with pytest.raises(AtencionError, match="key-padding mask"):
        linformer_attention(q, k, v, LinformerProjection(3, 8, 4), causal)


@pytest.mark.parametrize("setting, value, message", [
    ("proj_len", 0, "model.attention.proj_len must be an integer >= 1, got 0"),
    ("max_len", -3, "model.attention.max_len must be an integer >= 1, got -3"),
    ("sharing", "rows", "model.attention.sharing must be one of none, headwise, kv, layerwise; got 'rows'"),
])
def test_bad_settings_are_refused_naming_the_setting(setting, value, message):
    settings = dict(n_heads=2, max_len=8, proj_len=4, sharing="headwise") | {setting: value}
    with pytest.raises(AtencionError, match=message):
        LinformerProjection(**settings)
