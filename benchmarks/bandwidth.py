"""The machine's memory read bandwidth: the wall batch-1 decoding runs into.

Generating one token at batch 1 reads every weight once, so an engine can go no faster than the
bytes/s the cores can read divided by the model's bytes. This measures that rate as STREAM's
read-only kernels do: one pass summing every float32 of an array larger than the caches (1 GiB by
default, on transparent huge pages where the machine offers them, as atencion's decoding reads its
weights: allocator.py), with the threads the engines use, by two independent methods, so that a
wrong figure cannot flatter the fraction of it an engine reaches:

- **hand loop**: thirty lines of C compiled here (``cc -O3 -march=native``), the array split into
  one share per thread (POSIX threads: no runtime left spinning between passes), each summed in 64
  running sums with the widest vectors the CPU has;
- **numpy**: ``np.add.reduce`` over equal shares of the same array, one Python thread per share
  (numpy releases Python's lock inside the loop, so the shares are read at once).

Each figure is the median of ``rounds`` passes after a warm-up pass, the two methods taking turns.
The wall is the larger of the two (a slower method would flatter every fraction); the run says
when they differ by more than ``AGREE``. ``python -m benchmarks.bandwidth`` prints them;
``benchmarks/speed.py --parts llama`` measures them in its own run (``measure``) and divides every
engine's bytes/s by the wall.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from atencion.allocator import huge_page_mapping, huge_pages_available
from atencion.nn.matvec import Cpu
from benchmarks.common import SMOKE_HELP

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)
AGREE = 0.15  # the two methods' figures within this share of each other, or the run says so
HAND_LOOP = r"""
#include <pthread.h>
struct share { const float* x; long begin, end; double total; };
static void* sum_share(void* arg) {
  struct share* s = arg;
  float acc[64] = {0};  /* 64 running sums: independent vector additions, however wide the vectors */
  long i = s->begin;
  for (; i + 64 <= s->end; i += 64)
    for (int j = 0; j < 64; ++j) acc[j] += s->x[i + j];
  for (; i < s->end; ++i) acc[0] += s->x[i];
  s->total = 0;
  for (int j = 0; j < 64; ++j) s->total += acc[j];
  return 0;
}
double read_sum(const float* x, long n, int threads) {  /* threads <= 64: one share each, read at once */
  struct share shares[64];
  pthread_t ids[64];
  const long each = (n / threads + 63) / 64 * 64;
  double total = 0;
  for (int t = 0; t < threads; ++t) {
    const long begin = t * each < n ? t * each : n;
    shares[t] = (struct share){x, begin, begin + each < n ? begin + each : n, 0};
    if (t) pthread_create(&ids[t], 0, sum_share, &shares[t]);
  }
  sum_share(&shares[0]);
  for (int t = 0; t < threads; ++t) {
    if (t) pthread_join(ids[t], 0);
    total += shares[t].total;
  }
  return total;
}
"""


def seconds_in_turns(runs: dict, rounds: int) -> dict:
    """Each run's median seconds over ``rounds`` passes, the runs taking turns (one pass of each per round,
    in the other order every round), after a warm-up pass of each."""
    for run in runs.values():
        run()  # warm-up: caches in their steady state
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            began = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def hand_loop():
    """``read_sum(pointer, n, threads)`` compiled from ``HAND_LOOP``, or None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp) / "read.c", Path(tmp) / "read.so"
        source.write_text(HAND_LOOP)
        flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-pthread", "-shared", "-fPIC"]
        made = subprocess.run([compiler, *flags, str(source), "-o", str(library)], capture_output=True, text=True)
        if made.returncode != 0:
            return None
        read_sum = ctypes.CDLL(str(library)).read_sum  # (loaded: the file may go)
    read_sum.argtypes, read_sum.restype = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int], ctypes.c_double
    return read_sum


def array(nbytes: int) -> tuple[np.ndarray, bool]:
    """A float32 array of ``nbytes`` filled with ones, on transparent huge pages where they are available, and
    whether it is."""
    if not huge_pages_available():
        return np.ones(nbytes // 4, dtype=np.float32), False
    mapping, offset = huge_page_mapping(nbytes)
    x = np.frombuffer(mapping, dtype=np.float32, count=nbytes // 4, offset=offset)
    x[:] = 1
    return x, True


def numpy_reader(x: np.ndarray, threads: int):
    """One pass of ``np.add.reduce`` over ``x`` in ``threads`` equal shares read at once."""
    shares = np.array_split(x, threads)

    def run():
        workers = [threading.Thread(target=np.add.reduce, args=(share,)) for share in shares]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return run


def measure(gib: float = 1.0, threads: int | None = None, rounds: int = 9) -> dict:
    """The read bandwidth (GB/s) by both methods, taking turns, and ``read``, the wall: the larger of the two;
    ``agree``: whether they are within ``AGREE`` of each other (None with one method: no C compiler here)."""
    threads = min(threads or torch.get_num_threads(), 64)
    x, huge = array(int(gib * (1 << 30)) // 64 * 64)
    runs = {"numpy": numpy_reader(x, threads)}
    read_sum = hand_loop()
    if read_sum is not None:
        pointer = x.ctypes.data
        if read_sum(pointer, x.size, threads) != x.size:  # ones: a loop that skipped floats would not give n
            raise RuntimeError("benchmarks/bandwidth.py: the hand loop's sum is wrong")
        runs["hand_loop"] = lambda: read_sum(pointer, x.size, threads)
    rates = {name: x.nbytes / seconds / 1e9 for name, seconds in seconds_in_turns(runs, rounds).items()}
    low, high = min(rates.values()), max(rates.values())
    return dict(read=high, hand_loop=rates.get("hand_loop"), numpy=rates["numpy"],
                agree=None if read_sum is None else high <= low * (1 + AGREE),
                gib=x.nbytes / (1 << 30), threads=threads, rounds=rounds, huge_pages=huge)


def vector_width() -> str:
    """The CPU's widest float vectors, as the decoding kernels use them (``matvec.Cpu``)."""
    return Cpu.here().vector_width


def describe(bandwidth: dict) -> str:
    """One line: the wall, both methods and whether they agree."""
    loop = bandwidth["hand_loop"]
    line = (f"read bandwidth {bandwidth['read']:.1f} GB/s ({bandwidth['gib']:.3g} GiB"
            f"{' on huge pages' if bandwidth['huge_pages'] else ''}, {bandwidth['threads']} threads, median of "
            f"{bandwidth['rounds']}): hand loop {'not compiled' if loop is None else f'{loop:.1f}'}, numpy "
            f"{bandwidth['numpy']:.1f}")
    if bandwidth["agree"] is False:
        line += f"; THE TWO METHODS DIFFER BY MORE THAN {AGREE:.0%}"
    return line


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of each array in GiB (default: 1)")
    parser.add_argument("--threads", type=int, default=0, help="threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=9, help="timed passes per figure (default: 9)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here 16 MiB, 2 rounds")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gib, rounds = (1 / 64, 2) if args.smoke else (args.gib, args.rounds)
    result = dict(measure(gib, None, rounds), vector_width=vector_width())
    print(json.dumps(result) if args.json else f"{vector_width()}: {describe(result)}")
    return result


if __name__ == "__main__":
    main()
