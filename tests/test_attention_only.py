"""d_ff 0: blocks without the feed-forward sub-layer (the attention-only models of Olsson et al.
2022), built, saved, loaded, decoded and refused where they cannot go."""

import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.export import export
from atencion.interop import to_hf
from conftest import random_batch, small_config, small_model

DECODER = dict(arch="decoder", norm_first=True, positional="learned", max_positions=32)


def test_d_ff_0_builds_blocks_of_attention_alone():
    model = small_model(d_ff=0, **DECODER)
    names = [name for name, _ in model.named_parameters()]
    assert not [name for name in names if "ffn" in name]
    dense = small_model(**DECODER)
    per_layer = (32 * 64 + 64) + (64 * 32 + 32) + 2 * 32  # W1, b1, W2, b2, the residual block's LayerNorm
    assert model.num_parameters() == dense.num_parameters() - 2 * per_layer


def test_no_feed_forward_computes_what_a_zeroed_one_adds_nothing_to():
    """Pre-LN: x + FFN(Norm(x)) with FFN's output layer zeroed is x, so a dense model whose second
    FFN matrices and biases are zero computes what the d_ff 0 model with the same other weights does."""
    dense = small_model(seed=3, **DECODER)
    with torch.no_grad():
        for layer in dense.decoder.layers:
            layer.ffn.linear2.weight.zero_()
            layer.ffn.linear2.bias.zero_()
    bare = Transformer(small_config(d_ff=0, **DECODER)).eval()
    missing, unexpected = bare.load_state_dict(dense.state_dict(), strict=False)
    assert not missing and all(".ffn." in name or ".res_ffn." in name for name in unexpected)
    ids = random_batch(bare.cfg, batch=2, src_len=9)[0]
    assert torch.allclose(bare(ids), dense(ids), atol=1e-6)
    with torch.no_grad():  # and the test can fail: a live FFN changes the output
        dense.decoder.layers[0].ffn.linear2.bias.normal_()
    assert not torch.allclose(bare(ids), dense(ids), atol=1e-3)


def test_an_attention_only_decoder_decodes_with_its_cache_as_in_one_pass():
    model = small_model(d_ff=0, **DECODER)
    ids = random_batch(model.cfg, batch=2, src_len=8)[0]
    with torch.no_grad():
        full = model(ids)
        state = model.init_state()
        steps = torch.cat([model.decode_step(ids[:, i:i + 1], state) for i in range(ids.size(1))], dim=1)
    assert torch.allclose(steps, full, atol=1e-5)


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder", "encoder"])
def test_a_model_saved_with_d_ff_0_loads_back(tmp_path, arch):
    model = small_model(d_ff=0, arch=arch)
    model.save(tmp_path / "m")
    loaded = Transformer.load(tmp_path / "m").eval()
    assert loaded.cfg.d_ff == 0
    src, tgt = random_batch(model.cfg)
    args = (src, tgt) if arch == "encoder-decoder" else (src,)
    with torch.no_grad():
        assert torch.equal(loaded(*args), model(*args))


@pytest.mark.parametrize("settings, words", [
    (dict(d_ff=-1), "d_ff must be an integer >= 0"),
    (dict(d_ff=True), "d_ff must be an integer >= 0"),
    (dict(d_ff=0, moe={"experts": 2}), "d_ff 0 means no feed-forward layer"),
])
def test_d_ff_settings_that_make_no_sense_are_refused_in_one_line(settings, words):
    with pytest.raises(AtencionError, match=words) as err:
        ModelConfig.from_dict(dict(vocab_size=40, d_model=32, n_heads=4, **settings))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fmt", ["ctranslate2", "hf", "gguf"])
def test_exports_without_a_place_for_attention_only_blocks_refuse_them(tmp_path, fmt):
    arch = dict(DECODER) if fmt == "gguf" else {}
    with pytest.raises(AtencionError, match=f"export to {fmt}: d_ff 0") as err:
        export(small_model(d_ff=0, **arch), tmp_path / "out", fmt)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    with pytest.raises(AtencionError, match="to_hf: d_ff 0"):
        to_hf(small_model(d_ff=0, **DECODER))


@pytest.mark.filterwarnings("ignore:# The axis name", "ignore:.*treespec, LeafSpec")
def test_onnx_exports_an_attention_only_translator(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import numpy as np

    from atencion.export.onnx import OnnxTranslator

    model = small_model(d_ff=0)
    export(model, tmp_path / "onnx", "onnx")
    src, _ = random_batch(model.cfg, batch=2, src_len=6)
    with torch.no_grad():
        assert np.abs(OnnxTranslator(tmp_path / "onnx").encode(src.numpy()) - model.encode(src)[0].numpy()).max() \
            <= 1e-4


def test_lora_on_the_missing_feed_forward_layers_is_refused_in_one_line():
    from atencion.nn.lora import LoraSpec, select_targets

    model = small_model(d_ff=0, **DECODER)
    with pytest.raises(AtencionError, match="'ffn' matches no linear layer") as err:
        select_targets(model, LoraSpec(rank=2, targets=["ffn"]))
    assert "\n" not in str(err.value)
    assert select_targets(model, LoraSpec(rank=2, targets=["attention"]))   # its attention can be adapted


def test_the_trainer_trains_an_attention_only_model_and_its_checkpoint_loads(tmp_path):
    import json

    from atencion.nn.model_dir import load_model_dir
    from atencion.train.checkpoint import list_checkpoints
    from atencion.train.trainer import train
    from test_training import tiny_config, write_corpus

    data = write_corpus(tmp_path / "data", n=200)
    train(tiny_config(data, **{"model.d_ff": 0, "train.max_steps": 40, "train.max_epochs": 100}), tmp_path / "run")
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "log.jsonl").read_text().splitlines())
              if "loss" in r and "step" in r]
    assert losses[-1] < losses[0]
    model, _ = load_model_dir(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    assert model.cfg.d_ff == 0 and not any(".ffn." in name for name, _ in model.named_parameters())
