"""allocator.keep_freed_memory: a freed large block stays in the process for the next
allocation instead of going back to the operating system (each case runs in a fresh process:
the setting is process-wide)."""

import subprocess
import sys

import pytest

from atencion.allocator import keep_freed_memory

PROGRAM = """
import os, sys, torch
from atencion.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
x = torch.ones(4 << 20)            # 16 MB; glibc's default serves a first block this size with mmap
before_free = rss()
del x
print(before_free - rss())         # what the free gave back to the operating system
"""
BLOCK = 16 << 20


def returned_on_free(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not keep_freed_memory(), reason="needs glibc's mallopt (Linux)")
def test_a_freed_large_block_stays_in_the_process():
    assert returned_on_free("keep") < BLOCK // 4
    assert returned_on_free("default") > BLOCK * 3 // 4   # glibc's default unmaps it at once
