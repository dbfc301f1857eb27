"""Audio in: WAV files read with the standard library's wave (every PCM width, stereo to mono),
resampled by a band-limited filter equal to scipy's resample_poly, Whisper's mel filter bank and
log-mel frames equal to librosa's and to Hugging Face's WhisperFeatureExtractor (NumPy), and
the FSDD archive written as TSV splits; bad files refused in one line that names them."""

from __future__ import annotations

import io
import json
import math
import struct
import tarfile
import time
import tracemalloc
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from atencion.data.audio import (
    HOP,
    N_FFT,
    SAMPLE_RATE,
    decode_wav,
    hz_to_mel,
    load_audio,
    load_features,
    log_mel,
    mel_filters,
    mel_to_hz,
    read_wav,
    resample,
)
from atencion.data.fsdd import WORDS, read_archive, write_fsdd
from atencion.data.fsdd import main as fsdd_main
from atencion.errors import AtencionError

FSDD = Path(__file__).resolve().parents[1] / "../shared/data/fsdd/recordings.tar.gz"
if not FSDD.exists():  # a worktree beside the main checkout
    FSDD = Path("/work/shared/data/fsdd/recordings.tar.gz")


def wav_bytes(samples: np.ndarray, rate: int = 8000, width: int = 2) -> bytes:
    """A PCM WAV of integer ``samples`` ((frames,) or (frames, channels)) written by ``wave``."""
    samples = samples.reshape(len(samples), -1 if samples.size else 1)
    if width == 1:
        raw = (samples + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in samples.ravel())
    else:
        raw = samples.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buffer.getvalue()


def speech_like(n: int = 12_000, seed: int = 0) -> np.ndarray:
    """A 16 kHz test signal with speech's spread: a gliding tone, harmonics and a little noise."""
    t = np.arange(n) / SAMPLE_RATE
    rng = np.random.default_rng(seed)
    tone = sum(np.sin(2 * np.pi * k * (150 + 200 * t) * t) / k for k in range(1, 6))
    return (0.2 * tone * np.hanning(n) + 0.01 * rng.standard_normal(n)).astype(np.float32)


# reading WAV files ------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_every_pcm_width_reads_as_the_same_fraction_of_full_scale(tmp_path, width):
    full = 2 ** (8 * width - 1)
    fractions = np.array([0.0, 0.5, -0.5, -1.0, 0.25])
    path = tmp_path / "x.wav"
    path.write_bytes(wav_bytes((fractions * full).astype(np.int64), 11025, width))
    samples, rate = read_wav(path)
    assert rate == 11025 and samples.dtype == np.float32
    np.testing.assert_allclose(samples, fractions, atol=1e-7)


def test_stereo_is_read_as_the_mean_of_its_channels(tmp_path):
    left, right = np.array([1000, -2000, 3000]), np.array([3000, 0, -3000])
    path = tmp_path / "stereo.wav"
    path.write_bytes(wav_bytes(np.stack([left, right], 1)))
    samples, _ = read_wav(path)
    np.testing.assert_allclose(samples, (left + right) / 2 / 32768, atol=1e-7)


def _float_wav() -> bytes:
    """A WAV of IEEE float samples (format 3), which wave does not read."""
    data = np.zeros(4, "<f4").tobytes()
    fmt = (3).to_bytes(2, "little") + (1).to_bytes(2, "little") + (8000).to_bytes(4, "little") \
        + (32000).to_bytes(4, "little") + (4).to_bytes(2, "little") + (32).to_bytes(2, "little")
    body = b"WAVE" + b"fmt " + len(fmt).to_bytes(4, "little") + fmt + b"data" + len(data).to_bytes(4, "little") + data
    return b"RIFF" + len(body).to_bytes(4, "little") + body


@pytest.mark.parametrize("content, says", [
    (b"", "empty file"),
    (b"label\tpath\n7\tseven.wav\n", "not a WAV file"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00", "not a readable PCM WAV"),  # header cut short
    (wav_bytes(np.arange(100))[:-50], "truncated"),
    (wav_bytes(np.zeros(0)), "holds no samples"),
    (_float_wav(), "not a readable PCM WAV"),
])
def test_a_bad_wav_is_refused_in_one_line_naming_the_file(tmp_path, content, says):
    path = tmp_path / "bad.wav"
    path.write_bytes(content)
    with pytest.raises(AtencionError) as err:
        read_wav(path, where=f"train.tsv line 3: {path}")
    message = str(err.value)
    assert message.startswith(f"train.tsv line 3: {path}: ") and says in message and "\n" not in message


def test_a_missing_path_or_a_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.wav: file not found"):
        read_wav(tmp_path / "nowhere.wav")
    with pytest.raises(AtencionError, match="is a directory"):
        load_features(tmp_path)


def test_a_recording_too_short_for_one_frame_is_refused_naming_it(tmp_path):
    path = tmp_path / "click.wav"
    path.write_bytes(wav_bytes(np.ones(50, np.int64) * 1000))  # 100 samples at 16 kHz
    with pytest.raises(AtencionError, match=r"click\.wav: 100 samples .* too short"):
        load_features(path)



def raw_wav(channels: int = 1, rate: int = 8000, bits: int = 16, samples: bytes = bytes(200), tag: int = 1,
            fmt_size: int | None = None, data_size: int | None = None, before_fmt: bytes = b"") -> bytes:
    """A WAV file written field by field, so that any field can lie: ``fmt_size`` and ``data_size``
    replace the chunks' true sizes, ``before_fmt`` is put between the RIFF header and the fmt chunk."""
    width = (bits + 7) // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * width % 2 ** 32, channels * width % 2 ** 16,
                      bits)
    body = (b"WAVE" + before_fmt + b"fmt " + struct.pack("<I", len(fmt) if fmt_size is None else fmt_size) + fmt
            + b"data" + struct.pack("<I", len(samples) if data_size is None else data_size) + samples)
    return b"RIFF" + struct.pack("<I", len(body)) + body


ONE_HZ = raw_wav(rate=1, samples=bytes(16_000))  # 8,000 samples: 2 h 13 min, 128 million samples at 16 kHz


@pytest.mark.parametrize("content, says", [
    (raw_wav(fmt_size=0xFFFF_FFFF), "not a readable PCM WAV file (its fmt chunk says 4294967295 bytes"),
    (raw_wav(fmt_size=12), "not a readable PCM WAV file (its fmt chunk says 12 bytes; expected at least 16)"),
    (raw_wav(data_size=0xFFFF_FFF0), "truncated: the header announces 2147483640 frames, the file holds 100"),
    (raw_wav(channels=0), "0 channels; expected 1 to 256"),
    (raw_wav(channels=65_535), "65535 channels; expected 1 to 256"),
    (raw_wav(rate=0), "a sample rate of 0 Hz; expected 1,000 to 384,000 Hz"),
    (ONE_HZ, "a sample rate of 1 Hz; expected 1,000 to 384,000 Hz"),
    (raw_wav(rate=4_000_000_000), "a sample rate of 4,000,000,000 Hz; expected 1,000 to 384,000 Hz"),
    (raw_wav(rate=96_001), "a sample rate of 96,001 Hz goes to 16,000 Hz only through a filter of 1,920,021 taps"),
    (raw_wav(bits=40, samples=bytes(200)), "40-bit samples; expected 8-, 16-, 24- or 32-bit PCM"),
    (raw_wav(bits=0), "0-bit samples; expected 8-, 16-, 24- or 32-bit PCM"),
    (raw_wav(tag=3), "not a readable PCM WAV file (format 3, IEEE float; expected format 1, integer PCM)"),
    (raw_wav(before_fmt=b"LIST" + struct.pack("<I", 0xFFFF_FFFF)), "not a readable PCM WAV file (it ends before "
                                                                   "its fmt chunk)"),
    (b"RIFF\x00\x00\x00\x00WAVEdata\x04\x00\x00\x00\x00\x00\x00\x00", "not a readable PCM WAV file (its data chunk "
                                                                      "comes before its fmt chunk)"),
])
def test_a_malformed_wav_header_is_refused_in_one_line_fast_and_small(tmp_path, content, says):
    path = tmp_path / "odd.wav"
    path.write_bytes(content)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(AtencionError) as err:
            load_features(path, where=f"train.tsv line 3: {path}")
        seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert message.startswith(f"train.tsv line 3: {path}: ") and says in message and "\n" not in message, message
    assert seconds < 0.5 and peak < 2 * len(content) + (1 << 20)  # the header read, not the samples


def test_the_one_hz_recording_of_the_issue_is_refused_by_read_wav_and_decode_wav_alike(tmp_path):
    (tmp_path / "slow.wav").write_bytes(ONE_HZ)
    for read in (lambda: read_wav(tmp_path / "slow.wav"), lambda: decode_wav(ONE_HZ, "slow.wav")):
        with pytest.raises(AtencionError, match=r"slow\.wav: a sample rate of 1 Hz; expected 1,000 to 384,000 Hz"):
            read()


@pytest.mark.parametrize("rate", [1_000, 5_512, 44_056, 44_099, 47_999, 88_200, 352_800, 384_000])
def test_every_rate_in_range_with_a_bounded_filter_is_read_and_resampled_as_scipy_does(tmp_path, rate):
    signal = pytest.importorskip("scipy.signal", reason="scipy is not installed (scikit-learn and librosa bring it)")
    ints = np.random.default_rng(rate).integers(-20_000, 20_000, rate // 10)
    path = tmp_path / "x.wav"
    path.write_bytes(raw_wav(rate=rate, samples=ints.astype("<i2").tobytes()))
    samples, got_rate = read_wav(path)
    assert got_rate == rate
    g = math.gcd(rate, SAMPLE_RATE)
    expected = signal.resample_poly(samples.astype(np.float64), SAMPLE_RATE // g, rate // g)
    np.testing.assert_allclose(resample(samples, rate), expected, atol=1e-6)


def test_resampling_from_the_highest_rate_works_in_bounded_memory():
    """384 kHz to 16 kHz: 481 taps meet each output sample; the products are summed a bounded
    number of outputs at a time, not 65,536 at once (250 MB for each of five arrays)."""
    x = np.random.default_rng(0).standard_normal(384_000)  # one second
    tracemalloc.start()
    try:
        out = resample(x, 384_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (16_000,) and peak < 64 << 20


def test_a_rate_whose_filter_would_be_huge_is_refused_by_resample_itself():
    with pytest.raises(AtencionError, match=r"resampling 383,999 Hz to 16,000 Hz needs a filter of 7,679,981 taps "
                                            r"\(16,000/383,999 in lowest terms\); at most 960,001 are built"):
        resample(np.zeros(10), 383_999)


def test_a_recording_longer_than_max_frames_is_refused_from_its_header_before_its_samples_are_read(tmp_path,
                                                                                                     monkeypatch):
    path = tmp_path / "long.wav"
    path.write_bytes(wav_bytes(np.zeros(8_000, np.int64), 8000))  # 1 s: 16,000 samples at 16 kHz, 100 frames
    assert load_features(path, max_frames=100).shape == (80, 100)

    def read(*args, **kwargs):
        raise AssertionError("the samples were read")

    import atencion.data.audio as audio

    monkeypatch.setattr(audio, "_pcm_to_float", read)
    monkeypatch.setattr(audio, "resample", read)
    with pytest.raises(AtencionError, match=r"long\.wav: 100 frames \(1\.00 s\), more than inputs\.max_frames=99"):
        load_features(path, max_frames=99)
    with pytest.raises(AtencionError, match=r"long\.wav: 100 frames \(1\.00 s\), more than inputs\.max_frames=50"):
        load_audio(path, max_frames=50)


# resampling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate, new_rate", [(8000, 16000), (44100, 16000), (48000, 16000), (22050, 16000),
                                            (11025, 16000), (16000, 8000)])
@pytest.mark.parametrize("length", [1, 7, 3001])
def test_resampling_equals_scipys_resample_poly(rate, new_rate, length):
    signal = pytest.importorskip("scipy.signal", reason="scipy is not installed (scikit-learn and librosa bring it)")
    x = np.random.default_rng(length).standard_normal(length)
    g = math.gcd(rate, new_rate)
    expected = signal.resample_poly(x, new_rate // g, rate // g)
    got = resample(x, rate, new_rate, chunk=512)  # several chunks
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_sine_resampled_to_16khz_is_the_sine_sampled_at_16khz():
    """3 kHz at 8 kHz is near the old Nyquist frequency: linear interpolation between samples
    would miss its values by ~0.4; a band-limited filter gives them back."""
    seconds = 0.5
    slow = np.sin(2 * np.pi * 3000 * np.arange(int(8000 * seconds)) / 8000)
    fast = np.sin(2 * np.pi * 3000 * np.arange(int(16000 * seconds)) / 16000)
    got = resample(slow, 8000, 16000)
    middle = slice(400, -400)  # away from the edges, where the filter meets zeros beyond the recording
    assert np.abs(got[middle] - fast[middle]).max() < 0.02
    linear = np.interp(np.arange(len(fast)) / 2, np.arange(len(slow)), slow)
    assert np.abs(linear[middle] - fast[middle]).max() > 0.3  # so the test can tell the two apart


def test_the_same_rate_is_left_as_it_is():
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    np.testing.assert_array_equal(resample(x, 16000, 16000), x)


# the mel filter bank and the log-mel frames -----------------------------------------------------


def test_slaneys_mel_scale_at_its_known_points():
    # linear below 1 kHz at 3/200 mel per Hz; 27 mel per factor 6.4 above (Slaney's Auditory Toolbox)
    np.testing.assert_allclose(hz_to_mel([0.0, 200 / 3, 500.0, 1000.0, 6400.0, 1000 * 6.4 ** 2]),
                               [0.0, 1.0, 7.5, 15.0, 42.0, 69.0], atol=1e-12)
    hz = np.array([0.0, 123.0, 999.0, 1000.0, 4321.0, 8000.0])
    np.testing.assert_allclose(mel_to_hz(hz_to_mel(hz)), hz, atol=1e-9)


def test_each_filter_is_a_triangle_of_slaneys_area_between_its_mel_edges():
    """The formula's own values, written out here: 82 edges evenly spaced in mel from 0 to
    hz_to_mel(8000) = 15 + 27 · ln(8) / ln(6.4); filter i peaks at edge i + 1, and its height
    there is 2 / (edge i+2 − edge i) in Hz."""
    weights = mel_filters().double().numpy()
    assert weights.shape == (80, 201)
    top = 15 + 27 * math.log(8) / math.log(6.4)
    edges = [m * 200 / 3 if m < 15 else 1000 * 6.4 ** ((m - 15) / 27) for m in np.linspace(0, top, 82)]
    bins = np.arange(201) * 40.0  # 16000 / 400 Hz apart
    for i in (0, 10, 40, 79):
        lo, peak, hi = edges[i:i + 3]
        expected = np.clip(np.minimum((bins - lo) / (peak - lo), (hi - bins) / (hi - peak)), 0, None) * 2 / (hi - lo)
        np.testing.assert_allclose(weights[i], expected, atol=1e-8)
    assert (weights > 0).any(axis=1).all()  # no empty filter at this resolution (whisper's 80 bins)


def test_the_mel_filter_bank_equals_librosas():
    librosa = pytest.importorskip("librosa", reason="librosa is not installed (requirements-test.txt)")
    expected = librosa.filters.mel(sr=16000, n_fft=400, n_mels=80)  # Slaney scale and norm by default
    np.testing.assert_allclose(mel_filters().numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(mel_filters(128).numpy(), librosa.filters.mel(sr=16000, n_fft=400, n_mels=128),
                               atol=1e-6)


def _librosa_log_mel(librosa, audio: np.ndarray) -> np.ndarray:
    """Whisper's recipe on librosa's power mel spectrogram (a centred STFT with reflected padding)."""
    power = librosa.feature.melspectrogram(y=audio.astype(np.float64), sr=16000, n_fft=400, hop_length=160,
                                           n_mels=80, power=2.0, center=True, pad_mode="reflect")
    log_spec = np.log10(np.maximum(power, 1e-10))[:, :-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def _recordings(n: int = 3) -> list[np.ndarray]:
    """A synthetic signal and, where the archive is there, the first FSDD recordings at 16 kHz."""
    out = [speech_like()]
    if FSDD.exists():
        for name, data in sorted(read_archive(FSDD).items())[:n]:
            samples, rate = decode_wav(data, name)
            out.append(resample(samples, rate))
    return out


def test_log_mel_frames_equal_librosas_within_1e_4():
    librosa = pytest.importorskip("librosa", reason="librosa is not installed (requirements-test.txt)")
    for audio in _recordings():
        got = log_mel(torch.from_numpy(audio))
        expected = _librosa_log_mel(librosa, audio)
        assert got.shape == expected.shape == (80, len(audio) // HOP)
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-4)


def test_log_mel_frames_equal_hugging_faces_whisper_feature_extractor():
    transformers = pytest.importorskip("transformers")
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)  # built from its constructor: no download
    for audio in _recordings():
        expected = extractor._np_extract_fbank_features(audio[None].astype(np.float64), "cpu")[0]  # NumPy's path
        np.testing.assert_allclose(log_mel(torch.from_numpy(audio)).numpy(), expected, atol=1e-4)


def test_whisper_drops_the_last_stft_frame_and_clips_80_db_below_the_peak():
    audio = torch.from_numpy(speech_like(4000))
    frames = log_mel(audio.double())
    assert frames.shape == (80, 4000 // HOP)
    power = torch.stft(audio.double(), N_FFT, HOP, window=torch.hann_window(N_FFT, dtype=torch.float64),
                       return_complex=True).abs() ** 2
    assert power.shape[-1] == frames.shape[-1] + 1  # one more frame, dropped
    log_spec = (mel_filters().double() @ power[:, :-1]).clamp(min=1e-10).log10()
    assert frames.max() == pytest.approx((float(log_spec.max()) + 4) / 4)
    assert frames.min() >= (float(log_spec.max()) - 8 + 4) / 4 - 1e-9
    silent = log_mel(torch.zeros(1600))
    assert torch.equal(silent, torch.full((80, 10), (-10 + 4) / 4))  # log10(1e-10), never -inf


# FSDD ---------------------------------------------------------------------------------------


def _small_archive(path: Path, speakers=("ann", "bob"), digits=range(10), indices=range(12),
                   corrupt: str | None = None) -> Path:
    """A .tar.gz laid out as FSDD's: recordings/{digit}_{speaker}_{index}.wav, plus a README."""
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w:gz") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("recordings/README.txt", b"not a recording")
        for digit in digits:
            for speaker in speakers:
                for index in indices:
                    name = f"{digit}_{speaker}_{index}.wav"
                    data = b"garbage" if name == corrupt else wav_bytes(rng.integers(-999, 999, 800))
                    add(f"recordings/{name}", data)
    return path


def _rows(path: Path) -> list[tuple[str, Path]]:
    rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    return [(label, (path.parent / wav).resolve()) for label, wav in rows]


def test_fsdd_splits_follow_the_datasets_convention_and_leave_each_speaker_out(tmp_path):
    archive = _small_archive(tmp_path / "recordings.tar.gz")
    out = tmp_path / "data"
    assert fsdd_main([str(out), "--archive", str(archive)]) == 0
    splits = {split: _rows(out / f"{split}.tsv") for split in ("train", "valid", "test")}
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [2 * 10 * 2, 2 * 10 * 5, 2 * 10 * 5]

    def index(wav: Path) -> int:
        return int(wav.stem.split("_")[2])

    assert {index(w) for _, w in splits["test"]} == set(range(5))
    assert {index(w) for _, w in splits["valid"]} == set(range(5, 10))
    assert {index(w) for _, w in splits["train"]} == {10, 11}
    for label, wav in [row for rows in splits.values() for row in rows]:
        assert wav.stem.split("_")[0] == label and wav.is_file()
        read_wav(wav)
    text = _rows(out / "test_text.tsv")
    assert [(WORDS[int(label)], wav) for label, wav in splits["test"]] == text
    assert text[0][0] == "zero" and {word for word, _ in text} == set(WORDS)
    for held_out, other in (("ann", "bob"), ("bob", "ann")):
        folder = out / f"speaker_{held_out}"
        test, train, valid = (_rows(folder / f"{s}.tsv") for s in ("test", "train", "valid"))
        assert {w.stem.split("_")[1] for _, w in test} == {held_out} and len(test) == 10 * 12
        assert {w.stem.split("_")[1] for _, w in train + valid} == {other}
        assert {index(w) for _, w in valid} == set(range(5, 10)) and len(train) == 10 * 7
        assert all(w.is_file() for _, w in test + train + valid)


def test_fsdd_refuses_a_corrupt_recording_naming_it_and_writes_nothing(tmp_path, capsys):
    archive = _small_archive(tmp_path / "bad.tar.gz", speakers=("ann",), indices=range(2), corrupt="3_ann_1.wav")
    out = tmp_path / "data"
    assert fsdd_main([str(out), "--archive", str(archive)]) == 2
    err = capsys.readouterr().err
    assert "recordings/3_ann_1.wav: not a WAV file" in err and err.count("\n") == 1
    assert not out.exists()
    (tmp_path / "not.tar.gz").write_bytes(b"plain text")
    assert fsdd_main([str(out), "--archive", str(tmp_path / "not.tar.gz")]) == 2
    assert "not.tar.gz: not a readable tar archive" in capsys.readouterr().err and not out.exists()


def test_fsdd_refuses_to_overwrite_its_splits_without_force(tmp_path, capsys):
    archive = _small_archive(tmp_path / "r.tar.gz", speakers=("ann",), indices=range(11))
    out = tmp_path / "data"
    assert fsdd_main([str(out), "--archive", str(archive)]) == 0
    capsys.readouterr()
    before = (out / "train.tsv").read_text()
    assert fsdd_main([str(out), "--archive", str(archive)]) == 2
    assert "exists; nothing was overwritten" in capsys.readouterr().err
    assert fsdd_main([str(out), "--archive", str(archive), "--force"]) == 0
    assert (out / "train.tsv").read_text() == before


@pytest.mark.skipif(not FSDD.exists(), reason="FSDD's recordings.tar.gz is not in ../shared/data/fsdd")
def test_the_real_archive_gives_fsdds_counts(tmp_path):
    report = write_fsdd(tmp_path / "fsdd", FSDD)
    assert report["recordings"] == 2500 and len(report["speakers"]) == 5
    rows = report["rows"]
    assert (rows["train.tsv"], rows["valid.tsv"], rows["test.tsv"]) == (2000, 250, 250)
    for speaker in report["speakers"]:
        assert [rows[f"speaker_{speaker}/{s}.tsv"] for s in ("train", "valid", "test")] == [1800, 200, 500]
    assert json.dumps(report)
