"""allocator.keep_freed_memory: a freed large block stays in the process for the next
allocation instead of going back to the operating system (each case runs in a fresh process:
the setting is process-wide)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from atencion.allocator import huge_pages_available, keep_freed_memory, on_huge_pages, to_huge_pages

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


# to_huge_pages --------------------------------------------------------------------------------

def huge_kib(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                first, last = (int(a, 16) for a in head.split("-"))
                inside = first <= address < last
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


needs_huge_pages = pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off here")


@needs_huge_pages
def test_tensors_move_onto_huge_pages_with_their_values_and_objects():
    big = nn.Parameter(torch.randn(1024, 1024))             # 4 MiB: two huge pages at least
    ints = torch.randint(-128, 127, (512, 256), dtype=torch.int8)
    small, view = torch.randn(8), big.data[:512]
    kept = [big.detach().clone(), ints.clone()]
    moved = to_huge_pages([big, ints, small, view, big])     # big given twice: moved once
    assert moved >= big.numel() * 4 + ints.numel()
    assert isinstance(big, nn.Parameter) and big.requires_grad
    assert on_huge_pages(big) and on_huge_pages(ints) and not on_huge_pages(small)
    torch.testing.assert_close(big.detach(), kept[0], rtol=0, atol=0)
    assert torch.equal(ints, kept[1])
    assert huge_kib(big.data_ptr()) >= 2048                 # the kernel gave huge pages to the mapping
    assert to_huge_pages([big, ints]) == 0                  # already there
    big.data.mul_(2)                                        # one tensor: writes reach what is read
    assert torch.equal(big.detach(), 2 * kept[0])


def test_nothing_moves_when_turned_off(monkeypatch):
    monkeypatch.setenv("ATENCION_HUGE_PAGES", "0")
    t = torch.randn(1 << 16)
    address = t.data_ptr()
    assert not huge_pages_available() and to_huge_pages([t]) == 0 and t.data_ptr() == address


@needs_huge_pages
def test_a_decoding_model_reads_huge_pages_gives_the_same_logits_saves_and_trains(tmp_path):
    from atencion.nn.model_dir import load_model, save_model
    from atencion.nn.transformer import Transformer
    from conftest import small_config

    torch.manual_seed(0)
    model = Transformer(small_config(arch="decoder", d_model=128, d_ff=512, vocab_size=300,
                                     tie_output=True)).eval()
    ids = torch.randint(4, 300, (2, 12))
    with torch.no_grad():
        before = model(ids)
        assert not any(on_huge_pages(p) for p in model.parameters())
        state = model.init_state()                           # decoding on the CPU moves the weights
        assert all(on_huge_pages(p) for p in model.parameters() if p.numel() * 4 >= 64 << 10)
        assert model.decoder.embed.weight is model.generator.weight  # still tied
        stepped = model.decode_step(ids, state)
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
        torch.testing.assert_close(stepped, before, rtol=1e-5, atol=1e-5)
    save_model(model, tmp_path / "m")                        # no tensors sharing memory for safetensors
    again = load_model(tmp_path / "m")
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    model.train()
    weight = model.decoder.layers[0].ffn.linear1.weight
    old = weight.detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    model(ids).logsumexp(-1).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert on_huge_pages(weight) and not torch.equal(weight.detach(), old)   # trained where it lies
