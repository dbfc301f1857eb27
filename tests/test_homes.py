"""The homes of the redesign: model_dir.py knows what a directory is and which class builds
each arch; tasks/ holds one spec per task, and the task a model was trained for is saved in its
config.json and read back from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atencion.config import ARCHS, PRESETS, ModelConfig
from atencion.errors import AtencionError
from atencion.nn.model_dir import ARCHS as REGISTERED
from atencion.nn.model_dir import TOWERS_FILE, build_model, directory_kind, load_config, load_model
from atencion.nn.towers import Towers
from atencion.tasks import TASKS, USES, model_task


def test_every_arch_the_config_accepts_has_one_registered_class():
    assert set(REGISTERED) == set(ARCHS)
    for arch in ARCHS:
        extra = {"rnn": {"hidden": 16}} if arch == "rnn" else {}
        cfg = ModelConfig.preset("tiny", vocab_size=50, arch=arch, **extra)
        assert isinstance(build_model(cfg), REGISTERED[arch])


def test_a_hugging_face_directory_is_told_apart_and_read_as_the_model_from_hf_gives(tmp_path):
    transformers = pytest.importorskip("transformers")
    from atencion.interop import from_hf

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    hf_model = transformers.BertForMaskedLM(config).eval()
    hf_model.save_pretrained(tmp_path / "bert")
    assert directory_kind(tmp_path / "bert") == "huggingface"
    loaded, converted = load_model(tmp_path / "bert"), from_hf(hf_model)
    assert loaded.cfg == converted.cfg
    ids = torch.randint(5, 50, (2, 6))
    assert torch.equal(loaded(ids), converted(ids))


def test_a_directory_of_towers_is_told_apart_its_towers_json_checked_and_it_has_no_single_config(tmp_path):
    model = build_model(ModelConfig.preset("tiny", vocab_size=50, arch="encoder"))
    model.save(tmp_path / "clip" / "text")
    (tmp_path / "clip" / TOWERS_FILE).write_text(json.dumps({"text": "text"}), encoding="utf-8")
    assert directory_kind(tmp_path / "clip") == "towers"
    assert directory_kind(tmp_path / "clip" / "text") == "atencion"
    with pytest.raises(AtencionError, match="towers.json: expected"):  # loaded by nn/towers.py (tests/test_clip.py)
        load_model(tmp_path / "clip")
    with pytest.raises(AtencionError, match="a directory of several towers"):
        load_config(tmp_path / "clip")


def test_the_task_is_saved_in_config_json_and_read_back_before_any_guess(tmp_path):
    cfg = ModelConfig.preset("gpt-tiny", vocab_size=50, num_labels=2, pooling="last", task="classify")
    model = build_model(cfg)
    model.save(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["task"] == "classify"
    assert model_task(load_model(tmp_path / "m").cfg) == "classify"
    # a directory written before the task was saved: told by arch and num_labels, as before
    assert model_task(ModelConfig.preset("gpt-tiny", vocab_size=50)) == "lm"
    assert model_task(ModelConfig.preset("bert-tiny", vocab_size=50)) == "mlm"
    assert model_task(ModelConfig.preset("tiny", vocab_size=50)) == "translate"
    with pytest.raises(AtencionError, match="task 'speech' is not a task of atencion"):
        model_task(ModelConfig.preset("tiny", vocab_size=50, task="speech"))


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_spec_is_whole(name):
    spec = TASKS[name]
    assert spec.training.name == name
    # a preset whose encoder reads no tokens (whisper-tiny: recordings) has the decoder's vocabulary only
    # and one of images (vit-tiny) none
    vocabulary = {"vocab_size": 50} if PRESETS[spec.preset].get("vocab_size") != 0 else \
        {"tgt_vocab_size": 50} if PRESETS[spec.preset].get("arch") == "encoder-decoder" else {}
    assert ModelConfig.preset(spec.preset, **vocabulary).arch in spec.archs
    assert USES[spec.use] is spec
    assert set(spec.evaluate_required) <= set(spec.evaluate_options)
    torch.manual_seed(0)
    heads = {"num_labels": 2} if name in ("classify", "contrastive") else {}
    model = build_model(ModelConfig.preset(spec.preset, **vocabulary, task=name, **heads))
    if name == "contrastive":  # two towers (nn/towers.py), each projecting to num_labels
        model = Towers({"a": model, "b": build_model(model.cfg)})

    class Masked:  # a tokenizer as far as the capabilities look at one
        mask_id = 4

    assert spec.can(model, Masked()), f"a {spec.preset} model trained for {name} cannot {spec.use}"


def test_training_writes_the_configs_task_into_the_models_config_json(tmp_path):
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    text = tmp_path / "text.txt"
    text.write_text("".join(f"the cat {w} on the mat\n" for w in ("sat", "lay", "ran", "slept") * 50),
                    encoding="utf-8")
    (tmp_path / "mlm.yaml").write_text("task: mlm\n", encoding="utf-8")
    cfg = load_config(tmp_path / "mlm.yaml", [f"data.train_text={text}", "data.vocab_size=40", "model.n_layers=1",
                                              "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
                                              "train.max_steps=1", "train.progress=false",
                                              "train.tensorboard=false"])
    summary = train(cfg, tmp_path / "run")
    saved = json.loads((Path(summary["last_checkpoint"]) / "config.json").read_text())
    assert saved["task"] == "mlm" and summary["steps"] == 1
