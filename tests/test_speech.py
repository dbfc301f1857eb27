"""The speech Transformer: Whisper's front end (two convolutions, the second of stride 2, GELU)
into the encoder, equal to Hugging Face's Whisper with the same weights; recordings of different
lengths batched with a key-padding mask, each getting what it gets alone; speech to text trained
as a translator (its loss falls in seconds), `atencion transcribe` and `atencion evaluate` on WAV
files; bad settings and bad files refused in one line, with nothing written."""

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
from atencion.decode.search import beam_search, greedy_search
from atencion.errors import AtencionError
from atencion.nn.inputs import INPUTS, frame_positions, pad_frames
from atencion.train.config import load_config
from atencion.train.trainer import train
from conftest import run_cli as run

SPECTROGRAM = {"kind": "spectrogram", "n_mels": 8, "max_frames": 40}


def tiny(**values) -> ModelConfig:
    base = dict(vocab_size=0, arch="encoder-decoder", tgt_vocab_size=30, share_embeddings=False, n_layers=2,
                d_model=16, d_ff=32, n_heads=2, dropout=0.0, norm_first=True, activation="gelu",
                inputs=SPECTROGRAM)
    return ModelConfig(**{**base, **values})




# the front end against Hugging Face's Whisper -----------------------------------------------------


def _whisper_pair(frames: int = 16, n_mels: int = 8):
    """Hugging Face's WhisperForConditionalGeneration with random weights and ours, the weights copied
    (Whisper's k_proj has no bias: ours is zero). Learned positions of max_positions = frames / 2
    in both stacks, holding Whisper's tables (its encoder's sinusoids, its decoder's learned rows)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=30, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=n_mels,
        max_source_positions=frames // 2, max_target_positions=frames // 2, pad_token_id=0, bos_token_id=2,
        eos_token_id=3, decoder_start_token_id=2, dropout=0.0)).eval()
    ours = Transformer(tiny(positional="learned", max_positions=frames // 2, scale_embedding=False,
                            inputs={**SPECTROGRAM, "n_mels": n_mels, "max_frames": frames})).eval()
    theirs = hf.state_dict()
    with torch.no_grad():
        for name, p in theirs.items():  # layer norms start at 1 and 0: randomise them so the test sees them
            if "layer_norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    state = {}
    for stack in ("encoder", "decoder"):
        hf_stack = f"model.{stack}"
        state[f"{stack}.positions.weight"] = theirs[f"{hf_stack}.embed_positions.weight"]
        state[f"{stack}.final_norm.weight"] = theirs[f"{hf_stack}.layer_norm.weight"]
        state[f"{stack}.final_norm.bias"] = theirs[f"{hf_stack}.layer_norm.bias"]
        for i in range(2):
            hf_layer, layer = f"{hf_stack}.layers.{i}", f"{stack}.layers.{i}"
            attentions = [("self_attn", "self_attn", "res_self")]
            if stack == "decoder":
                attentions.append(("encoder_attn", "cross_attn", "res_cross"))
            for hf_name, name, residual in attentions:
                q, k, v = (theirs[f"{hf_layer}.{hf_name}.{x}_proj.weight"] for x in "qkv")
                state[f"{layer}.{name}.in_proj.weight"] = torch.cat([q, k, v])
                state[f"{layer}.{name}.in_proj.bias"] = torch.cat([theirs[f"{hf_layer}.{hf_name}.q_proj.bias"],
                                                                   torch.zeros(16),
                                                                   theirs[f"{hf_layer}.{hf_name}.v_proj.bias"]])
                for x in ("weight", "bias"):
                    state[f"{layer}.{name}.out_proj.{x}"] = theirs[f"{hf_layer}.{hf_name}.out_proj.{x}"]
                    state[f"{layer}.{residual}.norm.{x}"] = theirs[f"{hf_layer}.{hf_name}_layer_norm.{x}"]
            for x in ("weight", "bias"):
                state[f"{layer}.ffn.linear1.{x}"] = theirs[f"{hf_layer}.fc1.{x}"]
                state[f"{layer}.ffn.linear2.{x}"] = theirs[f"{hf_layer}.fc2.{x}"]
                state[f"{layer}.res_ffn.norm.{x}"] = theirs[f"{hf_layer}.final_layer_norm.{x}"]
    for conv in ("conv1", "conv2"):
        for x in ("weight", "bias"):
            state[f"encoder.embed.{conv}.{x}"] = theirs[f"model.encoder.{conv}.{x}"]
    state["decoder.embed.weight"] = state["generator.weight"] = theirs["model.decoder.embed_tokens.weight"]
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    return hf, ours


def test_the_speech_transformer_equals_hugging_faces_whisper_with_the_same_weights():
    hf, ours = _whisper_pair()
    frames = torch.randn(3, 8, 16)
    tgt_in = torch.tensor([[2, 5, 9, 11], [2, 7, 7, 4], [2, 20, 3, 0]])
    with torch.no_grad():
        expected = hf(input_features=frames, decoder_input_ids=tgt_in)
        encoded = hf.model.encoder(frames).last_hidden_state
        memory, mask = ours.encode(frames)
        got = ours(frames, tgt_in)
    assert mask is None and memory.shape == (3, 8, 16)  # 16 frames: 8 positions after the stride-2 convolution
    torch.testing.assert_close(memory, encoded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, expected.logits, atol=1e-5, rtol=1e-5)


# recordings of different lengths ----------------------------------------------------------------


def test_a_padded_batch_gives_each_recording_what_it_gets_alone():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    recordings = [torch.randn(8, n) for n in (23, 9, 16, 1)]
    frames, lengths = pad_frames(recordings)
    assert frames.shape == (4, 8, 23) and lengths.tolist() == [23, 9, 16, 1]
    tgt_in = torch.tensor([[2, 5, 9], [2, 7, 7], [2, 11, 0], [2, 4, 6]])
    with torch.no_grad():
        memory, mask = model.encode(frames, lengths=lengths)
        logits = model(frames + 5.0 * (frames == 0), tgt_in, lengths=lengths)  # whatever lies in the padding
        for i, x in enumerate(recordings):
            alone, none = model.encode(x[None])
            n = frame_positions(x.size(1))
            assert none is None and alone.shape[1] == n == int(mask[i].sum()) == math.ceil(x.size(1) / 2)
            torch.testing.assert_close(memory[i, :n], alone[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[i], model(x[None], tgt_in[i:i + 1])[0], atol=1e-5, rtol=1e-5)
    assert mask.shape == (4, 1, 1, 12) and mask[:, 0, 0].sum(-1).tolist() == [12, 5, 8, 1]


def test_a_classifier_of_recordings_pools_the_real_frames_only():
    torch.manual_seed(0)
    model = Transformer(tiny(arch="encoder", tgt_vocab_size=None, num_labels=3, pooling="mean")).eval()
    recordings = [torch.randn(8, n) for n in (30, 7)]
    frames, lengths = pad_frames(recordings)
    with torch.no_grad():
        batch = model.classify(frames, lengths=lengths)
        for i, x in enumerate(recordings):
            torch.testing.assert_close(batch[i], model.classify(x[None])[0], atol=1e-5, rtol=1e-5)


def test_greedy_and_beam_search_over_a_padded_batch_find_what_each_recording_finds_alone():
    torch.manual_seed(1)
    model = Transformer(tiny()).eval()
    recordings = [torch.randn(8, n) for n in (31, 12, 4)]
    frames, lengths = pad_frames(recordings)
    greedy = greedy_search(model, frames, 0.0, 6, lengths=lengths)
    beams = beam_search(model, frames, 3, 0.6, 0.0, 6, lengths=lengths)
    for i, x in enumerate(recordings):
        assert greedy[i] == greedy_search(model, x[None], 0.0, 6)[0]
        assert beams[i][0].tokens == beam_search(model, x[None], 3, 0.6, 0.0, 6)[0][0].tokens
    assert beam_search(model, frames, 1, 0.6, 0.0, 6, lengths=lengths)[1][0].tokens == greedy[1]
    # max_len_a counts the encoder's positions: ceil(frames / 2)
    limited = greedy_search(model, frames, 1.0, 0, lengths=lengths)
    assert all(len(t) <= n for t, n in zip(limited, (16, 6, 2)))


# settings and inputs refused in one line -------------------------------------------------------------


@pytest.mark.parametrize("values, message", [
    ({"inputs": {**SPECTROGRAM, "n_mels": 0}}, "inputs.n_mels must be a positive integer, got 0"),
    ({"inputs": {**SPECTROGRAM, "max_frames": "long"}}, "inputs.max_frames must be a positive integer, got 'long'"),
    ({"inputs": {**SPECTROGRAM, "hop": 160}}, "inputs.hop is not a setting of inputs kind 'spectrogram'"),
    ({"positional": "learned", "max_positions": 19},
     r"max_positions \(19\) must be at least 20: inputs.max_frames 40 frames make 20 positions"),
    ({"arch": "decoder", "tgt_vocab_size": None}, "inputs kind 'spectrogram' .* is read by the encoder of arch "
                                                  "encoder or encoder-decoder, not 'decoder'"),
    ({"tgt_vocab_size": None}, "tgt_vocab_size is missing: the decoder writes tokens"),
    ({"vocab_size": 100}, "vocab_size must be 0 with inputs kind 'spectrogram'"),
])
def test_a_bad_spectrogram_setting_is_one_line_naming_its_key(values, message):
    with pytest.raises(AtencionError, match=message) as err:
        tiny(**values)
    assert "\n" not in str(err.value)


def test_frames_of_another_shape_or_longer_than_max_frames_are_refused():
    model = Transformer(tiny()).eval()
    for bad in (torch.randn(2, 7, 10), torch.randn(8, 10), torch.zeros(2, 8, 10, dtype=torch.long)):
        with pytest.raises(AtencionError, match=r"log-mel frames must be a float tensor .* = \(batch, 8, frames\)"):
            model.encode(bad)
    with pytest.raises(AtencionError, match="41 frames, more than inputs.max_frames=40"):
        model.encode(torch.randn(1, 8, 41))
    with pytest.raises(AtencionError, match=r"lengths must be an integer tensor \(batch,\)"):
        model.encode(torch.randn(2, 8, 10), lengths=torch.tensor([10, 11]))


def test_the_whisper_tiny_preset_has_whispers_shape():
    cfg = ModelConfig.preset("whisper-tiny", tgt_vocab_size=51865)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.inputs) == (
        4, 384, 6, 1536, {"kind": "spectrogram", "n_mels": 80, "max_frames": 3000})
    with torch.device("meta"):
        assert round(Transformer(cfg).num_parameters() / 1e6, 1) == 37.0  # Whisper's 39M has learned decoder positions
    assert INPUTS["spectrogram"].preset == "whisper-tiny"


# speech to text, trained for seconds -------------------------------------------------------------

WORDS = {"low": 300.0, "middle": 1000.0, "high": 2500.0}


def _tone(hz: float, rate: int, seconds: float, rng: np.random.Generator, channels: int = 1) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = rng.uniform(0.2, 0.8) * np.sin(2 * np.pi * hz * t + rng.uniform(0, 6)) + 0.01 * rng.standard_normal(len(t))
    samples = np.repeat((x * 32767).astype("<i2")[:, None], channels, axis=1)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tones(tmp_path_factory) -> Path:
    """Three 'words', each a tone (low, middle, high), recorded at 8, 16 and 22.05 kHz (the last in
    stereo), 0.2-0.5 s long; train_text.tsv and valid_text.tsv list them as text<TAB>wav/NAME.wav,
    train.tsv and valid.tsv the same rows as label<TAB>path."""
    root = tmp_path_factory.mktemp("tones")
    (root / "wav").mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("valid", 4)):
        rows = []
        for word, hz in WORDS.items():
            for i in range(n):
                rate, channels = [(8000, 1), (16000, 1), (22050, 2)][i % 3]
                name = f"wav/{split}_{word}_{i}.wav"
                (root / name).write_bytes(_tone(hz, rate, rng.uniform(0.2, 0.5), rng, channels))
                rows.append(f"{word}\t{name}\n")
        (root / f"{split}_text.tsv").write_text("".join(rows), encoding="utf-8")
        (root / f"{split}.tsv").write_text("".join(rows), encoding="utf-8")  # label<TAB>path: the word as the label
    return root


SPEECH = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.dropout=0.0",
          "model.inputs={kind: spectrogram, n_mels: 40, max_frames: 100}", "data.tokenizer=char",
          "train.warmup=10", "train.lr_peak=0.003", "train.max_tokens=600", "train.progress=false",
          "train.tensorboard=false", "train.log_every=1", "train.valid_every=40", "train.keep_last=1",
          "train.max_epochs=1000",
          "decode.beam=1", "decode.max_len_a=0", "decode.max_len_b=8"]


def _config(tones: Path, *more: str):
    return load_config(None, ["task=transcribe", f"data.train_tsv={tones / 'train_text.tsv'}",
                              f"data.valid_tsv={tones / 'valid_text.tsv'}", *SPEECH, *more])


@pytest.fixture(scope="module")
def speech_model(tones, tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("speech") / "run"
    train(_config(tones, "train.max_steps=120"), out)
    return out, out / "best"


def test_a_speech_to_text_model_trained_for_seconds_lowers_its_loss_and_writes_the_words(speech_model, tones):
    out, best = speech_model
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    valid = [r for r in log if "valid_exact_match" in r]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert valid[-1]["valid_exact_match"] > 0.9 and valid[-1]["valid_loss"] < valid[0]["valid_loss"]
    config = json.loads((best / "config.json").read_text())
    assert (config["task"], config["vocab_size"], config["inputs"]["kind"]) == ("transcribe", 0, "spectrogram")


def test_transcribe_prints_the_text_of_each_wav_path_and_evaluate_scores_a_tsv(speech_model, tones, tmp_path,
                                                                                capsys):
    _, best = speech_model
    rows = [line.split("\t") for line in (tones / "valid_text.tsv").read_text().splitlines()]
    paths = tones / "paths.txt"  # relative to its own folder
    paths.write_text("".join(f"{wav}\n" for _, wav in rows[:6]) + f"{tones / rows[-1][1]}\n")
    status, out, err = run(["transcribe", "--model", str(best), "--input", str(paths), "--beam", "1"], capsys)
    assert status == 0, err
    lines = out.split("\n")[:-1]
    assert len(lines) == 7  # one line out per line in
    assert sum(got == word for got, (word, _) in zip(lines, rows[:6] + rows[-1:])) >= 6
    status, beam_out, _ = run(["transcribe", "--model", str(best), "--input", str(paths), "--beam", "3",
                               "--nbest", "2"], capsys)
    assert status == 0 and len(beam_out.splitlines()) == 7 * 2
    firsts = [line.split(" ||| ")[1] for line in beam_out.splitlines()[::2]]
    assert sum(got == word for got, (word, _) in zip(firsts, rows[:6] + rows[-1:])) >= 6
    status, out, err = run(["evaluate", "--model", str(best), "--tsv", str(tones / "valid_text.tsv"), "--beam", "1"],
                           capsys)
    assert status == 0, err
    result = json.loads(out)
    assert result["task"] == "transcribe" and result["sentences"] == len(rows)
    assert result["exact_match"] > 0.9 and 0 <= result["chrf"] <= 100 and "bleu" in result


def test_transcribe_refuses_a_bad_wav_in_one_line_naming_it_and_writes_nothing(speech_model, tones, tmp_path,
                                                                               capsys):
    _, best = speech_model
    good = tones / "wav" / "valid_low_0.wav"
    paths = tmp_path / "paths.txt"
    paths.write_text(f"{good}\n\n{good}\n")
    status, out, err = run(["transcribe", "--model", str(best), "--input", str(paths)], capsys)
    assert status == 2 and out == "" and err == (f"atencion transcribe: error: {paths} line 2: empty; expected the "
                                                 f"path of a WAV file to transcribe\n")
    for content, says in ((b"", "empty file"), (b"not audio at all", "not a WAV file"),
                          (good.read_bytes()[:30], "not a readable PCM WAV"), (None, "file not found")):
        bad = tmp_path / "bad.wav"
        bad.unlink(missing_ok=True)
        if content is not None:
            bad.write_bytes(content)
        paths = tmp_path / "paths.txt"
        paths.write_text(f"{good}\n{bad}\n")
        output = tmp_path / "out.txt"
        status, out, err = run(["transcribe", "--model", str(best), "--input", str(paths), "--output", str(output)],
                               capsys)
        assert status == 2 and out == "" and not output.exists()
        assert err.startswith(f"atencion transcribe: error: {paths} line 2: {bad}: {says}") and err.count("\n") == 1


def test_training_names_the_tsv_line_of_a_bad_recording(tones, tmp_path):
    tsv = tmp_path / "train_text.tsv"
    (tmp_path / "wav").mkdir()
    (tmp_path / "wav" / "broken.wav").write_bytes(b"RIFF....WAVEjunk")
    tsv.write_text(f"low\t{tones / 'wav' / 'train_low_0.wav'}\nhigh\twav/broken.wav\n")
    with pytest.raises(AtencionError, match=rf"{tsv} line 2: {tmp_path / 'wav' / 'broken.wav'}: not a readable"):
        train(_config(tones, f"data.train_tsv={tsv}", "train.max_steps=1"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    tsv.write_text("low wav/x.wav\n")
    with pytest.raises(AtencionError, match=rf"{tsv} line 1: expected text<TAB>path, found no tab"):
        train(_config(tones, f"data.train_tsv={tsv}", "train.max_steps=1"), tmp_path / "run")


def test_a_speech_model_is_not_a_translator_and_transcribe_needs_recordings(speech_model, tones, capsys, tmp_path):
    _, best = speech_model
    src = tmp_path / "src.txt"
    src.write_text("low\n")
    status, _, err = run(["translate", "--model", str(best), "--input", str(src)], capsys)
    assert status == 2 and "translate needs a translator" in err and "use transcribe" in err
    with pytest.raises(AtencionError, match="model.inputs: task 'transcribe' reads recordings"):
        train(_config(tones, "model.inputs=tokens", "model.preset=tiny"), tmp_path / "run")


# spoken-word classification -------------------------------------------------------------------------


def test_a_classifier_of_recordings_trains_from_wav_files_and_labels_wav_paths(tones, tmp_path, capsys):
    cfg = load_config(None, ["task=classify", f"data.train_tsv={tones / 'train.tsv'}",
                             f"data.valid_tsv={tones / 'valid.tsv'}", "model.preset=whisper-tiny", "model.arch=encoder",
                             "model.pooling=mean", *[s for s in SPEECH if not s.startswith(("data.", "decode."))],
                             "train.max_steps=60"])
    summary = train(cfg, tmp_path / "run")
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    best = summary["best_model"]
    config = json.loads((Path(best) / "config.json").read_text())
    assert (config["arch"], config["vocab_size"], config["labels"]) == ("encoder", 0, ["high", "low", "middle"])
    status, out, err = run(["evaluate", "--model", best, "--tsv", str(tones / "valid.tsv")], capsys)
    assert status == 0, err
    assert json.loads(out)["accuracy"] > 0.9
    rows = [line.split("\t") for line in (tones / "valid.tsv").read_text().splitlines()]
    paths = tmp_path / "paths.txt"
    paths.write_text("".join(f"{tones / wav}\n" for _, wav in rows))
    status, out, err = run(["classify", "--model", best, "--input", str(paths)], capsys)
    assert status == 0, err
    labels = [line.split("\t")[0] for line in out.splitlines()]
    assert len(labels) == len(rows) and sum(a == b for a, (b, _) in zip(labels, rows)) >= 0.9 * len(rows)
    paths.write_text(f"{tones / rows[0][1]}\n{tmp_path / 'missing.wav'}\n")
    status, out, err = run(["classify", "--model", best, "--input", str(paths)], capsys)
    missing = tmp_path / "missing.wav"
    assert status == 2 and out == "" and err == f"atencion classify: error: {paths} line 2: {missing}: file not found\n"


def test_learned_positions_must_hold_the_longest_recording_and_the_longest_text(tones):
    _config(tones, "model.positional=learned", "model.max_positions=50", "data.max_len=49")
    with pytest.raises(AtencionError, match=r"data.max_len gives sequences of up to 61 tokens but the model's "
                                            r"learned positions stop at model.max_positions=50"):
        _config(tones, "model.positional=learned", "model.max_positions=50", "data.max_len=60")
    with pytest.raises(AtencionError, match=r"max_positions \(49\) must be at least 50: inputs.max_frames 100"):
        _config(tones, "model.positional=learned", "model.max_positions=49", "data.max_len=8")
