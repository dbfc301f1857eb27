"""configs/gpt2_124m.yaml for a few updates: tokens per second and model FLOPs utilisation (MFU).

    python -m benchmarks.gpt2_recipe --out runs/gpt2-check                       # a GPU (bf16), 30 updates
    torchrun --nproc-per-node 8 -m benchmarks.gpt2_recipe --out runs/gpt2-check --set train.distributed=fsdp
    python -m benchmarks.gpt2_recipe --out runs/gpt2-tiny --steps 3 --device cpu \\
        --set model.n_layers=2 --set model.d_model=64 --set model.n_heads=2 --set model.d_ff=256 \\
        --set data.block_size=64 --set train.max_tokens=256 --set train.bf16=false   # a CPU miniature
    python -m benchmarks.gpt2_recipe --smoke                                     # seconds: a check

The recipe's data is whatever corpus you give it; here Tiny Shakespeare stands in: a SentencePiece
tokenizer (``--vocab`` pieces) is trained on it, the text written as token files with
``atencion tokenize``, and the recipe trains ``--steps`` updates of one micro-batch (12 blocks of
1,024 tokens) per process. MFU is nanoGPT's estimate: the model's FLOPs per token (6·N + 12·L·d·T,
N the parameters, L layers, d d_model, T the block) times tokens per second, over ``--peak``
FLOP/s per process (default 989e12: an H100/H200's dense bf16).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.common import DATA, ROOT, SMOKE_HELP, smoke_dir, smoke_requested, tiny_text

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)
# --smoke: the CPU miniature of the docstring, smaller still
SMOKE_SETS = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "data.block_size=16",
              "train.max_tokens=64", "train.bf16=false"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=not smoke_requested(argv),
                        help="a new directory for the tokenizer, token files and run")
    parser.add_argument("--text", default=str(DATA / "tinyshakespeare" / "input.txt.gz"), help="the corpus")
    parser.add_argument("--vocab", type=int, default=8000, help="SentencePiece pieces (default 8000)")
    parser.add_argument("--steps", type=int, default=30, help="updates (default 30)")
    parser.add_argument("--device", default="auto", help="train.device (default auto)")
    parser.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s of one process's device")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here on the CPU, 2 updates")
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("gpt2_recipe") as tmp:
            return main(["--out", str(tmp / "run"), "--text", str(tiny_text(tmp / "text.txt.gz")), "--vocab", "80",
                         "--steps", "2", "--device", "cpu", *[a for s in SMOKE_SETS + args.set for a in ("--set", s)]])

    import torch.distributed as dist

    from atencion.data.corpus import read_lines
    from atencion.data.tokenizer import Tokenizer
    from atencion.tasks.lm import tokenize_files
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    lines = read_lines(args.text)
    cut = int(len(lines) * 0.9)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=False)
        (out / "train.txt").write_text("\n".join(lines[:cut]) + "\n")
        (out / "valid.txt").write_text("\n".join(lines[cut:]) + "\n")
        Tokenizer.train_text(lines[:cut], "sentencepiece", args.vocab, "bpe", 1.0, ()).save(out / "tokenizer")
        for name in ("train", "valid"):
            tokenize_files(str(out / "tokenizer"), [str(out / f"{name}.txt")], str(out / f"{name}.tokens"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if args.device != "cpu" else "gloo")
        dist.barrier()
    overrides = {"data.train_tokens": out / "train.tokens", "data.valid_tokens": out / "valid.tokens",
                 "data.tokenizer_dir": out / "tokenizer", "train.max_steps": args.steps, "train.accum_steps": 1,
                 "train.valid_every": args.steps, "train.warmup": 10, "train.log_every": 1, "train.progress": False,
                 "train.device": args.device}
    cfg = load_config(ROOT / "configs" / "gpt2_124m.yaml", [f"{k}={v}" for k, v in overrides.items()] + args.set)
    summary = train(cfg, out / "run")
    if rank != 0:
        return
    records = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines()]
    steady = [r["tok_s"] for r in records if "tok_s" in r and r.get("step", 0) > 3]  # after the first updates
    from atencion.nn.model_dir import load_model

    model = load_model(Path(summary["last_checkpoint"]))
    c = model.cfg
    n = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * n + 12 * c.n_layers * c.d_model * cfg.data.block_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok_s = sorted(steady)[len(steady) // 2] if steady else summary["tok_s"]
    print(json.dumps({"parameters": n, "steps": summary["steps"], "world": world, "tok_s_median": tok_s,
                      "tok_s_run": summary["tok_s"], "mfu": round(flops_per_token * tok_s / (args.peak * world), 4),
                      "peak_flops_per_process": args.peak}))


if __name__ == "__main__":
    main()
