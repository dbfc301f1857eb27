"""Training CLIP's towers (task contrastive, tasks/contrastive.py): its own loop, as the trainer's
(train/trainer.py) trains one model: the learned temperature clamped after each update, the
checkpoint chosen by validation zero-shot accuracy."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import AtencionError, Diverged
from ..fileio import need_dir, need_output_dir, remove_directory
from ..nn.model_dir import load_towers, save_towers
from ..tasks.contrastive import ContrastiveTask
from .checkpoint import list_checkpoints, load_training_state, save_checkpoint
from .schedule import build_optimizer, learning_rate

log = logging.getLogger(__name__)


def train_towers(cfg, out_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train the towers as ``cfg`` (a TrainConfig of task contrastive) says into ``out_dir``:
    OUT/best (the towers of the best validation zero-shot accuracy), OUT/last, OUT/log.jsonl and,
    at each validation, OUT/checkpoints/step_N (the towers, the optimizer and RNG states, where
    the run is: what ``resume`` continues from, repeating exactly what an unbroken run does)."""
    t = cfg.train
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would train alone and write the same files
        raise AtencionError("task contrastive trains in one process: run `atencion train` without torchrun (its "
                            "loss would need every process's embeddings, which this loop does not gather)")
    out = need_dir(out_dir, "--out") if resume else need_output_dir(out_dir, "--out")
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    task = ContrastiveTask(cfg)
    state = {"step": 0, "epoch": 0, "batches_done": 0, "best": -1.0, "best_step": 0, "seconds": 0.0}
    if resume:
        checkpoints = list_checkpoints(out / "checkpoints")
        if not checkpoints:
            raise AtencionError(f"--resume: {out / 'checkpoints'} holds no checkpoint; start again in a new --out")
        model = load_towers(checkpoints[-1])
        for name, tower in model.towers.items():
            if tower.cfg != task.configs.get(name):
                raise AtencionError(f"{checkpoints[-1] / name / 'config.json'}: not the tower model.towers.{name} "
                                    f"gives now; the model section cannot change on --resume")
        model.train()
    else:
        model = task.model()
    optimizer = build_optimizer(model, t)
    if resume:
        def load_optimizer(given: dict) -> None:
            optimizer.load_state_dict({**optimizer.state_dict(), "state": given["state"]})

        state = load_training_state(checkpoints[-1], load_optimizer)
    out.mkdir(parents=True, exist_ok=True)
    width = model.towers[model.names[0]].cfg.d_model
    start, last = time.time() - state["seconds"], {}
    with open(out / "log.jsonl", "a" if resume else "w", encoding="utf-8") as logfile:
        def record(values: dict) -> None:
            logfile.write(json.dumps(values) + "\n")
            logfile.flush()
            log.info("%s", values)

        def checkpoint() -> None:
            state["seconds"] = time.time() - start
            save_checkpoint(out / "checkpoints" / f"step_{state['step']:08d}", model, None, optimizer.state_dict(),
                            state)
            for old in list_checkpoints(out / "checkpoints")[: -t.keep_last]:
                remove_directory(old)

        while state["epoch"] < t.max_epochs and not (t.max_steps and state["step"] >= t.max_steps):
            for batch in task.batches(state["epoch"])[state["batches_done"]:]:
                state["step"] += 1
                state["batches_done"] += 1
                step = state["step"]
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step, width, t)
                loss = task.loss(model, batch)
                if not math.isfinite(float(loss.detach())):
                    raise Diverged(step, "training loss", float(loss.detach()))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if t.clip_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)
                optimizer.step()
                model.clamp_()
                last = {"step": step, "epoch": state["epoch"] + 1, "loss": round(float(loss.detach()), 4),
                        "temperature": round(1 / math.exp(model.log_scale.item()), 4)}
                if step % t.log_every == 0:
                    record(last)
                done = bool(t.max_steps) and step >= t.max_steps
                if task.valid is not None and (done or (t.valid_every and step % t.valid_every == 0)):
                    scores = task.validate(model, step)
                    record({"step": step, **{k: round(v, 4) for k, v in scores.items()}})
                    if scores["valid_zero_shot_accuracy"] > state["best"]:
                        state["best"], state["best_step"] = scores["valid_zero_shot_accuracy"], step
                        save_towers(model, out / "best")
                    checkpoint()
                if done:
                    break
            else:
                state["epoch"] += 1
                state["batches_done"] = 0
                continue
            break
        save_towers(model, out / "last")
        best = state["best"]
        summary = {"steps": state["step"], "epochs": state["epoch"] + (state["batches_done"] > 0),
                   "minutes": round((time.time() - start) / 60, 2), "last_loss": last.get("loss"),
                   "best_step": state["best_step"] or None,
                   "best_valid_zero_shot_accuracy": round(best, 4) if best >= 0 else None,
                   "best_model": str(out / "best") if best >= 0 else None, "last_model": str(out / "last")}
        record({"summary": summary})
    return summary
