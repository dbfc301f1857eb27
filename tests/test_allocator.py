"""allocator.keep_freed_memory: a loop that allocates and frees the same large tensor stops
faulting its pages in again (run in fresh processes: the setting is process-wide)."""

import subprocess
import sys

import pytest

from atencion.allocator import keep_freed_memory

PROGRAM = """
import resource, sys, torch
from atencion.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x = torch.ones(4 << 20)            # 16 MB: glibc would serve it with fresh mmap pages
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    y = x + 1                      # a new 16 MB block, freed at the next iteration
    del y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_PER_BLOCK = (16 << 20) // 4096


def page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not keep_freed_memory(), reason="needs glibc's mallopt (Linux)")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    kept = page_faults("keep")
    default = page_faults("default")
    assert kept < 2 * PAGES_PER_BLOCK, kept             # the first block only (of 20)
    assert default > 3 * PAGES_PER_BLOCK, default       # glibc's default maps blocks afresh
