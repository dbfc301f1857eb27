"""CLIP (task contrastive, nn/towers.py): the symmetric InfoNCE loss equals a hand computation
and Hugging Face's ``clip_loss`` and is symmetric; the temperature is learned and clipped at 100;
a towers directory saves and loads (the same outputs) and a broken towers.json is one line; a short
run on tiny towers (in the trainer's loop) lowers the loss, resumes exactly and trains alike with
activation checkpointing; `atencion evaluate` prints zero-shot accuracy and Recall@1 both ways
beside chance; bad input is one line, exit 2. Under torchrun: tests/test_contrastive_torchrun.py."""

from __future__ import annotations

import io
import json
import math
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.cli import main
from atencion.errors import AtencionError
from atencion.nn.model_dir import load_model, load_model_dir, load_towers, save_towers
from atencion.nn.towers import LOG_SCALE_MAX, Towers, info_nce
from atencion.tasks.contrastive import global_info_nce, recall_at_1, retrieval_chance
from conftest import run_cli as run

PATCHES = {"kind": "patches", "patch": 2, "size": [4, 4], "channels": 1}
SPECTROGRAM = {"kind": "spectrogram", "n_mels": 8, "max_frames": 40}




def tiny_towers(width: int = 4) -> Towers:
    base = dict(vocab_size=0, arch="encoder", n_layers=1, d_model=8, d_ff=16, n_heads=2, num_labels=width,
                dropout=0.0, norm_first=True, activation="gelu")
    image = Transformer(ModelConfig(**base, inputs=PATCHES, positional="learned", max_positions=5))
    audio = Transformer(ModelConfig(**base, inputs=SPECTROGRAM, pooling="mean", positional="sinusoidal"))
    return Towers({"image": image, "audio": audio})


# the loss -----------------------------------------------------------------------------------------


def test_the_loss_is_the_hand_computed_mean_of_both_cross_entropies_and_symmetric():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 0.3], [1.5, -0.5, 0.2]])
    rows = [-logits[i, i] + math.log(sum(math.exp(v) for v in logits[i].tolist())) for i in range(3)]
    cols = [-logits[i, i] + math.log(sum(math.exp(v) for v in logits[:, i].tolist())) for i in range(3)]
    hand = (sum(rows) / 3 + sum(cols) / 3) / 2
    assert float(info_nce(logits)) == pytest.approx(float(hand), abs=1e-6)
    assert float(info_nce(logits.t())) == pytest.approx(float(hand), abs=1e-6)  # the modalities swapped
    assert float(info_nce(logits)) != pytest.approx(float(sum(rows) / 3), abs=1e-3)  # not one way only


def test_the_loss_equals_hugging_faces_clip_model_loss_on_the_same_embeddings_and_scale():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=8),
        vision_config=dict(image_size=8, patch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2), projection_dim=6)
    clip = transformers.CLIPModel(config).eval()
    with torch.no_grad():
        clip.logit_scale.fill_(2.5)
        out = clip(input_ids=torch.randint(0, 50, (5, 7)), pixel_values=torch.randn(5, 3, 8, 8), return_loss=True)
    model = tiny_towers()
    with torch.no_grad():
        model.log_scale.fill_(2.5)
        ours = info_nce(model.logits(out.image_embeds, out.text_embeds))  # CLIPModel's embeddings are normalised
    torch.testing.assert_close(ours, out.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.logits(out.image_embeds, out.text_embeds), out.logits_per_image,
                               rtol=1e-6, atol=1e-6)


def test_the_global_loss_of_one_process_is_its_batch_loss_summed_over_pairs_with_the_same_gradients():
    torch.manual_seed(0)
    first, second = (torch.nn.functional.normalize(torch.randn(5, 4), dim=-1).requires_grad_() for _ in range(2))
    scale = torch.tensor([3.0], requires_grad=True)
    loss = global_info_nce(first, second, scale)  # no process group: this process's batch is the global one
    expected = 5 * info_nce(scale * first @ second.t())
    torch.testing.assert_close(loss, expected)
    got = torch.autograd.grad(loss, (first, second, scale))
    for mine, theirs in zip(got, torch.autograd.grad(expected, (first, second, scale))):
        torch.testing.assert_close(mine, theirs)
    assert all(float(g.abs().sum()) > 0 for g in got)


def test_the_temperature_is_learned_and_clipped_at_one_hundred():
    torch.manual_seed(0)
    model = tiny_towers()
    assert model.log_scale.item() == pytest.approx(math.log(1 / 0.07))
    images, frames = torch.randn(3, 1, 4, 4), torch.randn(3, 8, 12)
    loss = info_nce(model.logits(model.embed("image", images), model.embed("audio", frames)))
    loss.backward()
    assert model.log_scale.grad is not None and float(model.log_scale.grad) != 0.0
    with torch.no_grad():
        model.log_scale.fill_(10.0)
    a = torch.nn.functional.normalize(torch.ones(1, 4), dim=-1)
    assert model.logits(a, a).item() == pytest.approx(100.0, rel=1e-5)  # exp(t) at most 100
    model.clamp_()
    assert model.log_scale.item() == pytest.approx(LOG_SCALE_MAX)


def test_recall_at_1_counts_an_item_of_the_same_label_and_chance_is_the_labels_share():
    queries = torch.eye(3)
    gallery = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.9, 0.1, 0.0]])
    assert recall_at_1(queries, [0, 1, 2], gallery, [1, 0, 1, 0]) == pytest.approx(2 / 3)
    assert retrieval_chance([0, 1], [0, 0, 1, 1]) == pytest.approx(0.5)


# the towers directory --------------------------------------------------------------------------


def test_a_towers_directory_saves_and_loads_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    model = tiny_towers().eval()
    with torch.no_grad():
        model.log_scale.fill_(3.0)
    save_towers(model, tmp_path / "towers")
    assert sorted(p.name for p in (tmp_path / "towers").iterdir()) == ["audio", "image", "towers.json"]
    for loaded in (load_towers(tmp_path / "towers"), load_model(tmp_path / "towers"),
                   load_model_dir(tmp_path / "towers", towers=True)[0]):
        assert loaded.names == ["image", "audio"] and loaded.log_scale.item() == 3.0
        images, frames, lengths = torch.randn(2, 1, 4, 4), torch.randn(2, 8, 10), torch.tensor([10, 6])
        with torch.no_grad():
            torch.testing.assert_close(loaded.embed("image", images), model.embed("image", images), rtol=0, atol=0)
            torch.testing.assert_close(loaded.embed("audio", frames, lengths), model.embed("audio", frames, lengths),
                                       rtol=0, atol=0)
    # each tower is an ordinary model directory
    assert load_model(tmp_path / "towers" / "image").cfg.num_labels == 4


@pytest.mark.parametrize("text, message", [
    ("{not json", "not readable JSON"),
    ('{"task": "contrastive", "towers": ["image"], "projection": 4, "log_scale": 1.0}', "two or more"),
    ('{"task": "contrastive", "towers": ["image", "audio"], "projection": 5, "log_scale": 1.0}',
     "expected an encoder projecting to 5"),
    ('{"task": "contrastive", "towers": ["image", "../x"], "projection": 4, "log_scale": 1.0}', "directory names"),
    ('{"task": "contrastive", "towers": ["image", "audio"], "projection": 4, "log_scale": 9.0}', "at most log 100"),
    ('{"towers": ["image", "audio"], "projection": 4}', 'expected {"task"'),
])
def test_a_broken_towers_json_is_refused_in_one_line(tmp_path, text, message):
    save_towers(tiny_towers(), tmp_path / "towers")
    (tmp_path / "towers" / "towers.json").write_text(text)
    with pytest.raises(AtencionError) as err:
        load_towers(tmp_path / "towers")
    assert message in str(err.value) and ("towers.json" in str(err.value) or "config.json" in str(err.value))
    assert "\n" not in str(err.value)


# training and evaluation on tiny data ------------------------------------------------------------


def _tone(hz: float, seconds: float, rng: np.random.Generator) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    x = 0.5 * np.sin(2 * np.pi * hz * t + rng.uniform(0, 6)) + 0.01 * rng.standard_normal(len(t))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Three labels: images (4 × 4, a bright row per label, noisy) and recordings (a tone per label),
    images_{split}.tsv and sounds_{split}.tsv for train, valid and test."""
    root = tmp_path_factory.mktemp("clip")
    (root / "files").mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("valid", 3), ("test", 4)):
        images, sounds = [], []
        for label, hz in enumerate((300.0, 1000.0, 2500.0)):
            for i in range(n):
                image = rng.uniform(0, 0.3, (4, 4)).astype(np.float32)
                image[label] += 1.0
                np.save(root / "files" / f"{split}_{label}_{i}.npy", image)
                (root / "files" / f"{split}_{label}_{i}.wav").write_bytes(_tone(hz, rng.uniform(0.1, 0.2), rng))
                images.append(f"{label}\tfiles/{split}_{label}_{i}.npy\n")
                sounds.append(f"{label}\tfiles/{split}_{label}_{i}.wav\n")
        (root / f"images_{split}.tsv").write_text("".join(images))
        (root / f"sounds_{split}.tsv").write_text("".join(sounds))
    tower = "{n_layers: 1, d_model: 16, d_ff: 32, n_heads: 2, dropout: 0.0"
    (root / "clip.yaml").write_text(f"""task: contrastive
model:
  projection: 8
  towers:
    image: {tower}, inputs: {{kind: patches, patch: 2, size: [4, 4], channels: 1}}, max_positions: 5}}
    audio: {tower}, preset: whisper-tiny, arch: encoder, pooling: mean,
            inputs: {{kind: spectrogram, n_mels: 16, max_frames: 40}}}}
data: {{train_src: {root}/images_train.tsv, train_tgt: {root}/sounds_train.tsv,
        valid_src: {root}/images_valid.tsv, valid_tgt: {root}/sounds_valid.tsv}}
train: {{max_tokens: 12, max_steps: 60, max_epochs: 100, lr_peak: 3.0e-3, warmup: 5, schedule: constant,
         valid_every: 30, log_every: 1, threads: 1}}
""")
    return root


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "clip"
    assert main(["train", str(data / "clip.yaml"), "--out", str(out)]) in (0, None)
    return out


def test_a_short_run_lowers_the_loss_and_writes_the_towers(trained):
    records = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])
    temperatures = [r["temperature"] for r in records if "loss" in r]  # 1 / exp(t), t clipped after each update
    assert temperatures[0] == pytest.approx(0.07, abs=2e-3) and all(0.01 <= x <= 1 for x in temperatures)
    assert any(r.get("valid_zero_shot_accuracy") is not None for r in records)
    assert (trained / "best" / "towers.json").is_file() and (trained / "last" / "image" / "config.json").is_file()
    assert json.loads((trained / "best" / "towers.json").read_text())["towers"] == ["image", "audio"]


def test_a_resumed_run_repeats_the_unbroken_one(trained, data, tmp_path, capsys):
    out = tmp_path / "clip"
    assert main(["train", str(data / "clip.yaml"), "--out", str(out), "--set", "train.max_steps=30"]) in (0, None)
    assert main(["train", str(data / "clip.yaml"), "--out", str(out), "--resume"]) in (0, None)
    capsys.readouterr()
    whole, resumed = load_towers(trained / "last"), load_towers(out / "last")
    for name, param in whole.named_parameters():
        assert torch.equal(param, resumed.get_parameter(name)), name
    losses = [json.loads(line).get("loss") for line in (out / "log.jsonl").read_text().splitlines()]
    assert [x for x in losses if x is not None] == \
        [json.loads(line)["loss"] for line in (trained / "log.jsonl").read_text().splitlines() if '"loss"' in line]


def test_activation_checkpointing_trains_the_towers_as_without_it(data, tmp_path, monkeypatch, capsys):
    import atencion.nn.layers as layers

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    real = layers.checkpoint
    monkeypatch.setattr(layers, "checkpoint", counted)
    for on in (False, True):
        assert main(["train", str(data / "clip.yaml"), "--out", str(tmp_path / str(on)), "--set", "train.max_steps=3",
                     "--set", f"train.activation_checkpointing={str(on).lower()}"]) in (0, None)
        assert bool(calls) == on  # each tower's blocks computed again in backward
    capsys.readouterr()
    plain, recomputed = load_towers(tmp_path / "False" / "last"), load_towers(tmp_path / "True" / "last")
    for name, param in plain.named_parameters():
        torch.testing.assert_close(recomputed.get_parameter(name), param, atol=1e-6, rtol=1e-5, msg=name)


def test_evaluate_prints_zero_shot_accuracy_and_recall_both_ways_beside_chance(trained, data, capsys):
    status, out, err = run(["evaluate", "--model", str(trained / "best"), "--tsv", str(data / "images_test.tsv"),
                            "--other-tsv", str(data / "sounds_test.tsv"),
                            "--centroid-tsv", str(data / "sounds_train.tsv")], capsys)
    assert status in (0, None), err
    result = json.loads(out)
    assert result["task"] == "contrastive" and result["image"] == 12 and result["audio"] == 12
    assert result["zero_shot_chance"] == pytest.approx(1 / 3, abs=1e-4)
    assert result["chance_image_to_audio"] == pytest.approx(1 / 3, abs=1e-4)
    for key in ("zero_shot_accuracy", "recall_at_1_image_to_audio", "recall_at_1_audio_to_image"):
        assert result[key] > 0.5, result  # three easy labels, well above chance after 60 updates


def test_bad_input_is_one_line_exit_2_and_writes_nothing(trained, data, capsys, tmp_path):
    bad = tmp_path / "bad.tsv"
    (tmp_path / "x.npy").write_bytes(b"not an image")
    bad.write_text("0\tx.npy\n")
    status, out, err = run(["evaluate", "--model", str(trained / "best"), "--tsv", str(bad), "--other-tsv",
                            str(data / "sounds_test.tsv"), "--centroid-tsv", str(data / "sounds_train.tsv")], capsys)
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1 and "bad.tsv line 1" in err
    status, out, err = run(["classify", "--model", str(trained / "best"), "--input", str(data / "images_test.tsv")],
                           capsys)
    assert status == 2 and out == "" and "several towers" in err and len(err.strip().splitlines()) == 1
    status, _, err = run(["export", "--model", str(trained / "best"), "--format", "hf", "--out", str(tmp_path / "x")],
                         capsys)
    assert status == 2 and "several towers" in err and not (tmp_path / "x").exists()
    status, _, err = run(["evaluate", "--model", str(trained / "best"), "--tsv", str(data / "images_test.tsv")],
                         capsys)
    assert status == 2 and "--other-tsv F" in err and len(err.strip().splitlines()) == 1
    config = tmp_path / "bad.yaml"
    config.write_text((data / "clip.yaml").read_text().replace("projection: 8", "projection: 8\n  d_model: 4"))
    status, _, err = run(["train", str(config), "--out", str(tmp_path / "out")], capsys)
    assert status == 2 and "exactly ['towers', 'projection']" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    config.write_text((data / "clip.yaml").read_text().replace("n_heads: 2", "n_heads: 3", 1))
    status, _, err = run(["train", str(config), "--out", str(tmp_path / "out")], capsys)
    assert status == 2 and "model.towers.image" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    status, _, err = run(["train", str(data / "clip.yaml"), "--set", "train.init_from=x", "--out",
                          str(tmp_path / "out")], capsys)
    assert status == 2 and "trains new towers" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()

