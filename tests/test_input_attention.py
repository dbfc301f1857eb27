"""Attention over images and recordings: attention rollout (Abnar and Zuidema 2020) equals a hand
computation on two known layers and a direct sum over every path through the layers; `atencion
attention --image` (a ViT) and `--audio` (a speech classifier, a speech-to-text model) write the
figure and the numbers they promise, the numbers the model's own; bad input is one line, exit 2,
nothing written."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.nn.model_dir import save_model_dir
from atencion.viz.attention import attention_rollout, capture_input_attention
from test_speech import run, speech_model, tones  # noqa: F401 - the fixtures, used by name

PATCHES = {"kind": "patches", "patch": 2, "size": [4, 6], "channels": 1}


def _softmax_rows(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = np.exp(rng.normal(size=shape))
    return x / x.sum(-1, keepdims=True)


def test_rollout_of_two_known_layers_is_the_hand_computed_product():
    # layer 1: heads [[1, 0], [.5, .5]] and [[1, 0], [.5, .5]] -> A + I = [[2, 0], [.5, 1.5]] -> rows / 2
    # layer 2: heads [[0, 1], [1, 0]] and [[1, 0], [0, 1]] -> mean [[.5, .5], [.5, .5]] -> + I, rows / 2
    layer1 = np.array([[[1, 0], [0.5, 0.5]]] * 2)
    layer2 = np.array([[[0, 1], [1, 0]], [[1, 0], [0, 1]]])
    a1 = np.array([[1.0, 0.0], [0.25, 0.75]])
    a2 = np.array([[0.75, 0.25], [0.25, 0.75]])
    expected = a2 @ a1  # [[0.8125, 0.1875], [0.4375, 0.5625]]
    np.testing.assert_allclose(expected, [[0.8125, 0.1875], [0.4375, 0.5625]])
    np.testing.assert_allclose(attention_rollout(np.stack([layer1, layer2])), expected, atol=1e-12)
    # the order matters: layer 2 before layer 1 gives another matrix
    assert not np.allclose(attention_rollout(np.stack([layer2, layer1])), expected)


def test_rollout_equals_the_sum_over_every_path_of_the_products_of_half_attention_half_identity():
    rng = np.random.default_rng(0)
    layers, heads, n = 3, 2, 4
    weights = _softmax_rows(rng, layers, heads, n, n)
    mixed = [0.5 * weights[layer].mean(0) + 0.5 * np.eye(n) for layer in range(layers)]
    direct = np.zeros((n, n))
    for i, j in itertools.product(range(n), repeat=2):  # output i of the last layer, input j of the first
        for k1, k2 in itertools.product(range(n), repeat=2):  # the path i <- k2 <- k1 <- j
            direct[i, j] += mixed[2][i, k2] * mixed[1][k2, k1] * mixed[0][k1, j]
    rollout = attention_rollout(weights)
    np.testing.assert_allclose(rollout, direct, atol=1e-12)
    np.testing.assert_allclose(rollout.sum(-1), 1.0, atol=1e-12)


def test_rollout_refuses_weights_that_are_not_square_self_attention():
    with pytest.raises(AtencionError, match="layers, heads, n, n"):
        attention_rollout(np.ones((2, 2, 3, 4)))


def _vit() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=0, arch="encoder", n_layers=2, d_model=16, d_ff=32, n_heads=2,
                                   num_labels=3, dropout=0.0, norm_first=True, activation="gelu",
                                   positional="learned", max_positions=7, scale_embedding=False,
                                   inputs=PATCHES)).eval()


def test_a_vits_cls_attention_and_rollout_are_the_models_own_weights():
    model = _vit()
    image = torch.rand(1, 4, 6)
    attention = capture_input_attention(model, None, image)
    with torch.no_grad():
        _, attn = model(image[None], return_attention=True)
    last = attn["encoder"][-1][0].numpy()  # (heads, 7, 7)
    assert attention.grid == (2, 3) and attention.encoder.cols == ["[CLS]"] + [f"p{i}" for i in range(1, 7)]
    np.testing.assert_allclose(attention.last_layer(), last[:, 0], atol=1e-6)  # the [CLS] row of each head
    expected = attention_rollout(torch.stack(attn["encoder"])[:, 0].numpy())
    np.testing.assert_allclose(attention.rollout, expected, atol=1e-6)
    data = attention.to_json()
    assert data["grid"] == [2, 3] and len(data["rollout"]) == 7 and len(data["last_layer"]) == 2
    np.testing.assert_allclose(data["rollout"], expected[0], atol=1e-5)


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit")
    save_model_dir(root / "model", _vit(), None)
    np.save(root / "image.npy", np.random.default_rng(0).random((4, 6)).astype(np.float32))
    np.save(root / "wrong.npy", np.zeros((5, 5), dtype=np.float32))
    (root / "empty.png").write_bytes(b"")
    (root / "text.png").write_text("not an image")
    return root


def test_attention_image_writes_the_overlay_and_the_numbers(vit_dir, tmp_path, capsys):
    out = tmp_path / "out"
    status, stdout, _ = run(["attention", "--model", str(vit_dir / "model"), "--image", str(vit_dir / "image.npy"),
                             "--out", str(out)], capsys)
    assert status == 0
    summary = json.loads(stdout)
    assert summary["kind"] == "patches" and sorted(p.name for p in out.iterdir()) == ["attention.json",
                                                                                      "attention.png"]
    assert (out / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "attention.json").read_text())
    expected = capture_input_attention(_vit(), None, torch.from_numpy(np.load(vit_dir / "image.npy"))[None])
    np.testing.assert_allclose(data["rollout"], expected.rollout[0], atol=1e-5)
    np.testing.assert_allclose(data["last_layer_mean"], expected.last_layer().mean(0), atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--image", "wrong.npy"], "wrong.npy: an image of 5 × 5 pixels"),
    (["--image", "empty.png"], "empty.png: empty file"),
    (["--image", "text.png"], "text.png: not a PNG or NPY image"),
    (["--image", "missing.png"], "missing.png: image not found"),
    (["--audio", "image.npy"], "--audio: this model reads images"),
    (["--text", "hello"], "--text: this model reads patches, not text: give it --image"),
    (["--image", "image.npy", "--beam", "2"], "--beam is for text"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(vit_dir, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    argv = [vit_dir / a if a.endswith((".npy", ".png")) else a for a in argv]
    status, stdout, stderr = run(["attention", "--model", str(vit_dir / "model"), *map(str, argv), "--out",
                                  str(out)], capsys)
    assert status == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_a_speech_classifier_attends_over_the_frames_with_mean_pooling(tones, tmp_path, capsys):  # noqa: F811
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=0, arch="encoder", n_layers=2, d_model=16, d_ff=32, n_heads=2,
                                    num_labels=3, dropout=0.0, norm_first=True, activation="gelu", pooling="mean",
                                    inputs={"kind": "spectrogram", "n_mels": 40, "max_frames": 100})).eval()
    save_model_dir(tmp_path / "model", model, None)
    wav = tones / "wav" / "valid_low_1.wav"
    status, stdout, stderr = run(["attention", "--model", str(tmp_path / "model"), "--audio", str(wav), "--out",
                                  str(tmp_path / "out")], capsys)
    assert status == 0, stderr
    data = json.loads((tmp_path / "out" / "attention.json").read_text())
    from atencion.nn.inputs import read_spectrogram
    frames = read_spectrogram(wav, model.cfg.inputs)
    with torch.no_grad():
        _, attn = model(frames[None], return_attention=True, lengths=torch.tensor([frames.size(1)]))
    last = attn["encoder"][-1][0].numpy()
    assert data["pooling"] == "mean" and len(data["positions"]) == (frames.size(1) + 1) // 2
    np.testing.assert_allclose(data["last_layer"], last.mean(axis=1), atol=1e-5)  # the mean of the query rows
    np.testing.assert_allclose(sum(data["rollout"]), 1.0, atol=1e-4)


def test_a_speech_to_text_models_cross_attention_has_a_row_per_character_it_writes(speech_model, tones, tmp_path,  # noqa: F811
                                                                                   capsys):
    _, best = speech_model
    wav = tones / "wav" / "valid_high_0.wav"
    status, stdout, stderr = run(["attention", "--model", str(best), "--audio", str(wav), "--out",
                                  str(tmp_path / "out")], capsys)
    assert status == 0, stderr
    summary = json.loads(stdout)
    data = json.loads((tmp_path / "out" / "attention.json").read_text())
    assert summary["kind"] == "transcribe" and data["text"] == summary["text"]
    cross = np.array(data["cross"]["weights"])
    assert data["cross"]["rows"] == list(summary["text"]) + ["</s>"]
    assert cross.shape[2] == len(data["cross"]["rows"]) and cross.shape[3] == len(data["positions"])
    np.testing.assert_allclose(cross.sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(data["cross_last_layer_mean"], cross[-1].mean(0), atol=1e-4)


def test_the_spectrogram_figure_keeps_a_row_for_each_letter_even_when_a_letter_repeats():
    from atencion.viz.plots import spectrogram_attention_figure

    rows = [(letter, np.random.default_rng(i).random(5)) for i, letter in enumerate(["s", "e", "v", "e", "n"])]
    fig = spectrogram_attention_figure(np.zeros((8, 10)), rows, "seven")
    labels = [tick.get_text() for tick in fig.axes[1].get_yticklabels()]
    assert labels == ["s", "e", "v", "e", "n"]
