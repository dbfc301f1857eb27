"""Hugging Face GPT-NeoX (full rotary, sequential residual) ↔ atencion: the same logits, KV-cache
decoding, the fused per-head QKV layout, and refusals."""

import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError

transformers = pytest.importorskip("transformers")

from atencion.interop.neox import config_from_neox, from_neox, to_neox  # noqa: E402


def _config(**overrides):
    values = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, hidden_act="gelu", max_position_embeddings=64,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
                  use_parallel_residual=False, hidden_dropout=0.1, attention_dropout=0.1)
    values.update(overrides)
    return transformers.GPTNeoXConfig(**values)


@pytest.fixture(scope="module")
def neox():
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(_config()).eval()
    with torch.no_grad():  # move every parameter (LayerNorms start at 1 and 0, biases at 0)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


def _ids():
    return torch.randint(0, 99, (3, 17), generator=torch.Generator().manual_seed(3))


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids).logits


def test_config(neox):
    cfg = config_from_neox(neox.config)
    assert (cfg.arch, cfg.positional, cfg.rope_base, cfg.activation) == ("decoder", "rope", 500.0, "gelu")
    assert cfg.norm_first and cfg.bias and not cfg.tie_output and not cfg.scale_embedding
    assert (cfg.pad_id, cfg.bos_id, cfg.eos_id) == (2, 0, 2)  # no NeoX pad: EOS pads


def test_from_neox_gives_the_same_logits(neox):
    model = from_neox(neox)
    assert not model.training
    ids = _ids()
    expected = _hf_logits(neox, ids)
    with torch.no_grad():
        ours = model(ids)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max() <= 1e-4
    assert model.generator.weight is not model.decoder.embed.weight
    assert torch.equal(model.generator.weight, neox.get_output_embeddings().weight)


def test_the_fused_qkv_is_reordered_per_head(neox):
    """Head 1's keys are rows [d_k·3 + d_k, d_k·3 + 2·d_k) of NeoX's fused matrix; atencion's
    keys of head 1 are rows d_model + [d_k, 2·d_k)."""
    model = from_neox(neox)
    d, dk = 64, 16
    fused = neox.gpt_neox.layers[0].attention.query_key_value.weight
    ours = model.decoder.layers[0].self_attn.in_proj.weight
    assert torch.equal(ours[d + dk:d + 2 * dk], fused[3 * dk + dk:3 * dk + 2 * dk])


def test_kv_cache_decoding_equals_hugging_face_full_logits(neox):
    model = from_neox(neox)
    ids = _ids()
    with torch.no_grad():
        state = model.init_state()
        prefix = model.decode_step(ids[:, :5], state)  # a prompt at once, then a token at a time
        steps = [prefix] + [model.decode_step(ids[:, t:t + 1], state) for t in range(5, ids.size(1))]
    assert state.offset == ids.size(1)
    assert (torch.cat(steps, dim=1) - _hf_logits(neox, ids)).abs().max() <= 1e-4


def test_to_neox_round_trip(neox):
    back = to_neox(from_neox(neox))
    assert not back.config.use_parallel_residual
    assert back.config.rope_parameters["partial_rotary_factor"] == 1.0
    theirs = neox.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    ids = _ids()
    assert (_hf_logits(back, ids) - _hf_logits(neox, ids)).abs().max() <= 1e-4


def test_tied_output_is_imported_and_exported():
    torch.manual_seed(2)
    hf = transformers.GPTNeoXForCausalLM(_config(tie_word_embeddings=True, hidden_act="gelu_new")).eval()
    model = from_neox(hf)
    assert model.cfg.tie_output and model.cfg.activation == "gelu-tanh"
    assert model.generator.weight is model.decoder.embed.weight
    ids = _ids()
    with torch.no_grad():
        assert (model(ids) - _hf_logits(hf, ids)).abs().max() <= 1e-4
    assert (_hf_logits(to_neox(model), ids) - _hf_logits(hf, ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("overrides, key", [
    (dict(use_parallel_residual=True), "use_parallel_residual"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
     "partial_rotary_factor"),
    (dict(attention_bias=False), "attention_bias"),
    (dict(hidden_act="silu"), "hidden_act"),
])
def test_config_from_neox_refuses_what_atencion_cannot_reproduce(overrides, key):
    with pytest.raises(AtencionError, match=key):
        config_from_neox(_config(**overrides))


@pytest.mark.parametrize("override, key", [
    (dict(positional="learned"), "positional"),
    (dict(norm_first=False), "norm_first"),
    (dict(bias=False), "bias"),
    (dict(scale_embedding=True), "scale_embedding"),
])
def test_to_neox_refuses_what_neox_cannot_express(override, key):
    values = dict(vocab_size=60, arch="decoder", n_layers=1, d_model=32, d_ff=64, n_heads=4, positional="rope",
                  norm_first=True, scale_embedding=False, tie_output=False)
    values.update(override)
    with pytest.raises(AtencionError, match=key):
        to_neox(Transformer(ModelConfig(**values)))
