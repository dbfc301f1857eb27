"""Table 1 of the paper (§4), measured: cost per layer of self-attention, recurrent,
convolutional and restricted self-attention layers, and their maximum path lengths.

Time is the median wall-clock of forward + backward through one layer (batch 1, width
d = d_model) after a warm-up. Memory is measured, not modelled: the growth of the process's
resident set (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``) during one
forward + backward, with glibc told to return every block over 64 KiB to the system on free, so
that each tensor torch allocates is a fresh mapping whose pages are counted when touched.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import AtencionError
from ..nn.attention import MultiHeadAttention
from ..nn.kinds import Window

log = logging.getLogger(__name__)

# layer → (the paper's complexity per layer, its exponent in n, sequential operations, path length)
PAPER = {
    "self-attention": ("O(n²·d)", 2, "O(1)", "O(1)"),
    "self-attention (explicit)": ("O(n²·d)", 2, "O(1)", "O(1)"),
    "recurrent": ("O(n·d²)", 1, "O(n)", "O(n)"),
    "convolutional": ("O(k·n·d²)", 1, "O(1)", "O(log_k n)"),
    "restricted self-attention": ("O(r·n·d)", 1, "O(1)", "O(n/r)"),
}


# --------------------------------------------------------------------------- path lengths
# The longest path a signal travels from an input position to an output position, counted in
# edges of the computation graph (one layer, or one recurrent step, is one edge).

def rnn_path_length(n: int) -> int:
    """Recurrent layer: x_1 → h_1 → h_2 → … → h_n, n steps."""
    return n


def self_attention_path_length(n: int) -> int:
    """Self-attention: every output attends to every input, one step."""
    return 1


def dilated_conv_path_length(n: int, k: int) -> int:
    """Stacked dilated convolutions (dilation 1, k, k², …): L layers see k^L positions, L = ⌈log_k n⌉."""
    layers, field = 1, k
    while field < n:
        layers, field = layers + 1, field * k
    return layers


def contiguous_conv_path_length(n: int, k: int) -> int:
    """Stacked contiguous convolutions: L layers see 1 + L(k−1) positions, L = ⌈(n−1)/(k−1)⌉ = O(n/k)."""
    return max(1, math.ceil((n - 1) / (k - 1)))


def restricted_attention_path_length(n: int, r: int) -> int:
    """Restricted self-attention, a neighbourhood of size r centred on each output (r/2 each side): O(n/r)."""
    return max(1, math.ceil((n - 1) / (r // 2)))


# --------------------------------------------------------------------------- the fourth row

class RestrictedSelfAttention(MultiHeadAttention):
    """§4, Table 1 row 4: self-attention restricted to a neighbourhood of size r around each output.

    Each position i attends to the keys j with |i − j| ≤ r/2: the ``window`` kind of
    ``model.attention`` (nn/kinds/sparse.py) with w = r/2 + 1, computed in blocks of queries that
    gather only the keys they can see, so its cost is O(r·n·d), not the O(n²·d) of a banded mask on
    the full matrix.
    """

    def __init__(self, d_model: int, n_heads: int, r: int):
        if r < 2 or r % 2:
            raise AtencionError(f"the neighbourhood r must be an even number ≥ 2, got {r}")
        super().__init__(d_model, n_heads, kind=Window({"window": r // 2 + 1}, causal=False))
        self.r = r

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x)[0]


# --------------------------------------------------------------------------- one layer of each kind

class SelfAttentionLayer(nn.Module):
    """Table 1 row 1 with atencion's MultiHeadAttention: by default torch's fused kernel;
    ``explicit=True`` runs eq. (1) step by step, so the n×n weights are materialised."""

    def __init__(self, d_model: int, n_heads: int, explicit: bool = False):
        super().__init__()
        self.attention, self.explicit = MultiHeadAttention(d_model, n_heads), explicit

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, need_weights=self.explicit)[0]


class RecurrentLayer(nn.Module):
    """Table 1 row 2: one LSTM layer of width d (torch's CPU backward of an LSTM is fused; a GRU's
    runs step by step through autograd and is about 50× slower here, which would measure torch)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.lstm = nn.LSTM(d_model, d_model, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.lstm(x)[0]


class ConvolutionalLayer(nn.Module):
    """Table 1 row 3: one convolution of kernel width k, d channels in and out."""

    def __init__(self, d_model: int, k: int):
        super().__init__()
        self.conv = nn.Conv1d(d_model, d_model, k, padding=k // 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


def make_layer(kind: str, d_model: int, n_heads: int = 8, k: int = 3, r: int = 32) -> nn.Module:
    """One layer of Table 1, mapping (batch, n, d_model) → (batch, n, d_model)."""
    if kind == "self-attention":
        return SelfAttentionLayer(d_model, n_heads)
    if kind == "self-attention (explicit)":
        return SelfAttentionLayer(d_model, n_heads, explicit=True)
    if kind == "recurrent":
        return RecurrentLayer(d_model)
    if kind == "convolutional":
        return ConvolutionalLayer(d_model, k)
    if kind == "restricted self-attention":
        return RestrictedSelfAttention(d_model, n_heads, r)
    raise AtencionError(f"unknown layer {kind!r}; choose from {', '.join(PAPER)}")


# --------------------------------------------------------------------------- measuring

def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AtencionError(f"/proc/self/status has no {field}")


def _set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> None:
    """glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD (no-op where there is no glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold, m_trim_threshold = -3, -1
    libc.mallopt(m_mmap_threshold, mmap_bytes)
    libc.mallopt(m_trim_threshold, trim_bytes)
    libc.malloc_trim(0)


def can_measure_memory() -> bool:
    """True where the peak resident set can be reset and read (Linux /proc)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return _status_kib("VmHWM") > 0
    except (OSError, ValueError):
        return False


def measure_peak_memory(fn: Callable[[], object]) -> int:
    """Bytes by which the process's resident set grew at its peak while ``fn()`` ran (Linux only).

    The high-water mark is reset through /proc/self/clear_refs, so earlier peaks do not count.
    """
    # Blocks ≥ 64 KiB are mmap'ed and unmapped on free, so the RSS follows live tensors; after
    # the measurement, large thresholds (glibc's dynamic maximum) keep freed memory for reuse.
    _set_malloc_thresholds(64 * 1024, 64 * 1024)
    gc.collect()
    try:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = _status_kib("VmRSS")
        except OSError as err:
            raise AtencionError(f"cannot measure peak memory here (needs Linux /proc/self/clear_refs): {err}") from err
        fn()
        return (_status_kib("VmHWM") - before) * 1024
    finally:
        _set_malloc_thresholds(32 * 2**20, 64 * 2**20)


def forward_backward(layer: nn.Module, x: Tensor) -> None:
    """One training step's work in a layer: the output, then gradients for the input and weights."""
    layer(x).sum().backward()
    x.grad = None
    layer.zero_grad(set_to_none=True)


@dataclass
class Point:
    layer: str
    n: int
    seconds: float
    peak_bytes: int | None  # None where memory cannot be measured (not Linux)


def measure_point(kind: str, n: int, d_model: int, repeats: int, n_heads: int = 8, k: int = 3,
                  r: int = 32, batch: int = 1) -> Point:
    """Median time of ``repeats`` forward + backward passes after a warm-up, and their peak memory."""
    torch.manual_seed(0)
    layer = make_layer(kind, d_model, n_heads, k, r)
    x = torch.randn(batch, n, d_model, requires_grad=True)

    def step():
        forward_backward(layer, x)

    def timed_step():
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)

    times: list[float] = []
    step()  # warm-up: one-time allocations and kernel selection
    if can_measure_memory():
        peak = measure_peak_memory(timed_step)  # the first timed pass is also the memory measurement
    else:
        peak = None
        timed_step()
    for _ in range(repeats - 1):
        timed_step()
    return Point(kind, n, statistics.median(times), peak)


def measure_table1(ns: list[int], d_model: int = 512, repeats: int = 3, layers: list[str] | None = None,
                   n_heads: int = 8, k: int = 3, r: int = 32, progress: bool = True) -> list[Point]:
    """Measure every layer of Table 1 at every sequence length n."""
    from tqdm import tqdm

    layers = list(PAPER) if layers is None else layers
    if not can_measure_memory():
        log.warning("peak memory needs Linux /proc/self/clear_refs; measuring time only")
    if repeats < 1 or not ns:
        raise AtencionError(f"need at least one repetition and one n (got repeats={repeats}, ns={ns})")
    jobs = [(kind, n) for kind in layers for n in ns]
    points = []
    for kind, n in tqdm(jobs, desc="Table 1", unit="point", leave=False, disable=None if progress else True):
        point = measure_point(kind, n, d_model, repeats, n_heads, k, r)
        log.info("%s n=%d: %.4f s, peak %s bytes", kind, n, point.seconds, point.peak_bytes)
        points.append(point)
    return points


def fit_exponent(ns: list[float], ys: list[float]) -> float:
    """Slope of the least-squares line through (log n, log y): y ≈ c·n^slope."""
    if len(ns) < 2 or len(ns) != len(ys) or min(ns) <= 0 or min(ys) <= 0:
        raise AtencionError(f"fitting an exponent needs two or more positive (n, y) pairs, got {list(zip(ns, ys))}")
    xs = [math.log(n) for n in ns]
    ls = [math.log(y) for y in ys]
    mx, my = statistics.fmean(xs), statistics.fmean(ls)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ls)) / sum((a - mx) ** 2 for a in xs)
