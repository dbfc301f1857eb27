"""Audio for a speech Transformer: WAV files in, Whisper's log-mel frames out (Radford et al.
2022, "Robust Speech Recognition via Large-Scale Weak Supervision", §2.2: audio "re-sampled to
16,000 Hz, and an 80-channel log-magnitude Mel spectrogram representation is computed on 25-
millisecond windows with a stride of 10 milliseconds"; the code is whisper/audio.py's
``log_mel_spectrogram``).

- ``read_wav``: a PCM WAV (8-, 16-, 24- or 32-bit integer samples, 1 to 256 channels, 1,000 to
  384,000 Hz) as floats in [-1, 1), channels averaged to mono. Its RIFF chunks are parsed here,
  each field of the header checked before a sample is read (the standard library's ``wave``
  lets RuntimeError, struct.error, … escape on malformed headers and takes any rate), so a
  malformed or hostile header is one AtencionError naming the file and what was expected.
- ``resample``: any rate to any other by a band-limited polyphase filter, the windowed sinc that
  ``scipy.signal.resample_poly`` designs (a Kaiser window, β = 5, ten zero crossings of the
  sinc on each side of the slower rate), computed here in NumPy. Exact for every rate: the
  filter has 20 · max(up, down) + 1 taps for the ratio up / down in lowest terms, so a rate that
  shares few factors with 16 kHz (44,099 Hz: 16,000 / 44,099) needs a long one. Up to
  ``MAX_RATIO`` = 48,000 (960,001 taps, 7.7 MB, a fraction of a second) it is built, which takes
  every rate up to 48 kHz and every common rate above (88.2, 96, 176.4, 192, 352.8, 384 kHz); an
  odd rate above 48 kHz (96,001 Hz) is refused, naming the filter, rather than approximated by a
  nearby ratio (which would change the recording's pitch and length without saying so).
- ``mel_filters``: the mel filter bank on the Slaney scale with Slaney's area normalisation
  (librosa's ``filters.mel`` default, which Whisper's ``mel_filters.npz`` stores).
- ``log_mel``: Whisper's frames: a Hann-windowed STFT (n_fft 400, hop 160, centred with
  reflected padding, as ``torch.stft`` does), the power spectrum through the filter bank,
  log10 clipped below at 1e-10 and at the recording's maximum − 8, then (x + 4) / 4. Like
  Whisper, the last STFT frame is dropped, so a recording of n samples gives n // 160 frames.
- ``load_features``: a WAV file's frames in one call (read, mono, resampled to 16 kHz, log-mel).
  Given the model's ``max_frames``, a recording that would give more frames is refused from the
  numbers of its header (frames and rate), before its samples are read or resampled.

Every rate is resampled to 16 kHz (FSDD's 8 kHz recordings too). Rates below ``MIN_RATE`` (1,000
Hz: a Nyquist frequency of 500 Hz leaves no speech; at 1 Hz a 16 KB file would be 8,000 s,
128 million samples at 16 kHz) or above ``MAX_RATE`` (384,000 Hz, the highest rate common audio
interfaces record) are refused, as are rates above 48 kHz without a short exact filter (above).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor

from ..errors import AtencionError, MissingFileError

SAMPLE_RATE = 16_000  # Whisper's rate: every recording is resampled to it
N_FFT = 400           # 25 ms windows at 16 kHz
HOP = 160             # 10 ms between frames
N_MELS = 80
_MIN_SAMPLES = N_FFT // 2 + 1  # torch.stft's reflected padding needs more samples than n_fft // 2
MIN_RATE, MAX_RATE = 1_000, 384_000  # the sample rates read (Hz)
MAX_CHANNELS = 256  # more than any interface records into one file; 65,535 is a corrupt header
MAX_RATIO = 48_000  # the largest term of up / down resample builds a filter for (20 · 48,000 + 1 taps)
_CHUNK_PRODUCTS = 1 << 18  # resample's products held at once (outputs × taps): about 2 MB an array


# reading WAV files ------------------------------------------------------------------------------


def _name(path: str | os.PathLike, where: str | None) -> str:
    """How a message names a file: ``where`` (e.g. "train.tsv line 3: clip.wav") or the path."""
    return where or str(path)


def read_wav(path: str | os.PathLike, where: str | None = None,
             max_frames: int | None = None) -> tuple[np.ndarray, int]:
    """The samples of the PCM WAV file ``path`` and its sample rate (see ``decode_wav``). A
    missing file or a directory is refused too, in one AtencionError naming it (``where``, by
    default the path). Only the header is read before it is judged; then only the samples."""
    path, name = Path(path), _name(path, where)
    if path.is_dir():
        raise AtencionError(f"{name}: is a directory; expected a WAV file")
    if not path.exists():
        raise MissingFileError(f"{name}: file not found")
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise AtencionError(f"{name}: empty file; expected a WAV file")
            header = wav_header(f, size, name)
            _check_length(header, name, max_frames)
            f.seek(header.offset)
            data = f.read(header.frames * header.block)
    except OSError as err:
        raise AtencionError(f"{name}: cannot read ({err.strerror or err})") from None
    return _samples(data, header), header.rate


def decode_wav(data: bytes, name: str, max_frames: int | None = None) -> tuple[np.ndarray, int]:
    """The samples of a PCM WAV file's bytes as float32 in [-1, 1), channels averaged (mono),
    and its sample rate. Integer samples are divided by 2^(bits − 1) (8-bit WAVs are unsigned,
    centred at 128). An empty, non-WAV, non-PCM, malformed or truncated file, one of a rate,
    channel count or sample width out of range (``wav_header``), or, given ``max_frames``, one
    longer than that many log-mel frames at 16 kHz, is refused with one AtencionError naming it
    (``name``) before a sample is decoded."""
    if not data:
        raise AtencionError(f"{name}: empty file; expected a WAV file")
    header = wav_header(io.BytesIO(data), len(data), name)
    _check_length(header, name, max_frames)
    return _samples(data[header.offset:header.offset + header.frames * header.block], header), header.rate


@dataclass(frozen=True)
class WavHeader:
    """What a PCM WAV file's header says, checked: ``channels``, ``rate`` (Hz), ``width`` (bytes
    a sample), ``frames`` (samples a channel, all present in the file) and ``offset`` (of the
    first sample)."""

    channels: int
    rate: int
    width: int
    frames: int
    offset: int

    @property
    def block(self) -> int:
        """Bytes a frame (one sample of each channel)."""
        return self.channels * self.width


def wav_header(f: BinaryIO, size: int, name: str) -> WavHeader:
    """The header of the WAV file open as ``f`` (``size`` bytes), read chunk by chunk up to the
    first sample: "RIFF", "WAVE", then chunks of a 4-byte id and a little-endian 4-byte length
    (padded to even), among them "fmt " (format, channels, rate, …, bits) before "data". Each
    length is checked against the file and each field against what is read (``_check_format``),
    so nothing is allocated or read by a lying header; the refusal names the file (``name``)."""
    start = f.read(12)
    if start[:4] != b"RIFF" or start[8:12] != b"WAVE":
        raise AtencionError(f"{name}: not a WAV file (it does not begin with a RIFF/WAVE header)")
    fmt, position = None, 12
    while True:
        f.seek(position)
        chunk = f.read(8)
        if len(chunk) < 8:
            raise AtencionError(f"{name}: not a readable PCM WAV file (it ends before its "
                                f"{'fmt' if fmt is None else 'data'} chunk)")
        kind, length, body = chunk[:4], int.from_bytes(chunk[4:], "little"), position + 8
        if kind == b"fmt ":
            if not 16 <= length <= size - body:
                why = "expected at least 16" if length < 16 else f"the file holds {size - body} after it"
                raise AtencionError(f"{name}: not a readable PCM WAV file (its fmt chunk says {length} bytes; {why})")
            fmt = _check_format(f.read(16), name)
        elif kind == b"data":
            if fmt is None:
                raise AtencionError(f"{name}: not a readable PCM WAV file (its data chunk comes before its fmt chunk)")
            return _data_header(fmt, length, size - body, body, name)
        position = body + length + (length & 1)


def _check_format(fmt: bytes, name: str) -> tuple[int, int, int]:
    """(channels, rate, width) from the 16 bytes of a fmt chunk, each in the range read: integer
    PCM (format 1) of 8 to 32 bits, 1 to ``MAX_CHANNELS`` channels, ``MIN_RATE`` to ``MAX_RATE``
    Hz, at a rate ``resample`` turns into 16 kHz with a filter of bounded length."""
    tag, channels, rate, _, _, bits = (int.from_bytes(fmt[i:j], "little") for i, j in
                                       ((0, 2), (2, 4), (4, 8), (8, 12), (12, 14), (14, 16)))
    if tag != 1:
        kinds = {3: "IEEE float", 6: "A-law", 7: "µ-law", 0xFFFE: "extensible"}
        kind = f", {kinds[tag]}" if tag in kinds else ""
        raise AtencionError(f"{name}: not a readable PCM WAV file (format {tag}{kind}; expected format 1, integer "
                            f"PCM)")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AtencionError(f"{name}: the header says {channels} channels; expected 1 to {MAX_CHANNELS}")
    width = (bits + 7) // 8
    if width not in (1, 2, 3, 4):
        raise AtencionError(f"{name}: {bits}-bit samples; expected 8-, 16-, 24- or 32-bit PCM")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AtencionError(f"{name}: a sample rate of {rate:,} Hz; expected {MIN_RATE:,} to {MAX_RATE:,} Hz")
    up, down = _ratio(rate, SAMPLE_RATE)
    if max(up, down) > MAX_RATIO:
        raise AtencionError(f"{name}: a sample rate of {rate:,} Hz goes to {SAMPLE_RATE:,} Hz only through a filter "
                            f"of {_taps(up, down):,} taps ({up:,}/{down:,} in lowest terms); resample it to a common "
                            f"rate first (any up to {MAX_RATIO:,} Hz, or 88,200, 96,000, 192,000 Hz, …)")
    return channels, rate, width


def _data_header(fmt: tuple[int, int, int], length: int, held: int, offset: int, name: str) -> WavHeader:
    """The header of a data chunk announcing ``length`` bytes of which the file holds ``held``:
    refused when truncated or empty (a last partial frame is left out, as ``wave`` left it)."""
    channels, rate, width = fmt
    frames = length // (channels * width)
    if held < frames * channels * width:
        raise AtencionError(f"{name}: truncated: the header announces {frames} frames, the file holds "
                            f"{held // (channels * width)}")
    if frames == 0:
        raise AtencionError(f"{name}: holds no samples")
    return WavHeader(channels, rate, width, frames, offset)


def _check_length(header: WavHeader, name: str, max_frames: int | None) -> None:
    """Refuse a recording that gives more than ``max_frames`` log-mel frames once at 16 kHz,
    counted from its header as ``resample`` and ``log_mel`` count them (None: no limit)."""
    if max_frames is None:
        return
    up, down = _ratio(header.rate, SAMPLE_RATE)
    frames = -(-header.frames * up // down) // HOP
    if frames > max_frames:
        raise AtencionError(f"{name}: {frames} frames ({frames * HOP / SAMPLE_RATE:.2f} s), more than "
                            f"inputs.max_frames={max_frames}")


def _samples(data: bytes, header: WavHeader) -> np.ndarray:
    """The PCM bytes of ``header``'s frames as mono float32 (the mean of the channels)."""
    return _pcm_to_float(data, header.width).reshape(header.frames, header.channels).mean(axis=1, dtype=np.float32)


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


def _ratio(rate: int, new_rate: int) -> tuple[int, int]:
    """(up, down): new_rate / rate in lowest terms."""
    g = math.gcd(rate, new_rate)
    return new_rate // g, rate // g


def _taps(up: int, down: int) -> int:
    """The length of ``resample_filter(up, down)``."""
    return 2 * 10 * max(up, down) + 1


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
    come out; the edges see zeros beyond the recording. float64 inside, float32 out. At most
    ``chunk`` outputs, and about ``_CHUNK_PRODUCTS`` products, are computed at once (384 kHz
    meets 481 taps an output); a ratio whose larger term exceeds ``MAX_RATIO`` is refused (its
    filter would have more than 960,001 taps)."""
    if rate == new_rate:
        return np.asarray(x, dtype=np.float32)
    up, down = _ratio(rate, new_rate)
    if max(up, down) > MAX_RATIO:
        raise AtencionError(f"resampling {rate:,} Hz to {new_rate:,} Hz needs a filter of {_taps(up, down):,} taps "
                            f"({up:,}/{down:,} in lowest terms); at most {_taps(MAX_RATIO, 1):,} are built")
    h = resample_filter(up, down)
    half = (len(h) - 1) // 2
    x = np.asarray(x, dtype=np.float64)
    n_out = -(-len(x) * up // down)
    taps = 2 * half // up + 1  # the most input samples one output can meet
    chunk = max(1, min(chunk, _CHUNK_PRODUCTS // taps))
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


def load_audio(path: str | os.PathLike, where: str | None = None, max_frames: int | None = None) -> Tensor:
    """A WAV file's samples as a 1-D float32 tensor at 16 kHz (mono, resampled from any rate);
    given ``max_frames``, one that would give more log-mel frames is refused from its header."""
    samples, rate = read_wav(path, where, max_frames)
    return torch.from_numpy(resample(samples, rate, SAMPLE_RATE))


def load_features(path: str | os.PathLike, n_mels: int = N_MELS, where: str | None = None,
                  max_frames: int | None = None) -> Tensor:
    """A WAV file's Whisper log-mel frames, (n_mels, frames); a recording too short for one
    frame is refused, naming the file, and, given ``max_frames`` (the model's inputs.max_frames),
    one that would give more frames, from its header, before a sample is read or resampled."""
    audio = load_audio(path, where, max_frames)
    try:
        return log_mel(audio, n_mels)
    except AtencionError as err:
        raise AtencionError(f"{_name(path, where)}: {err}") from None
