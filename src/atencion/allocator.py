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

:func:`to_huge_pages` moves the weights a CPU decoding reads onto transparent huge pages (2 MiB,
Linux). Generating a token at batch 1 reads every weight once, at the rate the cores can read
memory; with 4 KiB pages the hardware's prefetchers stop at every page boundary and the address
translations miss their cache every few kilobytes (what it buys is measured in docs/results.md,
"Batch-1 decoding at the memory wall"). Torch's allocator asks for huge pages only for blocks of
2 MiB or more, and only with ``THP_MEM_ALLOC_ENABLE=1`` set before its first allocation; a
decoder's matrices are mostly smaller. So the tensors are copied into one anonymous mapping
advised ``MADV_HUGEPAGE`` before it is touched, each tensor a storage of its own in it (saving with safetensors sees no
shared tensors), and each tensor object is pointed at its copy (``.data``): whatever holds the
tensor reads the copy, and the old memory is freed. ``Transformer.init_state`` does it for a model
decoding on the CPU (once), and nn/fused.py for the copies of the weights its plan makes.
``ATENCION_HUGE_PAGES=0`` in the environment turns it off; where the kernel offers no huge pages
(``/sys/kernel/mm/transparent_hugepage/enabled`` set to never, or not Linux) it does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `import atencion.cli` stays quick (tests/test_faults.py)
    import torch

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


HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10  # smaller tensors stay where they are: norms, biases, scales
_ALIGN = 64  # each tensor starts on a cache line
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_lock = threading.Lock()
_arenas: list[tuple[int, int, weakref.ref]] = []  # (first, last address, the mapping) of each arena made


def huge_pages_available() -> bool:
    """Whether transparent huge pages can be asked for here: Linux, the kernel's setting not ``never``,
    and ``ATENCION_HUGE_PAGES`` not ``0``."""
    if os.environ.get("ATENCION_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP, encoding="ascii") as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


def huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping of at least ``nbytes`` from a 2 MiB boundary, advised
    ``MADV_HUGEPAGE`` before any page of it is touched, and the offset of that boundary in it."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    import torch

    first = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return mapping, -first % HUGE_PAGE


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in memory that ``to_huge_pages`` made."""
    address = tensor.data_ptr()
    with _lock:
        _arenas[:] = [arena for arena in _arenas if arena[2]() is not None]
        return any(first <= address < last for first, last, _ in _arenas)


def _movable(t: torch.Tensor) -> bool:
    """A plain CPU tensor (not a subclass such as FSDP's DTensor) of at least ``MIN_BYTES`` that owns all its
    storage (not a view of another)."""
    import torch

    if type(t.data) is not torch.Tensor or t.device.type != "cpu" or t.layout is not torch.strided or t.is_quantized:
        return False
    nbytes = t.numel() * t.element_size()
    return (t.is_contiguous() and t._base is None and nbytes >= MIN_BYTES
            and t.untyped_storage().nbytes() == nbytes)


def to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move ``tensors`` (CPU, contiguous, at least ``MIN_BYTES``, not views; others are left where
    they are, as are those moved before) onto transparent huge pages, in the order given: one new
    mapping holds them all, each tensor is pointed at its copy (``.data``), its values unchanged.
    Returns the bytes moved (0 where huge pages are not available)."""
    if not huge_pages_available():
        return 0
    seen, chosen = set(), []
    for t in tensors:
        if t is not None and _movable(t) and t.data_ptr() not in seen and not on_huge_pages(t):
            seen.add(t.data_ptr())
            chosen.append(t)
    if not chosen:
        return 0
    import torch

    sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in chosen]
    mapping, offset = huge_page_mapping(sum(sizes))
    start = offset
    with torch.inference_mode(False), torch.no_grad():
        for t, size in zip(chosen, sizes):
            copy = torch.frombuffer(mapping, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
            copy.copy_(t)
            t.data = copy
            offset += size
    first = chosen[0].data_ptr()  # the mapping's 2 MiB boundary, where the first copy went
    with _lock:
        _arenas.append((first, first + offset - start, weakref.ref(mapping)))
    return offset - start
