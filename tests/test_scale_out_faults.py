"""Faults under torchrun (atencion/torchrun.py): a bad input, or Ctrl-C on one rank or on all of
them, ends with one line from rank 0 (which rank stopped, how to go on) and no traceback from the
ranks, whatever torchrun itself prints after it (its summary of the failed processes)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from atencion.train.checkpoint import list_checkpoints
from test_scale_out import ROOT, launch, write_data

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def ranks_output(stderr: str) -> str:
    """What the ranks printed: ``stderr`` without torchrun's own lines (its log lines, W1207 ...,
    and the traceback of its ChildFailedError or SignalException, which ends its output)."""
    head, mark, tail = stderr.rpartition("Traceback (most recent call last):")
    if mark and "torch/distributed/run.py" in tail and "[rank" not in tail:
        stderr = head
    return "\n".join(line for line in stderr.splitlines() if not re.match(r"[WEI]\d{4} ", line))


def lines_with(text: str, words: str) -> list[str]:
    return [line for line in text.splitlines() if words in line]


@pytest.mark.parametrize("setting, words", [
    ("train.bogus=1", "unknown key train.bogus"),                      # an unknown --set key
    ("train.lr_peak=-1", "train.lr_peak must be > 0.0, got -1"),       # a bad value
    ("train.label_smoothing=1.5", "train.label_smoothing must be in"),  # a bad rate
    ("data.train_src=MISSING", "missing.es: file not found"),          # a missing data file
])
def test_a_bad_input_under_torchrun_is_told_once_without_a_traceback(setting, words, tmp_path):
    settings = {**write_data(tmp_path / "data")["translate"], "train.max_steps": 2, "train.distributed": "fsdp"}
    key, value = setting.split("=")
    settings[key] = str(tmp_path / "missing.es") if value == "MISSING" else value
    done = subprocess.run(launch(settings, tmp_path / "run", 29571), cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    said = ranks_output(done.stderr)
    assert len(lines_with(done.stderr, words)) == 1, done.stderr[-4000:]
    assert lines_with(said, words)[0].startswith("atencion train: error: ")
    assert "Traceback" not in said, done.stderr[-4000:]


def start_long_run(tmp_path: Path, port: int) -> tuple[subprocess.Popen, Path]:
    """A run of fsdp on two processes that would go on for good, in a session of its own (so that a
    signal to its process group reaches torchrun and the ranks, as Ctrl-C at a terminal does, and
    not pytest); returns once it has written two checkpoints."""
    settings = {**write_data(tmp_path / "data")["translate"], "train.valid_every": 2, "train.max_epochs": 1000,
                "train.max_steps": 100000, "train.distributed": "fsdp"}
    out = tmp_path / "run"
    launcher = subprocess.Popen(launch(settings, out, port), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while len(list_checkpoints(out / "checkpoints")) < 2 and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    assert len(list_checkpoints(out / "checkpoints")) >= 2, "no checkpoints within 120 s"
    return launcher, out


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The process id of ``rank`` among torchrun's children (its RANK in /proc/PID/environ)."""
    children = subprocess.run(["ps", "--ppid", str(launcher.pid), "-o", "pid="], capture_output=True,
                              text=True).stdout.split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} among {children}")


def stopped(launcher: subprocess.Popen) -> str:
    """torchrun's stderr once it has exited (killed after 120 s)."""
    try:
        return launcher.communicate(timeout=120)[1]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.parametrize("where", ["rank 1", "every process"])
def test_ctrl_c_under_torchrun_is_told_once_by_rank_0_with_the_resume_command(where, tmp_path):
    """SIGINT to rank 1 alone (its peer then fails in a collective: gloo's "Connection closed by
    peer"), or to the whole process group as Ctrl-C at the terminal: one line, from rank 0."""
    launcher, out = start_long_run(tmp_path, 29572 if where == "rank 1" else 29573)
    if where == "rank 1":
        os.kill(rank_pid(launcher, 1), signal.SIGINT)
    else:
        os.killpg(launcher.pid, signal.SIGINT)
    stderr = stopped(launcher)
    assert launcher.returncode != 0
    said = ranks_output(stderr)
    assert "Traceback" not in said, stderr[-4000:]
    lines = lines_with(stderr, "interrupted")
    assert len(lines) == 1, stderr[-4000:]
    assert lines[0].startswith("atencion train: interrupted at step ")
    assert f"--out {out}" in lines[0] and lines[0].endswith(" --resume")
    assert ("rank 1" in lines[0]) == (where == "rank 1")
    last = re.search(r"the last checkpoint is (\S+);", lines[0]).group(1)
    assert Path(last) in list_checkpoints(out / "checkpoints")
