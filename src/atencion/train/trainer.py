"""The training loop of §5: teacher forcing, label smoothing, Adam with warm-up, token batches,
gradient accumulation, validation, early stopping, checkpoints, exact resume, and several
processes under torchrun (DistributedDataParallel, FSDP), for every task (tasks/: translate, lm,
mlm, classify, transcribe, and contrastive, whose model is its own: two towers).

The path is a straight line: text → subwords → batches → model → loss → checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..data.tokenizer import BOS_ID, EOS_ID, MASK, PAD_ID, Tokenizer
from ..devices import resolve_device
from ..errors import AtencionError, Diverged, Interrupted, MissingFileError
from ..fileio import atomic_write_text, clean_stale_temporaries, remove_directory
from ..interrupt import check_ctrl_c, remembering_ctrl_c
from ..nn.lora import LoraSpec, apply_lora, select_targets
from ..nn.model import Model
from ..nn.model_dir import LORA_FILE, build_model, load_model_dir, weights_checksum
from ..nn.moe import RoutingStats, moe_aux_loss
from ..nn.prefix import apply_virtual, check_fits, spec_from_config, unmergeable
from ..nn.towers import Towers
from ..tasks import Task, make_task
from ..torchrun import peer_stop
from .checkpoint import RUN_FILE, list_checkpoints, load_training_state, prepare_run_dir, save_checkpoint
from .config import ADAPTER_KEYS, TrainConfig, check_model_fits, check_task_model, dump_config, load_config
from .distributed import Parallel, init_distributed, set_activation_checkpointing
from .schedule import build_optimizer, learning_rate

log = logging.getLogger(__name__)


def _device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return resolve_device(name, "train.device")


@dataclass
class Start:
    """Where a run starts (resolve_start): the last checkpoint (--resume), train.init_from, or nothing (fresh)."""

    model: Model | None = None          # the weights it starts from: the checkpoint's (its LoRA adapters
                                        # unmerged) or init_from's; None: new weights
    tokenizer: Tokenizer | None = None  # theirs; None: the run trains one
    checkpoint: Path | None = None      # --resume: the checkpoint it continues
    shape: ModelConfig | None = None    # a fine-tuning run (also on --resume): the model whose shape it keeps


def resolve_start(cfg: TrainConfig, checkpoint: Path | None, task: Task | None = None) -> Start:
    """Where the run starts: ``checkpoint`` (--resume), the trained model of train.init_from, or nothing.
    Given the run's ``task`` (its data read), a model of train.init_from is checked against it and
    the config here, before anything is written (``_check_init_from``)."""
    t = cfg.train
    if checkpoint is not None:  # the model as saved (or a task's own: towers), its adapters unmerged: they train on
        model, tokenizer = load_model_dir(checkpoint, what="checkpoint", merge=False, towers=True)
        if not isinstance(model, Towers):
            _same_adapters(model, t, checkpoint)
        return Start(model, tokenizer, checkpoint, shape=model.cfg if t.init_from is not None else None)
    if t.init_from is None:
        return Start()
    model, tokenizer = load_model_dir(t.init_from, what="train.init_from")
    if model.virtual is not None:
        raise unmergeable(f"train.init_from {t.init_from}", model.virtual.spec.kind)
    if t.lora is not None:
        _check_lora_base(model, cfg)
    for key in ("prefix", "prompt"):
        if getattr(t, key) is not None:
            spec = spec_from_config(key, getattr(t, key))
            check_fits(model, spec, f"train.init_from {t.init_from}")
            check_task_model(cfg, model.cfg, f"train.init_from {t.init_from}", virtual=spec.length)
    if task is not None:
        _check_init_from(cfg, task, model.cfg, tokenizer)
    return Start(model, tokenizer, shape=model.cfg)


class Trainer:
    """Owns the model, the optimizer and the position in the data; ``run()`` trains."""

    def __init__(self, cfg: TrainConfig, out_dir: str | Path, resume: bool = False,
                 command: list[str] | None = None):
        self.cfg, self.out = cfg, Path(out_dir)
        # How the user started this run (argv words), for the "continue with" line of a stop (_where).
        self.command = list(command or ["atencion", "train", "CONFIG", "--out", str(self.out)])
        t = cfg.train
        self.device = _device(t.device)
        self.dist = init_distributed(self.device)  # this process's place under torchrun
        if t.threads:
            torch.set_num_threads(t.threads)
        self.ckpt_dir = self.out / "checkpoints"
        checkpoint = self._check_run_dir(resume)  # --resume: the last checkpoint
        self.dist.barrier()  # every process has looked at --out before the main one writes there
        torch.manual_seed(t.seed)
        self.task = make_task(cfg)  # the task's data, read
        self._remove_stale_temporaries()
        start = resolve_start(cfg, checkpoint, self.task)  # resume, train.init_from (checked) or fresh
        self.tokenizer = self._tokenizer(start)
        self.task.encode(self.tokenizer)
        self.model = self.task.model()  # a task's own model (contrastive: two towers), or None
        self._own = self.model is not None
        if self._own:
            self._restore_own(start)
        else:
            self._build_model(start)  # one model of the model section
        set_activation_checkpointing(self.model, t.activation_checkpointing)  # before fsdp wraps the blocks
        self._routing = RoutingStats.of(self.model)  # None without mixture-of-experts layers
        configs = _configs(self.model)
        self._width = configs[0].d_model  # what the schedule scales by (§5.3): the first tower's
        self._aux_weight = next((c.moe["aux_loss_weight"] for c in configs if c.moe is not None), 0.0)
        unused = cfg.task == "classify" or self._routing is not None  # heads left idle; experts given no token
        self.parallel = Parallel(self.model, t.distributed, self.dist, self.device, t.bf16, find_unused=unused)
        self.optimizer = build_optimizer(self.model, t)
        self.state: dict[str, Any] = self._restore(start)
        self._writer = None

    # the steps of __init__ ---------------------------------------------------------------------

    def _check_run_dir(self, resume: bool) -> Path | None:
        """The checkpoint --resume continues (the last; there must be one), or None: --out may hold a new run."""
        checkpoints = list_checkpoints(self.ckpt_dir)
        if resume and not checkpoints:
            if (self.out / RUN_FILE).is_file():
                raise MissingFileError(f"--out {self.out}: this run stopped before its first checkpoint, so "
                                       f"there is nothing to resume; run the same command without --resume "
                                       f"to start it over")
            raise MissingFileError(f"{self.ckpt_dir}: no checkpoint to resume from")
        if not resume:
            prepare_run_dir(self.out, check_only=True)  # refuses a directory that is not a run
            return None
        return checkpoints[-1]

    def _remove_stale_temporaries(self) -> None:
        """Remove (and name) the temporary files an interrupted process left in the run directory."""
        if self.dist.main:
            for directory in (self.out, self.ckpt_dir):
                for line in clean_stale_temporaries(directory):
                    log.warning("%s (left by an interrupted process)", line)

    def _tokenizer(self, start: Start) -> Tokenizer | None:
        """The checkpoint's tokenizer, or init_from's or a new one saved with config.yaml in a new run directory;
        None for a model that reads no tokens (the task's ``tokens``: a ViT)."""
        if start.checkpoint is not None:
            return start.tokenizer
        if self.dist.main:
            try:
                restarted = prepare_run_dir(self.out)
                if restarted:
                    log.warning("%s held a run that stopped before its first checkpoint; starting it over "
                                "(removed %s)", self.out, ", ".join(restarted))
                tokenizer = self.task.train_tokenizer() if start.tokenizer is None else start.tokenizer
                if tokenizer is not None:
                    tokenizer.save(self.out)
                atomic_write_text(self.out / "config.yaml", dump_config(self.cfg))
            except AtencionError as err:
                raise AtencionError(f"{err}; no checkpoint was written; start over in the same directory: "
                                    f"{shlex.join(self.command)}") from None
        self.dist.barrier()
        return Tokenizer.load(self.out) if self.task.tokens else None  # every process reads the main one's

    def _build_model(self, start: Start) -> None:
        """``self.model``: the config's over the tokenizer's vocabularies (none: a ViT), or of
        init_from's shape, on the run's device, holding the weights it starts from (init_from's,
        with its adapters, or the checkpoint's), before fsdp shards them."""
        cfg, t, tok = self.cfg, self.cfg.train, self.tokenizer
        model_cfg = cfg.model_config(*_vocabularies(tok), self.task.model_values(), start=start.shape)
        if tok is not None and not tok.foreign and \
                (model_cfg.pad_id, model_cfg.bos_id, model_cfg.eos_id) != (PAD_ID, BOS_ID, EOS_ID):
            raise AtencionError("model: pad_id/bos_id/eos_id must be 0/2/3, the tokenizer's ids")
        check_model_fits(cfg, model_cfg, f"train.init_from {t.init_from}" if start.shape else None)
        self.model = build_model(model_cfg).to(self.device)
        new_head = self._copy_init_from(start)
        self._adapt(start, new_head)
        self._restore_weights(start)

    def _restore_own(self, start: Start) -> None:
        """A task's own model (``self.model``) on the run's device; on --resume with the
        checkpoint's weights, which the task first checks are of the model its config builds."""
        if start.checkpoint is not None:
            self.task.check_resumed(start.model, start.checkpoint)
            self.model.load_state_dict(start.model.state_dict())
            start.model = None
        self.model.to(self.device)

    def _copy_init_from(self, start: Start) -> list[str]:
        """Copy train.init_from's weights into the new model; returns the names of a new classification head."""
        if start.model is None or start.checkpoint is not None:  # a checkpoint's weights come back in _restore
            return []
        init_from = self.cfg.train.init_from
        new_head = self.model.start_from(start.model, f"train.init_from {init_from}")
        log.info("started from %s%s", init_from, " (a new classification head)" if new_head else "")
        return new_head

    def _adapt(self, start: Start, new_head: list[str]) -> None:
        """LoRA (train.lora) or virtual tokens (train.prefix, train.prompt: nn/prefix.py) over the
        frozen init_from weights; a new head trains beside them."""
        t = self.cfg.train
        key = next((key for key in ADAPTER_KEYS if getattr(t, key) is not None), None)
        if key is None:
            return
        if start.checkpoint is not None:  # the checkpoint's adapters again: the same base, the same trainable head
            new_head = [name for name, p in start.model.named_parameters()
                        if p.requires_grad and name.startswith("classifier.")]
            info = start.model.lora or start.model.virtual
            base, checksum = info.base, info.base_sha256
        else:
            base, checksum = t.init_from, weights_checksum(t.init_from)
        if key == "lora":
            apply_lora(self.model, LoraSpec.from_config(t.lora), base, checksum, trainable=new_head)
        else:
            apply_virtual(self.model, spec_from_config(key, getattr(t, key)), base, checksum, trainable=new_head)
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        log.info("%s: %d of %d parameters trainable (%.2f%%)", {"lora": "LoRA"}.get(key, key), trained,
                 self.model.num_parameters(), 100 * trained / self.model.num_parameters())

    def _restore_weights(self, start: Start) -> None:
        """The checkpoint's weights (exact resume), before the model is spread over the processes."""
        if start.checkpoint is None:
            return
        if isinstance(start.model, Towers):
            raise AtencionError(f"{start.checkpoint}: holds the towers of task contrastive, not one model; the task "
                                f"cannot change on --resume")
        _same_model(start.model.cfg, self.model.cfg, start.checkpoint)
        self.model.load_state_dict(start.model.state_dict())
        start.model = None  # its memory back before the optimizer state is read

    def _restore(self, start: Start) -> dict[str, Any]:
        """The position in training: zero, or the checkpoint's optimizer state and counters (exact resume)."""
        state = {"step": 0, "epoch": 0, "update_in_epoch": 0, "best": None, "best_step": None,
                 "bad_validations": 0, "train_seconds": 0.0, "valid_seconds": 0.0, "update_seconds": 0.0,
                 "target_tokens": 0}
        if start.checkpoint is None:
            return state
        saved = load_training_state(start.checkpoint,
                                    lambda state: self.parallel.load_optimizer_state(self.optimizer, state))
        saved.setdefault("update_seconds",  # checkpoints written before updates were timed apart
                         max(saved["train_seconds"] - saved["valid_seconds"], 0.0))
        state.update(saved)
        log.info("resumed from %s at step %d", start.checkpoint, state["step"])
        return state

    # one update ------------------------------------------------------------------------------

    def _updates(self, epoch: int) -> list[list[list[int]]]:
        """This epoch's updates: each a group of accum_steps × world micro-batches. The last
        group is completed with the epoch's first batches so every process has work."""
        t = self.cfg.train
        batches = self.task.batches(epoch)
        if not batches:  # a task's data always gives one; if it ever does not, say so rather than crash
            raise AtencionError(f"epoch {epoch + 1}: task {self.cfg.task!r} gave no batch to train on")
        size = t.accum_steps * self.dist.world
        groups = [batches[i: i + size] for i in range(0, len(batches), size)]
        if len(groups[-1]) < size:
            groups[-1] = groups[-1] + batches[: size - len(groups[-1])]
        return groups

    def _step(self, group: list[list[int]]) -> dict[str, float]:
        t = self.cfg.train
        step = self.state["step"] + 1
        batches = [self.task.make_batch(b, step, part) for part, b in enumerate(group)]
        total_units = sum(b.units for b in batches)  # every process knows the whole group
        total_tokens = sum(b.tokens for b in batches)
        if total_units == 0:  # the loss is averaged over the units: there must be one
            raise AtencionError(f"step {step}: its batches hold nothing to predict (no target token, masked "
                                f"token or sentence) for task {self.cfg.task!r}")
        mine = batches[self.dist.rank:: self.dist.world]
        self.model.train()
        loss_sum = nll_sum = 0.0
        for i, batch in enumerate(mine):
            batch = batch.to(self.device)
            sync = i == len(mine) - 1
            with self.parallel.accumulating(last=sync), self._autocast():
                loss, nll = self.task.loss(self.parallel.forward, self.model, batch)
                if self._routing is not None:  # the load-balancing loss, weighted per unit like the loss
                    self._routing.add()
                    if self._aux_weight > 0:
                        loss = loss + self._aux_weight * moe_aux_loss(self.model) * batch.units
                # DDP averages gradients over processes: scale so the result is the gradient of
                # the loss summed over the group's units (tokens, sentences) divided by their number.
                (loss * self.dist.world / total_units).backward()
            loss_sum += loss.item()
            nll_sum += nll.item()
        lr = learning_rate(step, self._width, t)
        for group_ in self.optimizer.param_groups:
            group_["lr"] = lr
        grad_norm = self.parallel.clip_grad_norm(t.clip_norm if t.clip_norm > 0 else math.inf)
        if self.dist.world > 1:
            sums = torch.tensor([loss_sum, nll_sum], dtype=torch.float64)
            dist.all_reduce(sums)
            loss_sum, nll_sum = sums.tolist()
        # A non-finite loss or gradient norm would make every weight NaN: stop before the update.
        for name, value in (("loss", loss_sum / total_units), ("gradient norm", grad_norm)):
            if not math.isfinite(value):
                raise Diverged(step, name, value)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state["step"] = step
        self.state["target_tokens"] += total_tokens
        return {"loss": loss_sum / total_units, "nll": nll_sum / total_units, "lr": lr,
                "grad_norm": grad_norm, "tokens": total_tokens, **self.task.after_update(self.model)}

    def _autocast(self):
        if self.cfg.train.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # validation ------------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        self.model.eval()
        return self.task.validate(self.model, self.device, self.state["step"])

    # the loop --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train until max_steps, max_epochs, the time limit or early stopping; return a summary.

        A stop it did not choose ends in an AtencionError that says where the run stopped and
        how to go on: divergence (a non-finite loss or gradient norm; nothing is updated or
        saved after it), a write that failed (a full disk), or Ctrl-C (``Interrupted``)."""
        try:
            with remembering_ctrl_c():  # interrupt.py: a Ctrl-C that something swallows is not lost
                return self._run()
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted at step {self.state['step']}; {self._where()}") from None
        except Diverged as err:
            raise Diverged(err.step, err.what, err.value,
                           f"{err}; {self._where(lower_lr=True)}") from None
        except AtencionError as err:
            raise AtencionError(f"{err}; {self._where()}") from None
        except RuntimeError as err:  # under torchrun: a collective operation failed, another rank stopped?
            stop = peer_stop(err)
            if stop is None:
                raise
            raise stop.error(f"at step {self.state['step']}", self._where()) from None
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def _where(self, lower_lr: bool = False) -> str:
        """The last checkpoint and the command that continues from it (or starts over)."""
        t = self.cfg.train
        words, advice = list(self.command), ""
        if lower_lr:
            key, value = ("lr_peak", t.lr_peak) if t.lr_peak is not None else ("lr_factor", t.lr_factor)
            words = [w for w in words if not w.startswith(f"--set=train.{key}=")] + [f"--set=train.{key}={value / 2:g}"]
            advice = " with a lower learning rate" + ("" if t.clip_norm else " (train.clip_norm helps too)")
        return _where(self.ckpt_dir, words, advice)

    def _show(self, bar, stats: dict[str, Any], last_log: tuple[float, int]) -> None:
        """The progress bar after an update: its loss, rate, tokens per second and epoch."""
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}",
                            tok_s=f"{self._tok_s(last_log):.0f}", epoch=self.state["epoch"] + 1)

    def _limit_reached(self, step: int) -> str | None:
        """Why training stops after update ``step`` ("max_steps", "time_limit": on any process), or None.
        Every process asks about the time at every step (``_any_process`` is a collective)."""
        t = self.cfg.train
        reached = "max_steps" if t.max_steps and step >= t.max_steps else None
        if t.time_limit_minutes and self._any_process(self.state["train_seconds"] >= 60 * t.time_limit_minutes):
            reached = reached or "time_limit"
        return reached

    def _run(self) -> dict[str, Any]:
        t = self.cfg.train
        start = time.time() - self.state["train_seconds"]
        bar = self._progress()
        stop = None
        last_log = (time.time(), self.state["target_tokens"])
        while stop is None and self.state["epoch"] < t.max_epochs:
            updates = self._updates(self.state["epoch"])
            while self.state["update_in_epoch"] < len(updates):
                check_ctrl_c()  # one swallowed during the last update, validation or checkpoint
                began = time.time()
                stats = self._step(updates[self.state["update_in_epoch"]])
                self.state["update_seconds"] += time.time() - began
                self.state["update_in_epoch"] += 1
                self.state["train_seconds"] = time.time() - start
                step = self.state["step"]
                self._show(bar, stats, last_log)
                if step % t.log_every == 0:
                    self._log({"step": step, "epoch": self.state["epoch"] + 1, **stats, **self._routing_record(),
                               "tok_s": round(self._tok_s(last_log)), "seconds": round(self.state["train_seconds"], 1)})
                    last_log = (time.time(), self.state["target_tokens"])
                if t.valid_every and step % t.valid_every == 0:
                    stop = self._validate_and_save()
                    last_log = (time.time(), self.state["target_tokens"])
                reached = self._limit_reached(step)  # (asked of every process at every step: a collective)
                stop = stop or reached
                if stop:
                    break
            else:
                self.state["epoch"] += 1
                self.state["update_in_epoch"] = 0
                if not t.valid_every:
                    stop = self._validate_and_save()
                    last_log = (time.time(), self.state["target_tokens"])
                else:
                    self._save_checkpoint()
                continue
            if not (t.valid_every and self.state["step"] % t.valid_every == 0):
                self._validate_and_save()  # the stopping step gets a checkpoint too
        check_ctrl_c()
        if bar is not None:
            bar.close()
        self.dist.barrier()
        return self._finish(stop or "max_epochs")

    def _any_process(self, flag: bool) -> bool:
        """True on every process if it is true on one (clocks differ; the steps must not)."""
        if self.dist.world == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _routing_record(self) -> dict[str, Any]:
        """The experts' token shares, dropped assignments and load-balancing loss since the last
        log line, over every process (empty without mixture-of-experts layers)."""
        if self._routing is None:
            return {}
        if self.dist.world > 1:
            dist.all_reduce(self._routing.sums)
        return self._routing.record()

    def _tok_s(self, last_log) -> float:
        seconds = max(time.time() - last_log[0], 1e-9)
        return (self.state["target_tokens"] - last_log[1]) / seconds

    def _validate_and_save(self) -> str | None:
        """Validate (if there is validation data) and checkpoint; the time it takes is kept
        apart so that tokens/s measures training alone."""
        began = time.time()
        try:
            return self._validate_and_save_timed()
        finally:
            self.state["valid_seconds"] += time.time() - began

    def _validate_and_save_timed(self) -> str | None:
        t = self.cfg.train
        stop = None
        if self.task.has_validation():
            result = self.validate()
            metric = result.get(f"valid_{self.cfg.early_stop_metric}")
            if metric is None or self.cfg.early_stop_metric == "loss":
                metric = -result["valid_loss"]
            improved = self.state["best"] is None or metric > self.state["best"]
            if improved:
                self.state.update(best=metric, best_step=self.state["step"], bad_validations=0)
            else:
                self.state["bad_validations"] += 1
            self._log({"step": self.state["step"], "epoch": self.state["epoch"], **result,
                       "seconds": round(self.state["train_seconds"], 1), "best": improved})
            if improved:
                model = self._whole_model()
                if self.dist.main:
                    save_checkpoint(self.out / "best", model, self.tokenizer)
            if t.patience and self.state["bad_validations"] >= t.patience:
                stop = "early_stopping"
        self._save_checkpoint()
        return stop

    def _whole_model(self) -> Model | None:
        """The model as one process holds it, on the main process (None on the others); under
        fsdp every process takes part in gathering it."""
        if not self.parallel.sharded:
            return self.model if self.dist.main else None
        state = self.parallel.full_state()
        if not self.dist.main:
            return None
        with torch.random.fork_rng(devices=[]):  # its initial draws do not move the training's random stream
            # on the CPU, its tied tables one tensor as in the sharded model
            whole = self.task.model() if self._own else build_model(self.model.cfg)
        whole.load_state_dict(state)
        return whole

    def _save_checkpoint(self) -> None:
        """Write this step's checkpoint (the whole model and optimizer state, as one process would)
        and remove the oldest beyond train.keep_last; every process takes part under fsdp."""
        model = self._whole_model()
        optimizer = self.parallel.full_optimizer_state(self.optimizer)
        if not self.dist.main:
            return
        path = self.ckpt_dir / f"step_{self.state['step']:08d}"
        save_checkpoint(path, model, self.tokenizer, optimizer, self.state)
        for old in list_checkpoints(self.ckpt_dir)[: -self.cfg.train.keep_last]:
            remove_directory(old)  # renamed away first: a Ctrl-C midway leaves no half-deleted step_*

    def _finish(self, reason: str) -> dict[str, Any]:
        if self._own:  # a task's own model (contrastive's towers) is also left whole in OUT/last
            model = self._whole_model()
            if self.dist.main:
                save_checkpoint(self.out / "last", model, self.tokenizer)
        last = list_checkpoints(self.ckpt_dir)
        summary = {"stopped_by": reason, "steps": self.state["step"], "epochs": self.state["epoch"],
                   "seconds": round(self.state["train_seconds"], 1),
                   "valid_seconds": round(self.state["valid_seconds"], 1),
                   "tok_s": (round(self.state["target_tokens"] / self.state["update_seconds"])
                             if self.state["update_seconds"] > 0 else None),
                   "best_step": self.state["best_step"],
                   "best_model": str(self.out / "best") if (self.out / "best").is_dir() else None,
                   **({"last_model": str(self.out / "last")} if self._own else {}),
                   "last_checkpoint": str(last[-1]) if last else None}
        self._log({"summary": summary})
        return summary

    def _progress(self):
        if not (self.cfg.train.progress and self.dist.main):
            return None
        from tqdm import tqdm

        t = self.cfg.train
        total = t.max_steps or len(self._updates(0)) * t.max_epochs  # for the ETA
        # disable=None: no bar when stderr is not a terminal (logs stay readable)
        return tqdm(total=total, initial=self.state["step"], unit="step", dynamic_ncols=True, leave=False,
                    disable=None)

    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.main:
            return
        log.info(json.dumps(record))
        try:
            with open(self.out / "log.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise AtencionError(f"{self.out / 'log.jsonl'}: cannot write ({err.strerror or err})") from None
        if self.cfg.train.tensorboard and "step" in record:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.out / "tensorboard"))
            for key, value in record.items():
                if key not in ("step", "best") and isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, record["step"])
            for i, shares in enumerate(record.get("moe_share", [])):
                for j, share in enumerate(shares):
                    self._writer.add_scalar(f"moe/layer{i}/expert{j}", share, record["step"])


def _check_lora_base(start: Model, cfg: TrainConfig) -> None:
    """Before anything is written: the base of a LoRA run holds plain weights, and the targets
    and rank of train.lora fit it."""
    init_from = Path(cfg.train.init_from)
    if (init_from / LORA_FILE).is_file():
        raise AtencionError(f"train.init_from {init_from}: is a LoRA model; adapters are trained over plain "
                            f"weights: fold its adapters in first (atencion merge-lora --model {init_from} "
                            f"--out DIR) and start from DIR")
    select_targets(start, LoraSpec.from_config(cfg.train.lora))


def _check_init_from(cfg: TrainConfig, task: Task, start: ModelConfig, tokenizer: Tokenizer) -> None:
    """Before anything is written: the model of train.init_from fits the run (its shape against the
    model section, its arch and positions against the task and the data: ``model_config``, which
    the run calls again to build it), and its tokenizer holds the symbols the task needs (mlm:
    <mask>). Every refusal names train.init_from and its path."""
    cfg.model_config(*_vocabularies(tokenizer), task.model_values(), start=start)
    if tokenizer is None:  # a model without a vocabulary: no symbol to need
        return
    if tokenizer.foreign and cfg.task == "translate":
        raise AtencionError(f"train.init_from {cfg.train.init_from}: a Hugging Face translator (Marian) starts "
                            f"decoding from its own ids, which the translate task's batches do not use yet; "
                            f"fine-tune a language model, masked language model or classifier from one")
    if tokenizer.foreign:  # its own mask token (BERT's [MASK])
        missing = [MASK] if MASK in task.symbols and tokenizer.mask_id is None else []
    else:
        missing = [symbol for symbol in task.symbols if tokenizer.piece(tokenizer.src.piece_to_id(symbol)) != symbol]
    if missing:
        raise AtencionError(f"train.init_from {cfg.train.init_from}: its tokenizer has no {missing[0]}, which task "
                            f"{cfg.task!r} needs; start from a model whose vocabulary has it")


def _configs(model) -> list[ModelConfig]:
    """The configs of what is trained: the model's, or each tower's (nn/towers.py)."""
    return [tower.cfg for tower in model.towers.values()] if isinstance(model, Towers) else [model.cfg]


def _vocabularies(tokenizer: Tokenizer | None) -> tuple[int, int | None]:
    """The vocabulary sizes a model is built over: the tokenizer's (source, and target unless
    joint); none (0) without a tokenizer, for a model that reads no tokens."""
    if tokenizer is None:
        return 0, None
    return tokenizer.src_vocab_size, None if tokenizer.joint else tokenizer.tgt_vocab_size


def _same_adapters(saved: Model, t, checkpoint: Path) -> None:
    """--resume must rebuild the adapters it saved (or none): train.lora, train.prefix, train.prompt."""
    info = saved.lora or saved.virtual
    had = None if info is None else info.spec
    key = next((key for key in ADAPTER_KEYS if getattr(t, key) is not None), None)
    given = None if key is None else LoraSpec.from_config(t.lora) if key == "lora" else \
        spec_from_config(key, getattr(t, key))
    if had != given:
        def show(spec):
            if spec is None:
                return "no train.lora, train.prefix or train.prompt"
            return f"train.{'lora' if isinstance(spec, LoraSpec) else spec.kind} {spec}"
        raise AtencionError(f"{checkpoint}: was trained with {show(had)} but the config given now has "
                            f"{show(given)}; the adapters cannot change on --resume")


def _same_model(saved: ModelConfig, given: ModelConfig, checkpoint: Path) -> None:
    """--resume must rebuild the model it saved: name the first key where the configs differ."""
    for key, value in saved.to_dict().items():
        if key == "task" and value is None:  # a checkpoint written before the task was saved in config.json
            continue
        if getattr(given, key) != value:
            raise AtencionError(f"{checkpoint / 'config.json'}: {key} is {value!r} but the config given now "
                                f"makes it {getattr(given, key)!r}; the model section cannot change on --resume")


def train_file(config: str | Path, out_dir: str | Path, overrides: list[str] = (), resume: bool = False
               ) -> dict[str, Any]:
    """`atencion train`: train as the YAML file ``config`` says, with ``overrides``
    (SECTION.KEY=VALUE) applied, into ``out_dir``; ``resume`` continues the run there."""
    from ..fileio import need_dir, need_file

    need_file(config, "CONFIG")
    if resume:
        need_dir(out_dir, "--out")
    cfg = load_config(config, list(overrides))
    command = ["atencion", "train", str(config), "--out", str(out_dir), *(f"--set={s}" for s in overrides)]
    return train(cfg, out_dir, resume=resume, command=command)


def _where(ckpt_dir: Path, words: list[str], advice: str = "") -> str:
    """The last checkpoint under ``ckpt_dir`` and the command (``words``) that continues from it,
    or the one that starts over when there is none."""
    last = list_checkpoints(ckpt_dir)
    if not last:
        return f"no checkpoint was written; start over in the same directory{advice}: {shlex.join(words)}"
    return f"the last checkpoint is {last[-1]}; continue from it{advice}: {shlex.join(words + ['--resume'])}"


@contextmanager
def _taken_back_if_refused(out: Path) -> Iterator[None]:
    """Within: a run that is refused while it starts (a config error found once the data is read,
    a model too large, an adapter that does not fit) takes back what it wrote to ``out``: the
    directories it created (``out`` and any new parent), or the files it wrote into an ``out``
    that was empty. A directory that held anything before (an earlier run, the user's files) is
    left as it is; so is everything on an interruption (its line says how to start over)."""
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the topmost new one
    was_empty = created is None and out.is_dir() and not any(out.iterdir())
    try:
        yield
    except Interrupted:
        raise
    except AtencionError:
        if int(os.environ.get("RANK", "0")) == 0:  # the process that wrote there
            if created is not None and created.is_dir():
                remove_directory(created)
            elif was_empty:
                for entry in out.iterdir():
                    if entry.is_dir():
                        remove_directory(entry)
                    else:
                        entry.unlink()
        raise


def train(cfg: TrainConfig, out_dir: str | Path, resume: bool = False,
          command: list[str] | None = None) -> dict[str, Any]:
    """Train a model as ``cfg`` says, writing everything under ``out_dir``. ``command``: the
    words of the command line that started it (without --resume), quoted in the line that says
    how to go on after a stop."""
    with remembering_ctrl_c():
        try:
            with _taken_back_if_refused(Path(out_dir)):
                trainer = Trainer(cfg, out_dir, resume, command)
            check_ctrl_c()
        except KeyboardInterrupt:  # reading the data, training the tokenizer, loading a checkpoint
            words = list(command or ["atencion", "train", "CONFIG", "--out", str(out_dir)])
            raise Interrupted(f"interrupted while the run was starting, before any update; "
                              f"{_where(Path(out_dir) / 'checkpoints', words)}") from None
        except RuntimeError as err:  # under torchrun: another rank stopped while the run was starting?
            stop = peer_stop(err)
            if stop is None:
                raise
            words = list(command or ["atencion", "train", "CONFIG", "--out", str(out_dir)])
            raise stop.error("while the run was starting", _where(Path(out_dir) / "checkpoints", words)) from None
        return trainer.run()
