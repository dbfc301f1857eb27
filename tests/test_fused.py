"""A Llama-style decoder's generation step through all its layers in one call (atencion/nn/fused.py,
matvec.cpp's decoder_step): the logits of the full forward pass and of the layer-by-layer path, the
same greedy tokens, and used exactly where it applies."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from atencion.decode.sample import generate_ids
from atencion.nn import matvec
from atencion.nn.transformer import Transformer
from conftest import small_config

LLAMA = dict(arch="decoder", norm="rmsnorm", norm_first=True, positional="rope", activation="swiglu", bias=False,
             scale_embedding=False, dropout=0.0, d_model=64, d_ff=96, n_heads=4, vocab_size=97)
LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.fixture(autouse=True)
def unmeasured(monkeypatch):
    """The kernels wherever they apply, as with ATENCION_MATVEC=1 (the measured choice: test_kernels.py)."""
    matvec.kernel()
    monkeypatch.setattr(matvec.KERNELS, "policy", "always")


@pytest.fixture(scope="module")
def step_kernel():
    if matvec.kernel() is None or matvec.KERNELS.decoder_step is None:
        pytest.skip("the kernels did not compile here, or without AVX-512 or AVX2: every step goes layer by layer")
    return matvec.KERNELS.decoder_step


def llama(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(small_config(**{**LLAMA, **overrides})).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that a parameter read wrong shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def stepped(model: Transformer, ids: Tensor, prompt: int) -> Tensor:
    """The logits of every position from ``prompt`` on, the prompt read whole and then one token a step."""
    state = model.init_state()
    with torch.no_grad():
        logits = [model.decode_step(ids[:, :prompt], state)[:, -1:]]
        logits += [model.decode_step(ids[:, i:i + 1], state) for i in range(prompt, ids.size(1) - 1)]
    return torch.cat(logits, 1)


def spied(monkeypatch, kernel) -> list:
    calls = []
    monkeypatch.setattr(matvec.KERNELS, "decoder_step", lambda *a: calls.append(a[0].shape) or kernel(*a))
    return calls


@pytest.mark.parametrize("rows", [1, 3, matvec.MAX_ROWS, matvec.MAX_ROWS + 1, matvec.PANEL_ROWS])
@pytest.mark.parametrize("overrides", [{}, dict(n_kv_heads=1), dict(n_kv_heads=2, qkv_bias=True),
                                       dict(bias=True, rope_scaling=LLAMA3), dict(n_layers=3, d_model=128, d_ff=200,
                                                                                  n_heads=2, rope_base=500.0)],
                         ids=["mha", "mqa", "gqa-qwen2-bias", "all-biases-llama3", "d_k-64"])
def test_each_step_gives_the_full_passs_logits_and_the_layer_by_layers(step_kernel, monkeypatch, rows, overrides):
    model = llama(**overrides)
    ids = torch.randint(4, 97, (rows, 75), generator=torch.Generator().manual_seed(rows))
    calls = spied(monkeypatch, step_kernel)
    fused = stepped(model, ids, 5)  # 70 steps: the cache's buffers (room for 64 keys at first) grow once
    assert len(calls) == 69 and calls[0] == (rows, model.cfg.d_model)
    with torch.no_grad():
        full = model(ids[:, :-1])[:, 4:]
    torch.testing.assert_close(fused, full, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("ATENCION_FUSED", "0")
    by_layer = stepped(model, ids, 5)
    assert len(calls) == 69
    torch.testing.assert_close(fused, by_layer, rtol=1e-5, atol=1e-5)


def test_greedy_generation_gives_the_same_tokens_with_and_without_it(step_kernel, monkeypatch):
    model = llama(n_kv_heads=2, n_layers=3)
    prompt = torch.randint(4, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    calls = spied(monkeypatch, step_kernel)
    fused = generate_ids(model, prompt, 40, temperature=0.0)
    assert len(calls) == 39
    monkeypatch.setenv("ATENCION_FUSED", "0")
    assert torch.equal(fused, generate_ids(model, prompt, 40, temperature=0.0))


@pytest.mark.parametrize("rows", [1, 2, 3, matvec.MAX_ROWS, matvec.MAX_ROWS + 1, matvec.PANEL_ROWS])
@pytest.mark.parametrize("overrides", [dict(n_kv_heads=2), dict(bias=True, qkv_bias=True, n_layers=3)],
                         ids=["gqa", "biases"])
def test_an_int8_models_steps_give_the_layer_by_layers_logits(step_kernel, monkeypatch, rows, overrides):
    """nn/quantize.py's int8 weights in the whole-step kernel: the same int32 sums of the same 7-bit
    rows as matvec_int8 and the int8 panels, so each step's logits are the layer-by-layer int8 path's."""
    from atencion.nn.quantize import quantize_int8

    model = quantize_int8(llama(**overrides))
    ids = torch.randint(4, 97, (rows, 40), generator=torch.Generator().manual_seed(rows))
    calls = spied(monkeypatch, step_kernel)
    fused = stepped(model, ids, 5)
    assert len(calls) == 34
    monkeypatch.setenv("ATENCION_FUSED", "0")
    by_layer = stepped(model, ids, 5)
    assert len(calls) == 34
    torch.testing.assert_close(fused, by_layer, rtol=1e-5, atol=1e-5)
    exact = stepped(llama(**overrides), ids, 5)  # and int8 is int8: 2-5% of the float32 logits' spread off them
    assert 0.005 < (fused - exact).abs().mean() / exact.std() < 0.1


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("rows", [1, 3, matvec.PANEL_ROWS])
def test_the_step_gives_the_same_numbers_on_any_number_of_threads(step_kernel, monkeypatch, rows, int8):
    """The step runs in one parallel region, each product split over the threads in equal shares of
    the weight's rows or panels (d_ff 200: 13 panels, shares of 13, 7 + 6 and 5 + 5 + 3): each output is
    summed the same way in any share, so 1, 2 and 3 threads give the same residual stream bit for bit,
    and write the same keys and values."""
    from atencion.nn.quantize import quantize_int8

    model = llama(n_kv_heads=2, n_layers=3, d_model=128, d_ff=200, n_heads=4)
    model = quantize_int8(model) if int8 else model
    calls = []
    monkeypatch.setattr(matvec.KERNELS, "decoder_step", lambda *a: calls.append(a) or step_kernel(*a))
    ids = torch.randint(4, 97, (rows, 12), generator=torch.Generator().manual_seed(rows))
    stepped(model, ids, 5)
    x, layers, keys, values, starts, *rest = calls[-1]
    start = int(starts[0])  # (a batch decoded together: every row at one position)
    outputs, written = [], []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for buffer in keys + values:
                buffer[:, :, start].fill_(float("nan"))  # the new keys and values written again each time
            outputs.append(step_kernel(x, layers, keys, values, starts, *rest))
            written.append(torch.stack([b[:, :, start] for b in keys + values]))
    finally:
        torch.set_num_threads(threads)
    assert not outputs[0].isnan().any() and not written[0].isnan().any()
    for out, new in zip(outputs[1:], written[1:]):
        assert torch.equal(out, outputs[0]) and torch.equal(new, written[0])


def test_speculative_rollback_keeps_the_cache_right(step_kernel, monkeypatch):
    """A state truncated after fused steps (a rejected draft) goes on from the kept positions."""
    model = llama(n_kv_heads=2)
    ids = torch.randint(4, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    calls = spied(monkeypatch, step_kernel)
    state = model.init_state()
    with torch.no_grad():
        model.decode_step(ids[:, :10], state)
        for i in range(10, 20):
            model.decode_step(ids[:, i:i + 1], state)
        state.truncate(15)
        logits = torch.cat([model.decode_step(ids[:, i:i + 1], state) for i in range(15, 29)], 1)
        full = model(ids[:, :29])[:, 15:]
    assert len(calls) == 24
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


def test_it_is_used_only_where_it_applies(step_kernel, monkeypatch):
    from atencion.nn.lora import LoraSpec, apply_lora
    from atencion.nn.quantize import quantize_int8

    calls = spied(monkeypatch, step_kernel)
    ids = torch.randint(4, 97, (2, 9), generator=torch.Generator().manual_seed(0))

    def steps(model, rows=2):
        before = len(calls)
        stepped(model, ids[:1].expand(rows, -1) if rows != 2 else ids, 6)
        return len(calls) - before

    assert steps(llama()) == 2
    assert steps(llama(), rows=matvec.PANEL_ROWS) == 2                         # in panels
    assert steps(llama(), rows=matvec.PANEL_ROWS + 1) == 0                     # more rows: layer by layer
    assert steps(llama(activation="geglu")) == 0                               # not SwiGLU
    assert steps(llama(norm="layernorm")) == 0                                 # LayerNorm
    assert steps(llama(positional="learned")) == 0                             # no RoPE
    assert steps(llama(attention={"kind": "window", "window": 4})) == 0        # Mistral's window: its own cache
    assert steps(llama(norm_first=False)) == 0                                 # post-LN
    training = llama()
    training.train()                                                           # dropout's place: training
    assert steps(training) == 0
    adapted = llama()
    apply_lora(adapted, LoraSpec(rank=2, alpha=4, dropout=0.0, targets=["attention"]), "base", "0" * 64)
    adapted.eval()
    assert steps(adapted) == 0                                                 # LoRA's adapters beside W
    assert steps(quantize_int8(llama())) == 2                                  # int8 weights: the int8 step
    mixed = quantize_int8(llama(n_layers=2))
    mixed.decoder.layers[1] = llama(n_layers=2).decoder.layers[1]
    assert steps(mixed) == 0                                                   # int8 and float32 layers
    monkeypatch.setenv("ATENCION_FUSED", "0")
    assert steps(llama()) == 0


def test_a_beam_and_a_gradient_go_layer_by_layer(step_kernel, monkeypatch):
    calls = spied(monkeypatch, step_kernel)
    model = llama()
    state = model.init_state(group=2)  # a beam's rows share one cache
    with torch.no_grad():
        model.decode_step(torch.randint(4, 97, (2, 5)), state)
        model.decode_step(torch.randint(4, 97, (2, 1)), state)
    state = model.init_state()
    model.decode_step(torch.randint(4, 97, (1, 5)), state)  # weights that need their gradient
    model.decode_step(torch.randint(4, 97, (1, 1)), state).sum().backward()
    assert calls == [] and model.decoder.layers[0].self_attn.in_proj.weight.grad is not None


def test_a_step_given_a_mask_goes_layer_by_layer_and_keeps_it(step_kernel, monkeypatch):
    """The kernel has no mask: a caller of the decoder that hides some cached keys from the new token
    gets the layer-by-layer path, which hides them."""
    calls = spied(monkeypatch, step_kernel)
    model = llama(n_kv_heads=2)
    ids = torch.randint(4, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    hide = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    hide[..., 1:3] = False  # the new token does not see places 1 and 2

    def last_hidden(mask):
        state = model.init_state()
        with torch.no_grad():
            model.decode_step(ids[:, :6], state)
            return model.decoder(ids[:, 6:], None, mask, None, state, first=False)[0]

    masked, unmasked = last_hidden(hide), last_hidden(None)
    assert len(calls) == 1  # the unmasked step only
    with torch.no_grad():
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        causal[6, 1:3] = False
        full = model.decoder(ids, None, causal[None, None], None)[0][:, 6:]
    torch.testing.assert_close(masked, full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(masked, unmasked, atol=1e-3)


def replaced(params, which: str, tensor: Tensor):
    """``params`` (fused.LayerParams) with the tensor ``which`` names ("qkv.weight", "ffn_norm") replaced."""
    name, _, part = which.partition(".")
    return params._replace(**{name: getattr(params, name)._replace(**{part: tensor}) if part else tensor})


@pytest.mark.parametrize("which,shape", [("qkv.weight", (60, 64)), ("gate.weight", (96, 65)),
                                         ("down.weight", (64, 95)), ("qkv.bias", (7,)), ("ffn_norm", (63,))],
                         ids=["W_qkv-rows", "W1-columns", "W2-columns", "qkv-bias", "norm"])
def test_the_kernel_refuses_parameters_of_the_wrong_shape(step_kernel, which, shape):
    """A parameter that does not fit the step's shapes is an error, not a read past its end."""
    from atencion.nn import fused

    model = llama(n_layers=1)
    state = model.init_state()
    with torch.no_grad():
        (params,) = fused.plan(model.decoder, 1)
        model.decode_step(torch.randint(4, 97, (1, 3)), state)
    layers = fused.for_kernel([replaced(params, which, torch.zeros(shape))])
    rooms = [c.room(4) for c in state.self_caches]
    x, cs, starts = torch.zeros(1, 64), torch.zeros(1, 16), torch.full((1,), 3)
    with pytest.raises(RuntimeError, match="decoder_step: (each weight|each bias|RMSNorm)"):
        step_kernel(x, layers, [r[0] for r in rooms], [r[1] for r in rooms], starts, cs, cs, 4, 4, 1e-6, 0.25)


@pytest.mark.parametrize("rows", [1, 3], ids=["rows", "int8-panels"])
@pytest.mark.parametrize("which,shape,dtype", [("qkv.weight", (60, 64), torch.int8),
                                               ("down.weight", (64, 95), torch.int8),
                                               ("qkv.weight", (192, 64), torch.float32),
                                               ("qkv.bias", (7,), torch.float32), ("gate.scales", (95,), torch.float32),
                                               ("down.sums", (96,), torch.int64)],
                         ids=["W_qkv-rows", "W2-columns", "a-float32-weight", "qkv-bias", "scales", "sums"])
def test_the_kernel_refuses_int8_parameters_of_the_wrong_shape(step_kernel, rows, which, shape, dtype):
    from atencion.nn import fused
    from atencion.nn.quantize import quantize_int8

    model = quantize_int8(llama(n_layers=1, bias=True))
    state = model.init_state()
    with torch.no_grad():
        (params,) = fused.plan(model.decoder, rows)
        model.decode_step(torch.randint(4, 97, (rows, 3)), state)
    layers = fused.for_kernel([replaced(params, which, torch.zeros(shape, dtype=dtype))])
    rooms = [c.room(4) for c in state.self_caches]
    x, cs, starts = torch.zeros(rows, 64), torch.zeros(rows, 16), torch.full((rows,), 3)
    with pytest.raises(RuntimeError, match="decoder_step: (each|every) (int8 )?(weight|bias)"):
        step_kernel(x, layers, [r[0] for r in rooms], [r[1] for r in rooms], starts, cs, cs, 4, 4, 1e-6, 0.25)
