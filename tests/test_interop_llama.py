"""Hugging Face's Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) ↔ atencion:
the same logits, bit-identical round trips, greedy generation through atencion's cache equal to
theirs, over random models that exercise grouped-query attention (2 and 1 key/value heads of 8),
SwiGLU and GEGLU, RoPE scaling (linear, llama3), Qwen2's q/k/v biases and Mistral's sliding window
shorter than the input; and refusals naming the key."""

import pytest
import torch

from atencion.errors import AtencionError

transformers = pytest.importorskip("transformers")

from atencion.decode.sample import generate_ids  # noqa: E402
from atencion.interop import from_hf, to_hf  # noqa: E402
from atencion.interop.llama import config_from_llama  # noqa: E402

VOCAB, LENGTH = 97, 24
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _config(family: str = "llama", **overrides):
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    values.update(overrides)
    return getattr(transformers, {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}[family])(
        **values)


def _hf(family: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cls = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    hf = getattr(transformers, cls)(_config(family, **overrides)).eval()
    with torch.no_grad():  # move every parameter (RMSNorm gains start at 1, biases at 0)
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf


def _ids(batch: int = 2, length: int = LENGTH):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(3))


def _logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids).logits


# the members and settings each test runs on: (family, HF config overrides)
CASES = {
    "llama-gqa-2-of-8": ("llama", {}),
    "llama-multi-query": ("llama", dict(num_key_value_heads=1)),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})),
    "llama-rope-llama3": ("llama", dict(rope_parameters=LLAMA3, tie_word_embeddings=True)),
    "llama-biases-geglu": ("llama", dict(attention_bias=True, mlp_bias=True, hidden_act="gelu")),
    "mistral-window-7": ("mistral", dict(sliding_window=7)),
    "mistral-no-window": ("mistral", dict(sliding_window=None, num_key_value_heads=8)),
    "qwen2-biases": ("qwen2", dict(num_key_value_heads=1)),
    "qwen2-window-5": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    family, overrides = CASES[request.param]
    hf = _hf(family, **overrides)
    return family, hf, from_hf(hf)


def test_from_hf_gives_hugging_faces_logits(case):
    _, hf, model = case
    ids = _ids()
    assert not model.training
    assert (model(ids) - _logits(hf, ids)).abs().max() <= 1e-4


def test_decoding_with_atencions_cache_gives_hugging_faces_logits(case):
    _, hf, model = case
    ids = _ids()
    with torch.no_grad():
        state = model.init_state()
        steps = [model.decode_step(ids[:, :6], state)] + [model.decode_step(ids[:, t:t + 1], state)
                                                           for t in range(6, LENGTH)]
    assert (torch.cat(steps, 1) - _logits(hf, ids)).abs().max() <= 1e-4


def test_greedy_generation_with_the_cache_gives_hugging_faces_tokens(case):
    _, hf, model = case
    prompt = _ids(batch=2, length=4)
    eos = model.cfg.eos_id
    ours = generate_ids(model, prompt, 20, temperature=0.0, stop_id=eos)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20,
                             eos_token_id=eos, pad_token_id=eos)[:, prompt.size(1):]
    assert torch.equal(ours, theirs[:, :ours.size(1)]) and ours.size(1) == theirs.size(1)


def test_the_round_trip_gives_back_every_tensor_bit_for_bit(case):
    family, hf, model = case
    back = to_hf(model, family)  # a Mistral without a window is a Llama, which to_hf(model) gives
    assert type(back) is type(hf)
    theirs, ours = hf.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys()
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    for key in ("num_key_value_heads", "hidden_act", "tie_word_embeddings", "sliding_window"):
        assert getattr(back.config, key, None) == getattr(hf.config, key, None), key
    assert back.config.rope_parameters == hf.config.rope_parameters


def test_the_members_settings_become_atencions_keys():
    cfg = config_from_llama(_config("mistral", sliding_window=7))
    assert (cfg.arch, cfg.norm, cfg.positional, cfg.activation, cfg.n_kv_heads) == ("decoder", "rmsnorm", "rope",
                                                                                     "swiglu", 2)
    assert cfg.attention == {"kind": "window", "window": 7} and not cfg.bias and not cfg.qkv_bias
    qwen = config_from_llama(_config("qwen2"))
    assert (qwen.bias, qwen.qkv_bias, qwen.attention) == (False, True, None)
    llama3 = config_from_llama(_config(rope_parameters=LLAMA3))
    assert (llama3.rope_base, llama3.rope_scaling) == (500000.0, {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})


def test_the_older_rope_theta_and_rope_scaling_keys_are_read_too():
    """config.json files written before transformers 5 spell RoPE as rope_theta and rope_scaling."""
    from types import SimpleNamespace

    new = _config(rope_parameters={"rope_type": "linear", "rope_theta": 2e5, "factor": 2.0})
    old = SimpleNamespace(**{k: v for k, v in new.to_dict().items() if k != "rope_parameters"},
                          rope_theta=2e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert config_from_llama(old) == config_from_llama(new)
    assert config_from_llama(_config(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=2e5)) == \
        config_from_llama(new)


def test_to_hf_picks_the_member_a_decoder_is():
    from atencion import ModelConfig, Transformer

    base = ModelConfig.preset("llama-tiny", vocab_size=VOCAB)
    for overrides, cls in [({}, "LlamaForCausalLM"), ({"attention": {"kind": "window", "window": 8}},
                                                      "MistralForCausalLM"),
                           ({"qkv_bias": True}, "Qwen2ForCausalLM")]:
        model = Transformer(ModelConfig(**{**base.to_dict(), **overrides})).eval()
        hf = to_hf(model)
        assert type(hf).__name__ == cls
        ids = _ids()
        assert (_logits(hf, ids) - model(ids)).abs().max() <= 1e-4, cls


@pytest.mark.parametrize("family, overrides, key", [
    ("llama", dict(attention_bias=True, mlp_bias=False), "attention_bias"),
    ("llama", dict(hidden_act="relu"), "hidden_act"),
    ("llama", dict(head_dim=16), "head_dim"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_type"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "sliding window on 1 of 2"),
])
def test_what_atencion_cannot_reproduce_is_refused_naming_the_key(family, overrides, key):
    with pytest.raises(AtencionError, match=key):
        config_from_llama(_config(family, **overrides))


@pytest.mark.parametrize("family, overrides, key", [
    ("llama", dict(attention={"kind": "window", "window": 4}), "attention.kind window"),
    ("llama", dict(activation="gelu"), "activation='gelu'"),
    ("llama", dict(qkv_bias=True), "qkv_bias=True"),
    ("mistral", dict(bias=True), "bias=True"),
    ("qwen2", dict(positional="learned"), "positional='learned'"),
])
def test_to_hf_refuses_what_the_member_cannot_express(family, overrides, key):
    from atencion import ModelConfig, Transformer

    model = Transformer(ModelConfig(**{**ModelConfig.preset("llama-tiny", vocab_size=VOCAB).to_dict(), **overrides}))
    with pytest.raises(AtencionError, match=key):
        to_hf(model, family)
