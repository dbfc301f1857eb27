"""Today's decoder blocks: the gated feed-forward network (SwiGLU, GEGLU), grouped-query attention
through every attention kind and cache, q/k/v biases, RoPE scaling as the Llama family configures
it, and the presets of real models counted as Hugging Face counts them. Parity of whole models
with Hugging Face's Llama, Mistral and Qwen2 is in test_interop_llama.py."""

from __future__ import annotations

import json

import pytest
import torch

from atencion.config import ModelConfig
from atencion.errors import AtencionError
from atencion.nn.layers import GatedFeedForward
from atencion.nn.model_dir import load_model, save_model
from atencion.nn.transformer import Transformer
from conftest import random_batch, small_config
from test_attention_kinds import CAUSAL_KINDS, KINDS

LLAMA = dict(norm="rmsnorm", norm_first=True, positional="rope", activation="swiglu", bias=False,
             scale_embedding=False, dropout=0.0)


def model_of(arch: str = "decoder", seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(small_config(**{"arch": arch, "dropout": 0.0, "n_heads": 8, **overrides})).eval()


def as_multi_head(model: Transformer) -> Transformer:
    """The model with n_heads key/value heads whose W^K and W^V rows are ``model``'s, each
    key/value head copied to the query heads of its group: what grouped-query attention means."""
    cfg = model.cfg
    twin = Transformer(ModelConfig(**{**cfg.to_dict(), "n_kv_heads": None})).eval()
    h, g, dk = cfg.n_heads, cfg.kv_heads, cfg.d_k
    state = {}
    for name, t in model.state_dict().items():
        if ".self_attn.in_proj." in name:
            q, k, v = t.split([h * dk, g * dk, g * dk])
            k, v = (x.reshape(g, dk, *t.shape[1:]).repeat_interleave(h // g, 0).reshape(h * dk, *t.shape[1:])
                    for x in (k, v))
            t = torch.cat([q, k, v])
        state[name] = t
    twin.load_state_dict(state)
    return twin


def decode_all(model: Transformer, ids: torch.Tensor, prompt: int = 5) -> torch.Tensor:
    state = model.init_state()
    steps = [model.decode_step(ids[:, :prompt], state)]
    steps += [model.decode_step(ids[:, t:t + 1], state) for t in range(prompt, ids.size(1))]
    return torch.cat(steps, 1)


def cache_bytes(state) -> int:
    return sum(c.k.nbytes + c.v.nbytes for c in state.self_caches)


# grouped-query attention --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["encoder-decoder", "encoder", "decoder"])
def test_n_kv_heads_equal_to_n_heads_is_todays_attention_bit_for_bit(tmp_path, arch):
    plain, same = model_of(arch), model_of(arch, n_kv_heads=8)
    assert plain.state_dict().keys() == same.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), same.state_dict().values()))
    src, tgt = random_batch(plain.cfg)
    args = (src, tgt) if arch == "encoder-decoder" else (src,)
    assert torch.equal(plain(*args), same(*args))
    save_model(plain, tmp_path)  # a config.json written before the new keys loads as today's model
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("n_kv_heads", "qkv_bias", "rope_scaling"):
        del saved[key]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert torch.equal(load_model(tmp_path)(*args), plain(*args))


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("kind", [None, *KINDS])
def test_grouped_query_attention_is_multi_head_attention_with_each_kv_head_shared_by_its_group(kind, g):
    arch = "encoder" if kind == "linformer" else "decoder"
    model = model_of(arch, n_kv_heads=g, positional="rope", attention=KINDS.get(kind))
    src, _ = random_batch(model.cfg, batch=2, src_len=11)
    src[:, :] = src[0]
    stack = model.decoder if arch == "decoder" else model.encoder
    assert stack.layers[0].self_attn.in_proj.out_features == (8 + 2 * g) * 4  # [Q (h·d_k); K (g·d_k); V (g·d_k)]
    torch.testing.assert_close(model(src), as_multi_head(model)(src), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("kind", [None, *CAUSAL_KINDS])
def test_decoding_with_a_grouped_cache_equals_the_full_pass_under_every_kind(kind, g):
    model = model_of("decoder", n_kv_heads=g, positional="rope", attention=KINDS.get(kind))
    ids, _ = random_batch(model.cfg, batch=2, src_len=12)
    ids[:, :] = ids[0]
    torch.testing.assert_close(decode_all(model, ids), model(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [None, "window", "performer"])
def test_a_beams_rows_share_a_grouped_cache_and_each_sees_its_own_history(kind):
    model = model_of("encoder-decoder", n_kv_heads=2, attention=KINDS.get(kind))
    src, tgt = random_batch(model.cfg, batch=1, src_len=7, tgt_len=8)
    rows = torch.stack([tgt[0], tgt[0].roll(1)])
    rows[:, 0] = model.cfg.bos_id
    memory, src_mask = model.encode(src)
    state = model.init_state(memory, src_mask, group=2)
    steps = torch.cat([model.decode_step(rows[:, t:t + 1], state) for t in range(8)], 1)
    torch.testing.assert_close(steps, model(src.expand(2, -1), rows), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [None, "window"])
def test_the_kv_cache_of_grouped_query_attention_is_n_heads_over_n_kv_heads_times_smaller(kind):
    """Bytes of the self-attention caches after a 5-token prompt and 20 steps (a window keeps its
    last 3 keys either way)."""
    sizes = {}
    for g in (8, 2, 1):
        model = model_of("decoder", n_kv_heads=g, attention=KINDS.get(kind))
        ids, _ = random_batch(model.cfg, batch=2, src_len=25)
        ids[:, :] = ids[0]
        state = model.init_state()
        with torch.no_grad():
            model.decode_step(ids[:, :5], state)
            for t in range(5, 25):
                model.decode_step(ids[:, t:t + 1], state)
        sizes[g] = cache_bytes(state)
        assert all(c.k.size(1) == g for c in state.self_caches)
    assert sizes[8] == 4 * sizes[2] == 8 * sizes[1]
    if kind is None:
        assert sizes[8] == 2 * 2 * 2 * 8 * 25 * 4 * 4  # layers · (k, v) · batch · heads · keys · d_k · float32


# the gated feed-forward network, q/k/v biases ----------------------------------------------------------


@pytest.mark.parametrize("activation, hidden_act", [("swiglu", "silu"), ("geglu", "gelu")])
def test_the_gated_feed_forward_network_computes_llamas_mlp(activation, hidden_act):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    ours = GatedFeedForward(32, 88, activation, bias=False)
    theirs = LlamaMLP(transformers.LlamaConfig(hidden_size=32, intermediate_size=88, hidden_act=hidden_act))
    theirs.load_state_dict({"gate_proj.weight": ours.linear1.weight, "up_proj.weight": ours.linear3.weight,
                            "down_proj.weight": ours.linear2.weight})
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)


def test_a_mixture_of_gated_experts_with_one_expert_is_that_expert_and_trains_all_three_matrices():
    model = model_of("decoder", activation="swiglu", moe={"experts": 1, "top_k": 1})
    layer = model.decoder.layers[0].ffn
    assert isinstance(layer.experts[0], GatedFeedForward)
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(layer(x), layer.experts[0](x))
    ids, _ = random_batch(model.cfg, batch=2, src_len=6)
    model.train()
    model(ids).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.experts[0].parameters())


def test_qkv_bias_puts_biases_on_q_k_v_only():
    model = model_of("decoder", bias=False, qkv_bias=True, n_kv_heads=2)
    attn = model.decoder.layers[0].self_attn
    assert attn.in_proj.bias is not None and attn.in_proj.bias.shape == ((8 + 2 * 2) * 4,)
    assert attn.out_proj.bias is None and model.decoder.layers[0].ffn.linear1.bias is None
    with_bias = model_of("decoder", bias=True, qkv_bias=True)
    assert all(p is not None for p in (with_bias.decoder.layers[0].self_attn.out_proj.bias,
                                       with_bias.decoder.layers[0].ffn.linear1.bias))


def test_lora_adapts_every_linear_layer_of_a_gated_grouped_block_and_int8_takes_them():
    from atencion.nn.lora import LoraSpec, apply_lora, merge_lora
    from atencion.nn.quantize import Int8Linear, quantize_int8

    base = model_of("decoder", seed=3, n_kv_heads=2, **LLAMA)
    ids, _ = random_batch(base.cfg, batch=2, src_len=9)
    before = base(ids)
    lora = model_of("decoder", seed=3, n_kv_heads=2, **LLAMA)
    names = apply_lora(lora, LoraSpec(rank=2, targets=["attention", "ffn"]), "base", "0" * 64)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"in_proj", "out_proj", "linear1", "linear2", "linear3"}
    torch.testing.assert_close(lora(ids), before, atol=1e-6, rtol=1e-6)  # adapters start at zero
    with torch.no_grad():
        for p in lora.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    adapted = lora(ids)
    assert (adapted - before).abs().max() > 1e-3
    torch.testing.assert_close(merge_lora(lora)(ids), adapted, atol=1e-5, rtol=1e-5)
    quantized = quantize_int8(base)
    assert isinstance(quantized.decoder.layers[0].ffn.linear3, Int8Linear)
    assert (quantized(ids) - before).abs().max() < 0.1 * before.abs().max()


# RoPE scaling ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [
    {"type": "linear", "factor": 4.0},
    {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_gives_hugging_faces_frequencies(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=512,
                                  rope_parameters={"rope_type": scaling["type"], "rope_theta": 5e5,
                                                   **{k: v for k, v in scaling.items() if k != "type"}})
    theirs, _ = ROPE_INIT_FUNCTIONS[scaling["type"]](hf, "cpu")
    model = model_of("decoder", **{**LLAMA, "d_model": 256, "n_heads": 2}, rope_base=5e5, rope_scaling=scaling)
    ours = model.decoder.relative.inv_freq
    plain = model_of("decoder", **{**LLAMA, "d_model": 256, "n_heads": 2}, rope_base=5e5).decoder.relative.inv_freq
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, plain)
    if scaling["type"] == "llama3":  # the three bands: kept, interpolated, divided by the factor
        ratio = plain / ours
        assert ratio[0] == 1 and ratio[-1] == pytest.approx(8.0) and ((ratio > 1.01) & (ratio < 7.99)).any()


# config keys ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (dict(n_kv_heads=3), r"n_kv_heads \(3\) must divide n_heads \(8\)"),
    (dict(n_kv_heads=0), "n_kv_heads must be a positive integer"),
    (dict(qkv_bias="yes"), "qkv_bias must be true or false"),
    (dict(activation="swish"), "activation must be one of"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling .* needs positional 'rope'"),
    (dict(positional="rope", rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling.type must be one of"),
    (dict(positional="rope", rope_scaling={"type": "linear"}), "rope_scaling.factor is a missing setting"),
    (dict(positional="rope", rope_scaling={"type": "linear", "factor": 2, "low_freq_factor": 1}),
     "rope_scaling.low_freq_factor is not a setting"),
    (dict(positional="rope", rope_scaling={"type": "linear", "factor": 0.5}), "rope_scaling.factor must be >= 1"),
    (dict(positional="rope", rope_scaling={"type": "llama3", "factor": 8, "low_freq_factor": 4,
                                           "high_freq_factor": 1, "original_max_position_embeddings": 64}),
     "low_freq_factor .* below high_freq_factor"),
    (dict(positional="rope", rope_scaling=[2.0]), "rope_scaling must be a mapping"),
])
def test_each_bad_setting_of_todays_blocks_is_refused_naming_its_key(overrides, message):
    with pytest.raises(AtencionError, match=message):
        small_config(n_heads=8, **overrides)


def test_exporters_of_the_paper_blocks_refuse_todays_blocks_in_one_line(tmp_path):
    from atencion.export import export
    from atencion.interop import to_hf

    with pytest.raises(AtencionError, match="n_kv_heads=2 .grouped-query attention. cannot be expressed"):
        export(model_of("encoder-decoder", n_kv_heads=2), tmp_path / "out", "ctranslate2")
    assert not (tmp_path / "out").exists()
    with pytest.raises(AtencionError, match="activation='swiglu' .a gated feed-forward network. cannot be"):
        to_hf(model_of("decoder", positional="learned", norm_first=True, scale_embedding=False, activation="swiglu"))


# presets ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, hf_class, millions", [
    ("llama-tiny", "LlamaForCausalLM", None), ("smollm-135m", "LlamaForCausalLM", 134.5),
    ("tinyllama-1.1b", "LlamaForCausalLM", 1100.0), ("mistral-7b", "MistralForCausalLM", 7241.7),
])
def test_the_llama_presets_have_hugging_faces_parameter_counts(name, hf_class, millions):
    transformers = pytest.importorskip("transformers")
    from atencion.config import PUBLISHED
    from atencion.interop.llama import llama_config

    cfg = ModelConfig.preset(name, vocab_size=PUBLISHED.get(name, (1000,))[0])
    family = "mistral" if hf_class == "MistralForCausalLM" else "llama"
    with torch.device("meta"):  # counted, never allocated
        ours = Transformer(cfg).num_parameters()
        theirs = sum(p.numel() for p in getattr(transformers, hf_class)(llama_config(cfg, family)).parameters())
    assert ours == theirs
    if millions is not None:
        assert round(ours / 1e6, 1) == millions
    assert (cfg.arch, cfg.norm, cfg.positional, cfg.activation, cfg.bias) == ("decoder", "rmsnorm", "rope",
                                                                              "swiglu", False)


def test_a_language_model_trains_from_llama_tiny_with_keys_set_on_the_command_line_and_generates(tmp_path):
    from atencion.nn.model_dir import load_model_dir
    from atencion.tasks.lm import generate_text
    from atencion.train.trainer import train
    from test_tasks import config, lm_sets, sentences

    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in sentences(200)), encoding="utf-8")
    sets = [*lm_sets(text), "model.preset=llama-tiny", "model.n_kv_heads=1", "model.rope_scaling.type=linear",
            "model.rope_scaling.factor=2", "train.max_steps=4", "train.valid_every=4"]
    summary = train(config(tmp_path, "lm", *sets), tmp_path / "run")
    model, tokenizer = load_model_dir(summary["best_model"])
    cfg = model.cfg
    assert (cfg.activation, cfg.norm, cfg.kv_heads, cfg.rope_scaling) == ("swiglu", "rmsnorm", 1,
                                                                          {"type": "linear", "factor": 2.0})
    assert len(generate_text(model, tokenizer, "the", max_new_tokens=12, temperature=0.0)[0]) > 0
