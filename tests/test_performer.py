"""Performer's FAVOR+ (Choromanski et al. 2021): eq. (1) through positive orthogonal random features."""

import math

import pytest
import torch
from safetensors.torch import load, save
from torch.overrides import TorchFunctionMode

from atencion.errors import AtencionError
from atencion.nn.attention import _explicit_attention, causal_mask
from atencion.nn.kinds import performer
from atencion.nn.kinds.performer import PerformerFeatures, PerformerState, performer_attention, performer_step


def _qkv(b=2, h=2, tq=70, tk=70, d=8, seed=0, dtype=torch.float64, norm=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple((norm * torch.randn(b, h, t, d, generator=g, dtype=dtype)).requires_grad_() for t in (tq, tk, tk))


def _quadratic_form(q, k, v, omega, mask, scale):
    """The written-out kernel attention: φ(x) = exp(ωx − |x|²/2)/√m, weights φ(Q) φ(K)ᵀ where allowed,
    normalised by their row sum (no stabiliser: moderate inputs in float64)."""
    def phi(x):
        x = x * scale ** 0.5
        return torch.exp(x @ omega.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(omega.size(0))
    weights = (phi(q) @ phi(k).transpose(-1, -2)).masked_fill(~mask, 0.0)
    total = weights.sum(-1, keepdim=True)
    weights = weights / total.masked_fill(total == 0, 1.0)  # a query without keys: zero weights
    return weights @ v, weights


def _key_padding(b, n, real):
    mask = torch.zeros(b, 1, 1, n, dtype=torch.bool)
    for row, (start, stop) in enumerate(real):
        mask[row, ..., start:stop] = True
    return mask


def test_the_estimate_converges_to_equation_one_as_features_grow():
    counts, seeds = (16, 64, 256, 1024), range(6)
    errors = []
    for m in counts:
        error = 0.0
        for seed in seeds:
            q, k, v = _qkv(b=1, h=2, tq=48, tk=48, d=16, seed=seed, norm=0.6)
            out, _ = performer_attention(q, k, v, PerformerFeatures(16, m, seed=seed).double())
            exact, _ = _explicit_attention(q, k, v, None, 0.0)
            error += ((out - exact).norm(dim=-1) / exact.norm(dim=-1)).mean().item() / len(seeds)
        errors.append(error)
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.15 and errors[-1] < errors[0] / 3, errors


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_len", [300, 170])
def test_linear_form_equals_its_quadratic_form_in_values_and_gradients(causal, q_len, monkeypatch):
    monkeypatch.setattr(performer, "SPAN", 128)  # the bidirectional sums in three spans, the last one short
    q, k, v = _qkv(tq=q_len, tk=300)  # three chunks of the causal prefix sums
    mask = _key_padding(2, 300, [(0, 300), (20, 261)])  # the second row's first 20 keys: a padded prefix
    features = PerformerFeatures(8, 24, seed=1).double()
    out, weights = performer_attention(q, k, v, features, causal=causal, mask=mask, need_weights=True)
    allowed = mask & causal_mask(q_len, 300 - q_len) if causal else mask
    expected, expected_weights = _quadratic_form(q, k, v, features.omega.double(), allowed, 8 ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(weights, expected_weights, atol=1e-12, rtol=1e-10)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_step_by_step_decoding_equals_the_causal_full_pass():
    q, k, v = (x.detach() for x in _qkv(tq=150, tk=150, dtype=torch.float32))
    features = PerformerFeatures(8, 32, seed=2)
    full, _ = performer_attention(q, k, v, features, causal=True)
    for sizes in ([1] * 150, [5, 1, 130, 14]):  # one position at a time; and a prompt, then steps, across chunks
        state, outputs, start = PerformerState(), [], 0
        for size in sizes:
            stop = start + size
            outputs.append(performer_step(q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :],
                                          features, state))
            start = stop
        assert state.length == 150
        torch.testing.assert_close(torch.cat(outputs, dim=-2), full, atol=1e-5, rtol=1e-5)


def test_no_causal_output_depends_on_a_later_key_even_through_rounding():
    q, k, v = (x.detach() for x in _qkv(tq=300, tk=300, dtype=torch.float32))
    features = PerformerFeatures(8, 32, seed=3)
    out, _ = performer_attention(q, k, v, features, causal=True)
    k2, v2 = k.clone(), v.clone()
    # later keys at the features' largest exponent (x = ωᵢ): a maximum shared with them would rescale the rest
    k2[..., 140:, :] = features.omega[features.omega.norm(dim=1).argmax()] * 8 ** 0.25
    v2[..., 140:, :] *= 30
    again, _ = performer_attention(q, k2, v2, features, causal=True)
    torch.testing.assert_close(again[..., :140, :], out[..., :140, :], atol=0, rtol=0)
    assert torch.isfinite(again).all()


@pytest.mark.parametrize("causal", [False, True])
def test_masked_keys_have_no_effect_and_a_query_without_keys_gets_zeros(causal):
    q, k, v = (x.detach() for x in _qkv(tq=70, dtype=torch.float32))
    mask = _key_padding(2, 70, [(0, 50), (0, 0)])  # the second row has no real key at all
    features = PerformerFeatures(8, 32, seed=4)
    out, weights = performer_attention(q, k, v, features, causal=causal, mask=mask, need_weights=True)
    k2, v2 = k.clone(), v.clone()
    k2[..., 50:, :] = 1e3 * torch.randn(2, 2, 20, 8)
    v2[..., 50:, :] = 1e3 * torch.randn(2, 2, 20, 8)
    k2[1], v2[1] = 1e3 * torch.randn(2, 70, 8), 1e3 * torch.randn(2, 70, 8)
    again, _ = performer_attention(q, k2, v2, features, causal=causal, mask=mask)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    assert torch.all(weights[0, ..., 50:] == 0) and torch.all(weights[1] == 0)
    assert torch.all(out[1] == 0)


def test_feature_rows_are_orthogonal_within_a_block_with_chi_distributed_norms():
    omega = PerformerFeatures(16, 40, seed=5).omega.double()  # blocks of 16, 16 and 8 rows
    norms = omega.norm(dim=1)
    for block in (omega[:16], omega[16:32], omega[32:]):
        unit = block / block.norm(dim=1, keepdim=True)
        torch.testing.assert_close(unit @ unit.T, torch.eye(len(block), dtype=torch.float64), atol=1e-6, rtol=0)
    assert not torch.allclose(norms, norms[0].expand_as(norms))  # rescaled per row, not a common norm
    many = PerformerFeatures(16, 4096, seed=6).omega.double().norm(dim=1)
    mean_chi = math.sqrt(2) * math.exp(math.lgamma(8.5) - math.lgamma(8))  # E|x| for x ~ N(0, I_16)
    assert abs(many.mean().item() - mean_chi) < 0.05


def test_fixed_features_are_reproducible_from_the_seed_and_survive_save_and_load():
    q, k, v = (x.detach() for x in _qkv(dtype=torch.float32))
    features = PerformerFeatures(8, 32, seed=7)
    assert torch.equal(features.omega, PerformerFeatures(8, 32, seed=7).omega)
    assert not torch.equal(features.omega, PerformerFeatures(8, 32, seed=8).omega)
    out, _ = performer_attention(q, k, v, features, causal=True)
    reloaded = PerformerFeatures(8, 32, seed=99)
    reloaded.load_state_dict(load(save(features.state_dict())))
    again, _ = performer_attention(q, k, v, reloaded, causal=True)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_features_are_redrawn_after_redraw_training_calls_and_never_in_eval():
    q, k, v = _qkv(b=1, h=1, tq=10, tk=10, dtype=torch.float32)
    features = PerformerFeatures(8, 16, redraw=2, seed=9)
    first = features.omega.clone()
    features.eval()
    for _ in range(5):
        performer_attention(q, k, v, features)
    assert torch.equal(features.omega, first)
    features.train()
    performer_attention(q, k, v, features)
    assert torch.equal(features.omega, first)
    out, _ = performer_attention(q, k, v, features)
    out.sum().backward()  # the call's graph keeps the ω it used
    second = features.omega.clone()
    assert not torch.equal(second, first)
    resumed = PerformerFeatures(8, 16, redraw=2, seed=0)  # a run resumed from this point redraws the same
    resumed.load_state_dict(features.state_dict())
    for module in (features, resumed.train()):
        for _ in range(2):
            performer_attention(q, k, v, module)
    assert not torch.equal(features.omega, second)
    assert torch.equal(resumed.omega, features.omega)


class _LargestTensor(TorchFunctionMode):
    """Records the largest number of elements of any tensor a torch function returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(item, torch.Tensor):
                self.largest = max(self.largest, item.numel())
        return result


@pytest.mark.parametrize("causal", [False, True])
def test_no_n_by_n_tensor_is_built_unless_the_weights_are_asked_for(causal):
    n, m, d = 2048, 32, 16
    q, k, v = _qkv(b=1, h=1, tq=n, tk=n, d=d, dtype=torch.float32)
    features = PerformerFeatures(d, m, seed=10)
    saved = []
    with _LargestTensor() as forward, torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t):
        out, _ = performer_attention(q, k, v, features, causal=causal)
    out.sum().backward()
    assert forward.largest <= n * m and max(saved) <= n * m  # the features φ(Q), φ(K): n × m
    with _LargestTensor() as asked:
        performer_attention(q, k, v, features, causal=causal, need_weights=True)
    assert asked.largest >= n * n  # the recorder sees an n × n tensor when one is built


def test_masks_that_differ_by_query_and_too_few_causal_keys_are_refused():
    q, k, v = _qkv(tq=6, tk=6)
    features = PerformerFeatures(8, 16)
    with pytest.raises(AtencionError, match="key-padding mask"):
        performer_attention(q, k, v, features, mask=causal_mask(6))
    with pytest.raises(AtencionError, match="at least as many keys as queries"):
        performer_attention(q, k[..., :4, :], v[..., :4, :], features, causal=True)


@pytest.mark.parametrize("setting, value, message", [
    ("features", 0, "model.attention.features must be an integer >= 1, got 0"),
    ("redraw", -1, "model.attention.redraw must be an integer >= 0, got -1"),
])
def test_bad_settings_are_refused_naming_the_setting(setting, value, message):
    with pytest.raises(AtencionError, match=message):
        PerformerFeatures(**{"d_k": 8, "features": 16} | {setting: value})
