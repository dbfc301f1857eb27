"""``model.attention``: every kind in the models that use it — each arch, each task, training and
decoding with the kind's cache, attention maps, saving and loading — and today's default unchanged.
The kinds' own algorithms are proven in test_flash.py, test_sparse_attention.py, test_linformer.py
and test_performer.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from atencion.config import ModelConfig
from atencion.errors import AtencionError
from atencion.nn.model_dir import load_model, save_model
from atencion.nn.transformer import Transformer
from conftest import random_batch, small_config
from test_tasks import config, lm_sets, sentences

KINDS = {  # settings small enough that the tests' lengths cross tiles, windows and blocks
    "flash": {"kind": "flash", "q_tile": 3, "k_tile": 4},
    "window": {"kind": "window", "window": 3},
    "longformer": {"kind": "longformer", "window": 2, "global_tokens": 1},
    "bigbird": {"kind": "bigbird", "block_size": 2, "random_blocks": 1, "global_blocks": 1},
    "linformer": {"kind": "linformer", "proj_len": 8},
    "performer": {"kind": "performer", "features": 64},
}
CAUSAL_KINDS = ["flash", "window", "longformer", "bigbird", "performer"]  # linformer is for encoders


def twin(model: Transformer, **attention) -> Transformer:
    """A model with ``model``'s weights and another attention kind."""
    other = Transformer(ModelConfig(**{**model.cfg.to_dict(), "attention": attention or None})).eval()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".kind." in name for name in missing), (missing, unexpected)
    return other


def model_of(arch: str, attention=None, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(small_config(arch=arch, dropout=0.0, attention=attention, **overrides)).eval()


# today's default ----------------------------------------------------------------------------------


def test_a_config_without_attention_and_kind_full_give_the_same_model_bit_for_bit(tmp_path):
    plain, full = model_of("encoder-decoder"), model_of("encoder-decoder", {"kind": "full"})
    src, tgt = random_batch(plain.cfg)
    assert torch.equal(plain(src, tgt), full(src, tgt))
    assert all(layer.self_attn.kind is None for layer in full.decoder.layers)
    save_model(plain, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attention"] is None  # a config.json written before the key loads as eq. (1)
    del saved["attention"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert torch.equal(load_model(tmp_path)(src, tgt), plain(src, tgt))


# exact kinds equal eq. (1) inside models ------------------------------------------------------------


@pytest.mark.parametrize("positional", ["sinusoidal", "rope", "alibi", "t5"])
@pytest.mark.parametrize("arch", ["encoder-decoder", "encoder", "decoder"])
def test_flash_inside_a_model_computes_what_eq_1_computes_values_and_gradients(arch, positional):
    full = model_of(arch, positional=positional)
    flash = twin(full, **KINDS["flash"])
    src, tgt = random_batch(full.cfg, batch=3, src_len=11, tgt_len=9)
    args = (src, tgt) if arch == "encoder-decoder" else (src,)
    out_full, out_flash = full(*args), flash(*args)
    assert torch.allclose(out_flash, out_full, atol=1e-5), (out_flash - out_full).abs().max()
    out_full.square().sum().backward()
    out_flash.square().sum().backward()
    grads = dict(flash.named_parameters())
    for name, p in full.named_parameters():
        assert torch.allclose(grads[name].grad, p.grad, atol=1e-4, rtol=1e-4), name


@pytest.mark.parametrize("kind", ["window", "longformer"])
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_a_window_as_long_as_the_input_is_full_attention_inside_a_model(arch, kind):
    full = model_of(arch)
    wide = twin(full, kind=kind, window=64)
    src, _ = random_batch(full.cfg, batch=3, src_len=13)
    assert torch.allclose(wide(src), full(src), atol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_trains_an_encoder_with_padding_and_its_padding_changes_nothing(kind):
    model = model_of("encoder", KINDS[kind])
    model.train()
    src, _ = random_batch(model.cfg, batch=3, src_len=10)
    logits = model(src)
    logits[src != 0].logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    model.eval()
    if kind == "bigbird":
        return  # its random blocks are drawn for the number of blocks: a longer input draws others
    longer = torch.cat([src, torch.zeros(3, 5, dtype=torch.long)], 1)  # more padding: the real rows unchanged
    assert torch.allclose(model(longer)[:, :10][src != 0], model(src)[src != 0], atol=1e-5)


# decoding with each kind's cache equals the full pass ----------------------------------------------


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
@pytest.mark.parametrize("positional", ["learned", "rope", "alibi"])
def test_decoding_step_by_step_with_the_kinds_cache_equals_the_full_pass(kind, positional):
    if kind == "performer" and positional == "alibi":
        pytest.skip("the Performer takes no score bias (refused by the config)")
    model = model_of("decoder", KINDS[kind], positional=positional)
    ids, _ = random_batch(model.cfg, batch=2, src_len=12)
    ids[:, :] = ids[0]  # no padding
    full = model(ids)
    state = model.init_state()
    steps = [model.decode_step(ids[:, :5], state)]  # a prompt, then one token at a time
    steps += [model.decode_step(ids[:, t:t + 1], state) for t in range(5, 12)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5), (torch.cat(steps, 1) - full).abs().max()


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_a_beams_rows_each_see_their_own_history_under_every_kind(kind):
    """A beam's rows share one cache whose keys are interleaved by slot: each row's logits equal
    the full pass over its own tokens."""
    model = model_of("encoder-decoder", KINDS[kind])
    src, tgt = random_batch(model.cfg, batch=1, src_len=7, tgt_len=8)
    rows = torch.stack([tgt[0], tgt[0].roll(1)])
    rows[:, 0] = model.cfg.bos_id
    memory, src_mask = model.encode(src)
    state = model.init_state(memory, src_mask, group=2)
    steps = torch.cat([model.decode_step(rows[:, t:t + 1], state) for t in range(8)], 1)
    full = model(src.expand(2, -1), rows)
    assert torch.allclose(steps, full, atol=1e-5), (steps - full).abs().max()


def test_a_window_generates_ten_times_past_its_training_length_keeping_window_keys():
    model = model_of("decoder", {"kind": "window", "window": 4}, positional="rope", n_layers=1)
    state = model.init_state()
    token = torch.tensor([[5]])
    sizes = []
    for _ in range(10 * 12):  # trained (here: built) for blocks of 12
        token = model.decode_step(token, state)[:, -1:].argmax(-1)
        sizes.append(state.self_caches[0].k.size(2))
    assert max(sizes) == 3 and len(state.self_caches[0]) == 120  # the last window − 1 keys, never more


# what the user sees ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_returns_attention_maps_of_the_shape_of_the_scores(kind):
    model = model_of("encoder", KINDS[kind])
    src, _ = random_batch(model.cfg, batch=2, src_len=9)
    _, maps = model(src, return_attention=True)
    assert [tuple(m.shape) for m in maps["encoder"]] == [(2, 4, 9, 9)] * 2
    if kind == "window":  # nothing outside the window
        far = (torch.arange(9)[:, None] - torch.arange(9)[None, :]).abs() >= 3
        assert maps["encoder"][0][:, :, far].abs().max() == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_model_of_every_kind_saves_and_loads_to_the_same_outputs(tmp_path, kind):
    model = model_of("encoder", KINDS[kind])
    save_model(model, tmp_path)
    src, _ = random_batch(model.cfg, batch=2, src_len=9)
    loaded = load_model(tmp_path)
    assert loaded.cfg.attention["kind"] == kind and torch.equal(loaded(src), model(src))


def test_linformer_layerwise_shares_one_projection_saved_once(tmp_path):
    model = model_of("encoder", {"kind": "linformer", "proj_len": 8, "sharing": "layerwise"})
    first, second = (layer.self_attn.kind.projection for layer in model.encoder.layers)
    assert first is second
    save_model(model, tmp_path)
    assert torch.equal(load_model(tmp_path)(random_batch(model.cfg)[0]), model(random_batch(model.cfg)[0]))


def test_exporters_refuse_an_approximate_kind_in_one_line(tmp_path):
    from atencion.export import export
    from atencion.interop import to_hf

    model = model_of("encoder-decoder", KINDS["window"])
    with pytest.raises(AtencionError, match="attention.kind window cannot be exported"):
        export(model, tmp_path / "out", "ctranslate2")
    with pytest.raises(AtencionError, match="attention.kind window cannot be expressed"):
        to_hf(model)
    assert not (tmp_path / "out").exists()


def test_int8_and_lora_take_a_kind():
    from atencion.nn.lora import LoraSpec, apply_lora
    from atencion.nn.quantize import quantize_int8

    model = model_of("decoder", KINDS["window"])
    ids, _ = random_batch(model.cfg, batch=2, src_len=10)
    ids[:, :] = ids[0]
    before = model(ids)
    quantized = quantize_int8(model_of("decoder", KINDS["window"]))
    assert (quantized(ids) - before).abs().max() < 0.1 * before.abs().max()
    lora = model_of("decoder", KINDS["window"])
    apply_lora(lora, LoraSpec(rank=2), "base", "0" * 64)
    assert torch.allclose(lora(ids), before, atol=1e-5)  # adapters start at zero


# training every task through the config ----------------------------------------------------------


@pytest.mark.parametrize("task,kind", [("lm", "window"), ("lm", "performer"), ("lm", "flash"),
                                       ("mlm", "linformer"), ("mlm", "bigbird"), ("classify", "longformer"),
                                       ("translate", "window")])
def test_each_task_trains_with_a_kind_and_its_model_reloads(tmp_path, task, kind):
    from atencion.nn.model_dir import load_model_dir
    from atencion.train.trainer import train

    sets = [f"model.attention.{key}={value}" for key, value in KINDS[kind].items()]
    if task == "lm":
        text = tmp_path / "text.txt"
        text.write_text("".join(s + "\n" for s in sentences(200)), encoding="utf-8")
        sets += lm_sets(text)
    elif task == "mlm":
        text = tmp_path / "text.txt"
        text.write_text("".join(s + "\n" for s in sentences(200)), encoding="utf-8")
        sets += [f"data.train_text={text}", "data.vocab_size=60", "train.max_tokens=512", "model.max_positions=64",
                 "data.max_len=60"]
    elif task == "classify":
        tsv = tmp_path / "train.tsv"
        tsv.write_text("".join(f"{'pos' if 'cat' in s else 'neg'}\t{s}\n" for s in sentences(200)), encoding="utf-8")
        sets += [f"data.train_tsv={tsv}", f"data.valid_tsv={tsv}"]
    else:
        src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
        src.write_text("".join(s + "\n" for s in sentences(200)), encoding="utf-8")
        tgt.write_text("".join(s.upper() + "\n" for s in sentences(200)), encoding="utf-8")
        sets += [f"data.train_src={src}", f"data.train_tgt={tgt}", f"data.valid_src={src}", f"data.valid_tgt={tgt}",
                 "data.vocab_size=80", "train.valid_bleu=false"]
    summary = train(config(tmp_path, task, *sets, "train.max_steps=4", "train.valid_every=4"), tmp_path / "run")
    model, _ = load_model_dir(summary["best_model"])
    assert model.cfg.attention["kind"] == kind and model.cfg.task == task


@pytest.mark.parametrize("setting,message", [
    ("model.attention.window=0", "attention.window must be an integer >= 1, got 0"),
    ("model.attention.kind=linformer", "attention.kind linformer projects the keys along the whole length"),
    ("model.attention.features=3", "attention.features is not a setting of attention kind 'window'"),
])
def test_a_bad_attention_setting_is_one_line_exit_2_and_nothing_written(tmp_path, setting, message):
    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in sentences(50)), encoding="utf-8")
    (tmp_path / "c.yaml").write_text("task: lm\nmodel:\n  attention: {kind: window}\n", encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "atencion", "train", str(tmp_path / "c.yaml"), "--out",
                             str(tmp_path / "run"), "--set", f"data.train_text={text}", "--set", "data.tokenizer=char",
                             "--set", setting], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr and not (tmp_path / "run").exists()


def test_the_attention_page_says_what_a_kinds_maps_show():
    import numpy as np

    from atencion.viz.attention import AttentionMap, SelfAttention, kind_note
    from atencion.viz.html import attention_html

    amap = AttentionMap("encoder", np.full((1, 1, 2, 2), 0.5), ["a", "b"], ["a", "b"])
    page = attention_html(SelfAttention("a b", "", 0, amap, "linformer"))
    assert "need not be positive nor sum to 1" in page and kind_note("linformer").split(":")[0] in page
    assert "Linformer" not in attention_html(SelfAttention("a b", "", 0, amap))


@pytest.mark.parametrize("attention,message", [
    ({"kind": "performer", "features": 0}, "attention.features must be an integer >= 1, got 0"),
    ({"kind": "linformer", "proj_len": 0}, "attention.proj_len must be an integer >= 1, got 0"),
    ({"kind": "linformer", "proj_len": 2000}, "attention.proj_len (2000) must be at most max_positions (1024)"),
    ({"kind": "longformer", "global_tokens": [3, 5000]}, "attention.global_tokens: position 5000 is beyond"),
    ({"kind": "bigbird", "random_blocks": -1}, "attention.random_blocks must be an integer >= 0, got -1"),
    ({"kind": "flash", "q_tile": 0}, "attention.q_tile must be an integer >= 1, got 0"),
    ({"kind": "sliding"}, "attention.kind must be one of ['full', 'flash', 'window'"),
    ({"kind": "performer"}, "computes no score matrix to add positional 'alibi'"),
    ("window", "attention must be a mapping such as {kind: flash}"),
])
def test_each_bad_attention_setting_is_refused_naming_its_key(attention, message):
    positional = "alibi" if attention == {"kind": "performer"} else "sinusoidal"
    with pytest.raises(AtencionError, match=re.escape(message)):
        ModelConfig(vocab_size=20, arch="encoder", positional=positional, attention=attention)


def test_a_mixture_of_experts_takes_a_kind_and_its_cache_equals_the_full_pass():
    model = model_of("decoder", KINDS["window"], moe={"experts": 3, "top_k": 2})
    ids, _ = random_batch(model.cfg, batch=1, src_len=10)
    full = model(ids)
    state = model.init_state()
    steps = torch.cat([model.decode_step(ids[:, t:t + 1], state) for t in range(10)], 1)
    assert torch.allclose(steps, full, atol=1e-5)
