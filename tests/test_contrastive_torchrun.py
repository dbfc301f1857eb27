"""CLIP (task contrastive) under torchrun: two CPU processes (gloo), each with half of every
global batch, gather each other's embeddings (tasks/contrastive.py's ``gather``) and so give the
loss of one process on the same global batch and, update after update, its weights and Adam
moments, within float32 rounding: under DDP, and under FSDP with activation checkpointing. The
last global batch of the epoch is uneven (5 pairs on one process, 1 on the other)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atencion.train.checkpoint import list_checkpoints
from atencion.train.config import load_config
from atencion.train.trainer import train
from test_clip import data  # noqa: F401  (the fixture: tiny images and tones of three labels, clip.yaml)
from test_scale_out import run

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")

# 36 pairs an epoch: one process takes 10 a batch (10, 10, 10, 6); two take 5 each (the last: 5 and 1)
SETTINGS = {"train.max_steps": 4, "train.valid_every": 1, "train.keep_last": 10, "train.log_every": 1,
            "train.progress": False, "train.tensorboard": False, "train.device": "cpu", "train.clip_norm": 1.0,
            # a bias without gradient but rounding noise: Adam's paper eps would make whole steps of the noise
            "train.adam_eps": 1e-5}


def losses(out: Path) -> list[float]:
    return [record["loss"] for record in map(json.loads, (out / "log.jsonl").read_text().splitlines())
            if "loss" in record]


def assert_same_towers(a: Path, b: Path, optimizer: bool = True) -> None:
    """The same weights (each tower's), temperature and (a checkpoint's) Adam moments, within float32 rounding."""
    for name in ("image/model.safetensors", "audio/model.safetensors", *(["optimizer.safetensors"] * optimizer)):
        mine, theirs = load_file(str(a / name)), load_file(str(b / name))
        assert mine.keys() == theirs.keys(), name
        for key in mine:
            torch.testing.assert_close(theirs[key], mine[key], atol=1e-6, rtol=1e-5, msg=f"{b / name}: {key}")
    scales = [json.loads((d / "towers.json").read_text())["log_scale"] for d in (a, b)]
    assert scales[1] == pytest.approx(scales[0], abs=1e-6)


@pytest.mark.parametrize("strategy, checkpointing", [("ddp", False), ("fsdp", True)])
def test_two_processes_give_the_loss_and_weights_of_one_process_on_the_same_global_batch(
        data, tmp_path, strategy, checkpointing):  # noqa: F811
    config = str(data / "clip.yaml")
    train(load_config(config, [f"{k}={v}" for k, v in {**SETTINGS, "train.max_tokens": 10}.items()]),
          tmp_path / "one")
    more = {**SETTINGS, "train.max_tokens": 5, "train.distributed": strategy,
            "train.activation_checkpointing": checkpointing}
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
         str(29581 + checkpointing), "-m", "atencion", "train", config,
         *(a for k, v in more.items() for a in ("--set", f"{k}={v}")), "--out", str(tmp_path / "two")])
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 4
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)  # the loss over all 10 pairs, not each process's 5
    steps = list_checkpoints(tmp_path / "one" / "checkpoints")
    assert [p.name for p in steps] == [p.name for p in list_checkpoints(tmp_path / "two" / "checkpoints")]
    for step in (steps[0], steps[-1]):  # after one update, and after the uneven last batch
        assert_same_towers(step, tmp_path / "two" / "checkpoints" / step.name)
    assert_same_towers(tmp_path / "one" / "last", tmp_path / "two" / "last", optimizer=False)
    summary = json.loads((tmp_path / "two" / "log.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["stopped_by"] == "max_steps" and summary["last_model"] == str(tmp_path / "two" / "last")
