"""Uploads to `atencion serve` (multipart forms, python-multipart): /classify takes an image for a
ViT and a WAV file for a speech classifier, /transcribe a WAV file for a speech-to-text model, each
answering what the library computes (and, with attention: true, the [CLS] attention and rollout or
the cross-attention); a body over the limit is 413, a bad file or form 422 naming the field, a
model of the wrong kind 400."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.decode.settings import DecodeConfig
from atencion.nn.inputs import read_spectrogram
from atencion.nn.model_dir import load_model_dir
from atencion.serve.app import LoadedModel, ServeSettings, create_app
from atencion.tasks.transcribe import transcribe_inputs
from atencion.viz.attention import capture_input_attention
from test_audio import ONE_HZ, raw_wav
from test_images import blank_png
from test_input_attention import _vit
from test_speech import speech_model, tones  # noqa: F401 - the fixtures, used by name

fastapi_testclient = pytest.importorskip("fastapi.testclient")
pytest.importorskip("python_multipart", reason="uploads need the python-multipart package")


def _speech_classifier() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=0, arch="encoder", n_layers=1, d_model=16, d_ff=32, n_heads=2,
                                   num_labels=3, labels=["low", "middle", "high"], dropout=0.0, norm_first=True,
                                   activation="gelu", pooling="mean",
                                   inputs={"kind": "spectrogram", "n_mels": 40, "max_frames": 100})).eval()


@pytest.fixture(scope="module")
def client(speech_model):  # noqa: F811
    _, best = speech_model
    transcriber, tokenizer = load_model_dir(best)
    models = [LoadedModel("vit", "", _vit(), None), LoadedModel("speech", "", _speech_classifier(), None),
              LoadedModel("stt", str(best), transcriber, tokenizer)]
    with fastapi_testclient.TestClient(create_app(models, ServeSettings(max_body_bytes=64_000))) as client:
        yield client, models


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def test_classify_takes_an_image_and_returns_the_probabilities_and_the_rollout(client):
    client, models = client
    image = np.random.default_rng(0).random((4, 6)).astype(np.float32)
    r = client.post("/classify", files={"file": ("digit.npy", _npy(image))}, data={"model": "vit", "attention": "true"})
    assert r.status_code == 200, r.text
    body = r.json()
    with torch.no_grad():
        expected = models[0].model.classify(torch.from_numpy(image)[None, None]).softmax(-1)[0]
    np.testing.assert_allclose(list(body["predictions"][0]["probabilities"].values()), expected.numpy(), atol=1e-5)
    attention = capture_input_attention(models[0].model, None, torch.from_numpy(image)[None])
    np.testing.assert_allclose(body["attention"]["rollout"], attention.rollout[0], atol=1e-5)
    assert body["attention"]["grid"] == [2, 3]
    r = client.post("/classify", files={"file": ("digit.npy", _npy(image))}, data={"model": "vit"})
    assert r.status_code == 200 and "attention" not in r.json()


def test_classify_takes_a_wav_file_for_a_speech_classifier(client, tones):  # noqa: F811
    client, models = client
    wav = tones / "wav" / "valid_middle_0.wav"
    r = client.post("/classify", files={"file": ("clip.wav", wav.read_bytes())}, data={"model": "speech"})
    assert r.status_code == 200, r.text
    frames = read_spectrogram(wav, models[1].model.cfg.inputs)
    with torch.no_grad():
        expected = models[1].model.classify(frames[None], lengths=torch.tensor([frames.size(1)])).softmax(-1)[0]
    answer = r.json()["predictions"][0]
    assert answer["label"] == ["low", "middle", "high"][int(expected.argmax())]
    np.testing.assert_allclose(list(answer["probabilities"].values()), expected.numpy(), atol=1e-5)


def test_transcribe_takes_a_wav_file_and_returns_the_greedy_text_and_cross_attention(client, tones):  # noqa: F811
    client, models = client
    wav = tones / "wav" / "valid_high_1.wav"
    frames = read_spectrogram(wav, models[2].model.cfg.inputs)
    expected = transcribe_inputs(models[2].model, models[2].tokenizer, [frames], DecodeConfig(beam=1))[0][0].text
    r = client.post("/transcribe", files={"file": ("clip.wav", wav.read_bytes())}, data={"model": "stt"})
    assert r.status_code == 200 and r.json()["text"] == expected, r.text
    r = client.post("/transcribe", files={"file": ("clip.wav", wav.read_bytes())},
                    data={"model": "stt", "attention": "true"})
    body = r.json()
    assert r.status_code == 200 and body["text"] == expected
    assert body["attention"]["cross"]["rows"] == list(expected) + ["</s>"]


@pytest.mark.parametrize("path, files, data, status, message", [
    ("/classify", {"file": ("big.npy", b"\0" * 70_000)}, {"model": "vit"}, 413, "larger than 64000 bytes"),
    ("/classify", {"file": ("digit.png", b"not a picture")}, {"model": "vit"}, 422,
     "file: digit.png: not a PNG or NPY image"),
    ("/classify", {"file": ("digit.npy", _npy(np.zeros((5, 5), np.float32)))}, {"model": "vit"}, 422,
     "file: digit.npy: an image of 5 × 5 pixels"),
    ("/classify", {"file": ("clip.wav", b"")}, {"model": "speech"}, 422, "file: the upload 'clip.wav' is empty; "
                                                                          "expected a WAV file"),
    ("/classify", {"file": ("clip.wav", b"RIFF....WAVEjunk")}, {"model": "speech"}, 422, "file: clip.wav: "),
    ("/classify", {"other": ("x.npy", b"1")}, {"model": "vit"}, 422, "other: unknown field"),
    ("/classify", {"file": ("d.npy", b"1")}, {"model": "vit", "attention": "maybe"}, 422,
     "attention: expected true or false"),
    ("/transcribe", {"file": ("clip.wav", b"RIFF")}, {"model": "vit"}, 400, "/transcribe needs a speech-to-text"),
    ("/classify", {"file": ("clip.wav", b"RIFF")}, {"model": "stt"}, 400, "/classify needs"),
])
def test_a_bad_upload_is_answered_with_its_status_and_one_line_naming_the_field(client, path, files, data, status,
                                                                                 message):
    client, _ = client
    r = client.post(path, files=files, data=data)
    assert r.status_code == status and message in r.json()["error"], r.text
    assert "\n" not in r.json()["error"]



@pytest.mark.parametrize("path, model, name, make, message", [
    ("/classify", "vit", "bomb.png", lambda: blank_png(20_000, 20_000), "file: bomb.png: an image of 400,000,000 "
                                                                          "pixels"),
    ("/classify", "vit", "large.png", lambda: blank_png(9_000, 9_000), "file: large.png: an image of 9000 × 9000 "
                                                                         "pixels"),
    ("/classify", "vit", "noise.png", lambda: b"\x89PNG\r\n\x1a\n" + bytes(64), "file: noise.png: not a PNG"),
    ("/classify", "vit", "noise.gif", lambda: b"GIF89a" + bytes(20), "file: noise.gif: not a PNG"),
    ("/classify", "speech", "clip.wav", lambda: raw_wav(fmt_size=0xFFFF_FFFF), "file: clip.wav: not a readable PCM "
                                                                                "WAV file (its fmt chunk says"),
    ("/transcribe", "stt", "clip.wav", lambda: raw_wav(fmt_size=0xFFFF_FFFF), "file: clip.wav: not a readable PCM "
                                                                               "WAV file (its fmt chunk says"),
    ("/classify", "speech", "slow.wav", lambda: ONE_HZ, "file: slow.wav: a sample rate of 1 Hz; expected 1,000"),
    ("/transcribe", "stt", "slow.wav", lambda: ONE_HZ, "file: slow.wav: a sample rate of 1 Hz; expected 1,000"),
    ("/transcribe", "stt", "many.wav", lambda: raw_wav(channels=65_535), "file: many.wav: the header says 65535 "
                                                                          "channels; expected 1 to 256"),
])
def test_a_hostile_image_or_recording_is_a_422_in_one_line_not_a_500(client, path, model, name, make, message):
    client, _ = client
    r = client.post(path, files={"file": (name, make())}, data={"model": model})
    assert r.status_code == 422 and message in r.json()["error"], r.text
    assert "\n" not in r.json()["error"]
    assert "atencion-upload-" not in r.json()["error"] and "/upload" not in r.json()["error"], r.text  # no server path


def test_json_to_a_model_that_reads_files_is_told_to_upload_one(client):
    client, _ = client
    r = client.post("/classify", json={"texts": ["seven"], "model": "vit"})
    assert r.status_code == 400 and "upload an image" in r.json()["error"] and "field 'file'" in r.json()["error"]
    r = client.post("/transcribe", json={"model": "stt"})
    assert r.status_code == 400 and "upload a WAV file" in r.json()["error"]
    assert client.get("/health").status_code == 200


def test_info_lists_each_models_endpoints_the_upload_ones_included(client):
    client, _ = client
    r = client.get("/info")
    assert r.status_code == 200, r.text
    endpoints = {m["name"]: m["endpoints"] for m in r.json()["models"]}
    assert endpoints == {"vit": ["/classify"], "speech": ["/classify"], "stt": ["/transcribe"]}
    assert r.json()["models"][0]["vocab_size"] is None  # a ViT has no tokenizer
