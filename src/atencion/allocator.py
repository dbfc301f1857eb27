"""Keep freed memory in the process instead of handing it back to the operating system.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves large blocks (the
logits of a decoding step are batch × vocabulary floats, 13 MB at 320 rows and 10,000 tokens)
with fresh ``mmap`` pages and returns them on ``free``, so the next step's block is faulted in
again page by page; it also trims the top of the heap whenever more than a few MB are free.
Each step of beam search allocates and frees the same large blocks, so that page-fault work
is paid over and over: at Transformer-Tiny size it was about 15% of the decoding time
(``benchmarks/speed.py``'s tiny model: 93.5 → 108.5 sentences/s once memory is kept).

:func:`keep_freed_memory` raises both thresholds (``mallopt``), so blocks up to 32 MB come from
the heap and freed memory stays mapped for the next step. The process keeps its peak memory
instead of shrinking after it. The atencion commands call it at start; library users may call
it once themselves. Elsewhere than glibc (macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1   # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20    # glibc's largest allowed value (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for a loop that reuses large blocks; True when set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
