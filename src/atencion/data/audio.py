"""Audio for a speech Transformer: WAV files in, Whisper's log-mel frames out (Radford et al.
2022, "Robust Speech Recognition via Large-Scale Weak Supervision", §2.2: audio "re-sampled to
16,000 Hz, and an 80-channel log-magnitude Mel spectrogram representation is computed on 25-
millisecond windows with a stride of 10 milliseconds"; the code is whisper/audio.py's
``log_mel_spectrogram``).

- ``read_wav``: a PCM WAV (8-, 16-, 24- or 32-bit integer samples, any number of channels, any
  rate) read with the standard library's ``wave``, as floats in [-1, 1), channels averaged to mono.
- ``resample``: any rate to any other by a band-limited polyphase filter, the windowed sinc that
  ``scipy.signal.resample_poly`` designs (a Kaiser window, β = 5, ten zero crossings of the
  sinc on each side of the slower rate), computed here in NumPy.
- ``mel_filters``: the mel filter bank on the Slaney scale with Slaney's area normalisation
  (librosa's ``filters.mel`` default, which Whisper's ``mel_filters.npz`` stores).
- ``log_mel``: Whisper's frames: a Hann-windowed STFT (n_fft 400, hop 160, centred with
  reflected padding, as ``torch.stft`` does), the power spectrum through the filter bank,
  log10 clipped below at 1e-10 and at the recording's maximum − 8, then (x + 4) / 4. Like
  Whisper, the last STFT frame is dropped, so a recording of n samples gives n // 160 frames.
- ``load_features``: a WAV file's frames in one call (read, mono, resampled to 16 kHz, log-mel).

Every rate is resampled to 16 kHz (FSDD's 8 kHz recordings too); nothing is refused for its rate.
"""

from __future__ import annotations

import io
import math
import os
import wave
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import AtencionError, MissingFileError

SAMPLE_RATE = 16_000  # Whisper's rate: every recording is resampled to it
N_FFT = 400           # 25 ms windows at 16 kHz
HOP = 160             # 10 ms between frames
N_MELS = 80
_MIN_SAMPLES = N_FFT // 2 + 1  # torch.stft's reflected padding needs more samples than n_fft // 2


# reading WAV files ------------------------------------------------------------------------------


def _name(path: str | os.PathLike, where: str | None) -> str:
    """How a message names a file: ``where`` (e.g. "train.tsv line 3: clip.wav") or the path."""
    return where or str(path)


def read_wav(path: str | os.PathLike, where: str | None = None) -> tuple[np.ndarray, int]:
    """The samples of the PCM WAV file ``path`` and its sample rate (see ``decode_wav``). A
    missing file or a directory is refused too, in one AtencionError naming it (``where``, by
    default the path)."""
    path, name = Path(path), _name(path, where)
    if path.is_dir():
        raise AtencionError(f"{name}: is a directory; expected a WAV file")
    if not path.exists():
        raise MissingFileError(f"{name}: file not found")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise AtencionError(f"{name}: cannot read ({err.strerror or err})") from None
    return decode_wav(data, name)


def decode_wav(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """The samples of a PCM WAV file's bytes as float32 in [-1, 1), channels averaged (mono),
    and its sample rate. Integer samples are divided by 2^(bits − 1) (8-bit WAVs are unsigned,
    centred at 128). An empty, non-WAV, non-PCM or truncated file is refused with one
    AtencionError naming it (``name``)."""
    if not data:
        raise AtencionError(f"{name}: empty file; expected a WAV file")
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AtencionError(f"{name}: not a WAV file (it does not begin with a RIFF/WAVE header)")
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate, frames = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            samples = w.readframes(frames)
    except (wave.Error, EOFError) as err:
        raise AtencionError(f"{name}: not a readable PCM WAV file ({err or 'it ends early'})") from None
    if width not in (1, 2, 3, 4):
        raise AtencionError(f"{name}: {8 * width}-bit samples; expected 8-, 16-, 24- or 32-bit PCM")
    if rate <= 0 or channels <= 0:
        raise AtencionError(f"{name}: the header says {channels} channels at {rate} Hz; not a valid WAV file")
    if len(samples) < frames * channels * width:
        raise AtencionError(f"{name}: truncated: the header announces {frames} frames, the file holds "
                            f"{len(samples) // (channels * width)}")
    if frames == 0:
        raise AtencionError(f"{name}: holds no samples")
    return _pcm_to_float(samples, width).reshape(frames, channels).mean(axis=1, dtype=np.float32), rate


def _pcm_to_float(data: bytes, width: int) -> np.ndarray:
    """Little-endian PCM bytes of ``width`` bytes per sample as float32 in [-1, 1)."""
    if width == 1:
        return (np.frombuffer(data, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 3:  # no 24-bit dtype: each sample's three bytes placed in the top of an int32
        raw = np.frombuffer(data, np.uint8).reshape(-1, 3)
        wide = np.zeros((raw.shape[0], 4), np.uint8)
        wide[:, 1:] = raw
        return wide.view("<i4").ravel().astype(np.float32) / 2.0 ** 31
    dtype = {2: "<i2", 4: "<i4"}[width]
    return np.frombuffer(data, dtype).astype(np.float32) / 2.0 ** (8 * width - 1)


# resampling -------------------------------------------------------------------------------------


def resample_filter(up: int, down: int) -> np.ndarray:
    """The low-pass FIR filter of ``scipy.signal.resample_poly`` for a rate change of up / down
    (in lowest terms): a sinc cut at the lower Nyquist frequency (1 / max(up, down) of the
    upsampled one), 2 · 10 · max(up, down) + 1 taps, Kaiser-windowed (β = 5), its sum scaled to
    ``up`` (the gain that zero-stuffing ``up``-fold takes away)."""
    rate = max(up, down)
    half = 10 * rate
    m = np.arange(-half, half + 1, dtype=np.float64)
    h = np.sinc(m / rate) / rate * np.kaiser(2 * half + 1, 5.0)
    return h * (up / h.sum())


def resample(x: np.ndarray, rate: int, new_rate: int = SAMPLE_RATE, chunk: int = 1 << 16) -> np.ndarray:
    """``x`` (1-D) from ``rate`` to ``new_rate`` Hz, as ``scipy.signal.resample_poly`` does it:
    upsample by ``up`` (zeros between samples), low-pass with ``resample_filter``, keep every
    ``down``-th sample, centred so that output n lies at input time n · down / up. Computed
    polyphase: output n sums input m with tap half + n · down − m · up, only the taps that
    meet a real sample (about 20 · max(up, down) / up of them). ceil(len · up / down) samples
    come out; the edges see zeros beyond the recording. float64 inside, float32 out."""
    if rate == new_rate:
        return np.asarray(x, dtype=np.float32)
    g = math.gcd(rate, new_rate)
    up, down = new_rate // g, rate // g
    h = resample_filter(up, down)
    half = (len(h) - 1) // 2
    x = np.asarray(x, dtype=np.float64)
    n_out = -(-len(x) * up // down)
    taps = 2 * half // up + 1  # the most input samples one output can meet
    out = np.empty(n_out, dtype=np.float64)
    padded = np.concatenate([x, np.zeros(1)])  # index len(x): the zero every missing sample reads
    for start in range(0, n_out, chunk):
        t = np.arange(start, min(start + chunk, n_out), dtype=np.int64) * down  # upsampled time of each output
        first = -((half - t) // up)  # ceil((t - half) / up): the first input within the filter's reach
        m = first[:, None] + np.arange(taps)[None, :]
        tap = half + t[:, None] - m * up
        inside = (tap >= 0) & (m >= 0) & (m < len(x))  # first keeps every tap <= 2 · half
        values = padded[np.where(inside, m, len(x))]
        out[start:start + len(t)] = (values * h[np.where(inside, tap, 0)]).sum(axis=1)
    return out.astype(np.float32)


# Whisper's log-mel frames -----------------------------------------------------------------------


def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """Slaney's mel scale (the Auditory Toolbox's, librosa's default): linear below 1 kHz
    (3 / 200 mel per Hz, so 1 kHz is 15 mel), logarithmic above (27 mel per factor 6.4)."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz * 3.0 / 200.0
    logarithmic = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, logarithmic, linear)


def mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    """The inverse of ``hz_to_mel``."""
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((mel - 15.0) * math.log(6.4) / 27.0), mel * 200.0 / 3.0)


def mel_filters(n_mels: int = N_MELS, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> Tensor:
    """(n_mels, n_fft // 2 + 1) triangular filters on the Slaney mel scale from 0 Hz to the
    Nyquist frequency: filter i rises from edge i to a peak of its own at edge i + 1 and falls
    to edge i + 2 (n_mels + 2 edges equally spaced in mel), scaled by 2 / (edge i+2 − edge i)
    in Hz so that each has the same area (Slaney's normalisation). float32, built in float64."""
    bins = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - bins[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


def log_mel(audio: Tensor, n_mels: int = N_MELS, filters: Tensor | None = None) -> Tensor:
    """Whisper's ``log_mel_spectrogram`` of a 16 kHz recording (1-D float tensor): (n_mels,
    len(audio) // 160) frames. The STFT is centred (reflected padding of n_fft // 2 on each side,
    torch.stft's default) with a periodic Hann window; the last frame is dropped as Whisper
    drops it; the log10 power is clipped below at 1e-10 and at its maximum over the recording
    − 8 (a dynamic range of 80 dB), then scaled as Whisper scales it, (x + 4) / 4. Computed in
    the audio's dtype (float32, or float64 for a reference)."""
    if audio.dim() != 1:
        raise AtencionError(f"log_mel: expected one recording (1-D samples), got shape {tuple(audio.shape)}")
    if audio.numel() < _MIN_SAMPLES:
        raise AtencionError(f"{audio.numel()} samples at {SAMPLE_RATE} Hz ({1000 * audio.numel() / SAMPLE_RATE:.1f} "
                            f"ms): too short for one frame; at least {_MIN_SAMPLES} are needed")
    window = torch.hann_window(N_FFT, dtype=audio.dtype, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    filters = mel_filters(n_mels) if filters is None else filters
    mel = filters.to(audio.device, audio.dtype) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def load_audio(path: str | os.PathLike, where: str | None = None) -> Tensor:
    """A WAV file's samples as a 1-D float32 tensor at 16 kHz (mono, resampled from any rate)."""
    samples, rate = read_wav(path, where)
    return torch.from_numpy(resample(samples, rate, SAMPLE_RATE))


def load_features(path: str | os.PathLike, n_mels: int = N_MELS, where: str | None = None) -> Tensor:
    """A WAV file's Whisper log-mel frames, (n_mels, frames); a recording too short for one
    frame is refused, naming the file."""
    audio = load_audio(path, where)
    try:
        return log_mel(audio, n_mels)
    except AtencionError as err:
        raise AtencionError(f"{_name(path, where)}: {err}") from None
