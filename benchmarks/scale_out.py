"""FSDP against DDP at GPT-2 124M's shape on CPU processes (gloo): what each process holds and how
fast the processes train, in the same run; and what activation checkpointing saves and costs.

    python -m benchmarks.scale_out                      # 2 processes, 1 thread each, ~3 minutes
    python -m benchmarks.scale_out --preset gpt-tiny --steps 5
    python -m benchmarks.scale_out --smoke              # seconds: a check, not a result

For each setting (ddp, fsdp, each without and with train.activation_checkpointing) a fresh group of
processes builds the model (atencion's gpt2 preset: 124M parameters with the 50,257-token table),
wraps it as the trainer does (train/distributed.Parallel), takes one AdamW update to warm up and
then ``--steps`` timed ones on random blocks. It prints, per process:

* held: the bytes of parameters + gradients + optimizer state this process holds, counted from
  its tensors (under fsdp, its shards) after an update;
* high-water: the process's peak resident memory (ru_maxrss), which adds activations, the
  gathered units of fsdp and everything else a process holds;
* tok/s: training tokens per second of the group (all processes), and the ratios fsdp/ddp and
  checkpointed/plain of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import SMOKE_HELP, free_port

KIND = "speed"  # a speed (and memory) benchmark (benchmarks/__init__.py lists the two groups)


def worker(rank: int, world: int, port: int, setting: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from atencion.config import ModelConfig
    from atencion.nn.model_dir import build_model
    from atencion.train.config import OptimConfig
    from atencion.train.distributed import Dist, Parallel, set_activation_checkpointing
    from atencion.train.schedule import build_optimizer

    torch.set_num_threads(setting["threads"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = ModelConfig.preset(setting["preset"], vocab_size=setting["vocab"], dropout=0.0, bias=False,
                                  max_positions=setting["block"])
    model = build_model(cfg)
    set_activation_checkpointing(model, setting["checkpointing"])
    parallel = Parallel(model, setting["strategy"], Dist(rank, world), torch.device("cpu"), False, find_unused=False)
    optimizer = build_optimizer(model, OptimConfig(optimizer="adamw", weight_decay=0.1))
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        ids = torch.randint(0, cfg.vocab_size, (setting["batch"], setting["block"] + 1), generator=g)
        logits = parallel.forward(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        loss.backward()
        parallel.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: they are held between updates

    step()
    held = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held["parameters"] += local.numel() * local.element_size()
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            held["gradients"] += grad.numel() * grad.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                local = value.to_local() if hasattr(value, "to_local") else value
                held["optimizer"] += local.numel() * local.element_size()
    dist.barrier()
    began = time.perf_counter()
    for _ in range(setting["steps"]):
        step()
    dist.barrier()
    seconds = time.perf_counter() - began
    record = {"rank": rank, "held": held, "held_bytes": sum(held.values()), "seconds": seconds,
              "tokens": setting["steps"] * setting["batch"] * setting["block"] * world,
              "high_water_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "parameters": sum(p.numel() for p in model.parameters())}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def measure(setting: dict, world: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(world, free_port(), setting, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2", help="model preset (default: gpt2, 124M)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary (default: GPT-2's 50,257)")
    parser.add_argument("--block", type=int, default=256, help="tokens per block (default: 256)")
    parser.add_argument("--batch", type=int, default=2, help="blocks per process and update (default: 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed updates per setting (default: 3)")
    parser.add_argument("--world", type=int, default=2, help="processes (default: 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here gpt-tiny, vocabulary 256, one "
                        "process, blocks of 16, one timed update")
    args = parser.parse_args(argv)
    if args.smoke:
        return main(["--preset", "gpt-tiny", "--vocab", "256", "--block", "16", "--batch", "1", "--steps", "1",
                     "--world", "1", "--threads", "1"])
    base = dict(preset=args.preset, vocab=args.vocab, block=args.block, batch=args.batch, steps=args.steps,
                threads=args.threads)
    results = {}
    for strategy in ("ddp", "fsdp"):
        for checkpointing in (False, True):
            name = strategy + (" + checkpointing" if checkpointing else "")
            results[name] = measure({**base, "strategy": strategy, "checkpointing": checkpointing}, args.world)
    summary = {}
    for name, ranks in results.items():
        summary[name] = {"held_MiB": [round(r["held_bytes"] / 2**20, 1) for r in ranks],
                         "high_water_MiB": [round(r["high_water_bytes"] / 2**20, 1) for r in ranks],
                         "tok_s": round(ranks[0]["tokens"] / max(r["seconds"] for r in ranks), 1)}
    ratio = lambda a, b, key: round(statistics.mean(summary[a][key]) / statistics.mean(summary[b][key]), 3)  # noqa: E731
    summary["ratios"] = {
        "held fsdp/ddp": ratio("fsdp", "ddp", "held_MiB"),
        "high-water fsdp/ddp": ratio("fsdp", "ddp", "high_water_MiB"),
        "tok/s fsdp/ddp": round(summary["fsdp"]["tok_s"] / summary["ddp"]["tok_s"], 3),
        "high-water checkpointed/plain (ddp)": ratio("ddp + checkpointing", "ddp", "high_water_MiB"),
        "tok/s checkpointed/plain (ddp)": round(summary["ddp + checkpointing"]["tok_s"] / summary["ddp"]["tok_s"], 3),
        "high-water checkpointed/plain (fsdp)": ratio("fsdp + checkpointing", "fsdp", "high_water_MiB"),
        "tok/s checkpointed/plain (fsdp)": round(summary["fsdp + checkpointing"]["tok_s"] / summary["fsdp"]["tok_s"],
                                                 3)}
    parameters = results["ddp"][0]["parameters"]
    if args.json:
        print(json.dumps({"settings": {**base, "world": args.world, "parameters": parameters}, **summary}))
        return
    print(f"{args.preset}: {parameters:,} parameters; {args.world} processes x {args.threads} thread(s); "
          f"{args.batch} x {args.block} tokens per process and update; {args.steps} timed updates")
    print(f"{'setting':26} {'held MiB (per rank)':>22} {'high-water MiB':>18} {'tok/s':>8}")
    for name, row in summary.items():
        if name != "ratios":
            print(f"{name:26} {str(row['held_MiB']):>22} {str(row['high_water_MiB']):>18} {row['tok_s']:>8}")
    for key, value in summary["ratios"].items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
