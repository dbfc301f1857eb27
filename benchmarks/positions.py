"""Positions and extrapolation: the same character-level GPT trained on Tiny Shakespeare with each
kind of position (sinusoidal, learned, RoPE, ALiBi, T5's bucketed bias), then its validation
loss measured at 1×, 2×, 4×, 8× and 16× the length it was trained on (the shape of the ALiBi
paper's Figure 1 / Table 2).

    python -m benchmarks.positions --out runs/positions            # train what is missing, evaluate
    python -m benchmarks.positions --out runs/positions --steps 500 --kinds alibi,rope

Each model is configs/shakespeare_char.yaml (nanoGPT's baby GPT: 4 layers, 4 heads, d_model 128,
block 64, 2,000 updates) with ``model.positional`` changed; learned positions keep their table of
``block`` rows and so cannot be evaluated past it (reported as such, not as a number). A run
that finished is reused. The validation text is the last 10% of the file, cut into
non-overlapping blocks of each evaluation length (``lm_scores``), so every length predicts the
same characters. Prints one JSON object and writes OUT/positions.json and, with --figure, a PNG.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from benchmarks.common import DATA, ROOT, SMOKE_HELP, TINY_MODEL, finished, last_summary, smoke_dir, tiny_text

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)


def train_kind(kind: str, args) -> Path:
    run = Path(args.out) / kind
    if (run / "best").is_dir() and finished(run):
        return run / "best"
    command = [sys.executable, "-m", "atencion", "train", args.config, "--out", str(run),
               f"--set=model.positional={kind}", f"--set=train.max_steps={args.steps}",
               f"--set=data.block_size={args.block}", f"--set=train.max_tokens={args.block * args.batch}",
               f"--set=model.max_positions={args.block}", f"--set=train.threads={args.threads}",
               f"--set=data.train_text={args.text}",  # the text evaluate_kind scores the held-out tail of
               *[f"--set={item}" for item in args.set]]
    if (run / "checkpoints").is_dir():
        command.append("--resume")
    subprocess.run(command, check=True)
    return run / "best"


def evaluate_kind(model_dir: Path, args) -> dict:
    from atencion.data.text import read_text, split_tail
    from atencion.nn.model_dir import load_model_dir
    from atencion.nn.positional import position_limit
    from atencion.tasks.lm import evaluate_lm

    model, tokenizer = load_model_dir(model_dir)
    _, valid = split_tail(read_text(args.text, "--text"), 0.1)
    result = {}
    for factor in args.factors:
        length = args.block * factor
        limit = position_limit(model.cfg)
        if limit is not None and length > limit:
            result[str(factor)] = None  # the table stops at max_positions: there is no number to give
            continue
        result[str(factor)] = round(evaluate_lm(model, tokenizer, valid, block_size=length)["loss"], 4)
    return result


def figure(report: dict, path: Path, block: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for kind, losses in report["loss"].items():
        points = [(int(f) * block, v) for f, v in losses.items() if v is not None]
        label = kind if len(points) == len(losses) else f"{kind} (no positions past {block})"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4 if len(points) > 1 else 9,
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (characters); trained at %d" % block)
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title("Char-level GPT on Tiny Shakespeare, past its training length", fontsize=10)
    ax.axvline(block, color="grey", linestyle=":", linewidth=1)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def main(argv: list[str] | None = None) -> dict:
    from atencion.nn import positional

    kinds_known = positional.kinds("absolute") + positional.kinds("relative")  # any sequence's: not a grid's
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/positions", help="one run directory per kind is made here")
    parser.add_argument("--config", default=str(ROOT / "configs" / "shakespeare_char.yaml"))
    parser.add_argument("--text", default=str(DATA / "tinyshakespeare" / "input.txt.gz"))
    parser.add_argument("--kinds", default=",".join(kinds_known), help=f"comma-separated, of {', '.join(kinds_known)}")
    parser.add_argument("--steps", type=int, default=2000, help="updates per model (default: 2000)")
    parser.add_argument("--block", type=int, default=64, help="training length (default: 64)")
    parser.add_argument("--batch", type=int, default=12, help="blocks per update (default: 12)")
    parser.add_argument("--factors", default="1,2,4,8,16", help="evaluation lengths as multiples of --block")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per training (0: torch's choice)")
    parser.add_argument("--figure", help="write the figure to this PNG")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here two kinds")
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("positions") as tmp:
            return main(["--out", str(tmp), "--text", str(tiny_text(tmp / "text.txt.gz")), "--kinds", "learned,alibi",
                         "--steps", "2", "--block", "16", "--batch", "2", "--factors", "1,2", "--threads", "1",
                         "--figure", str(tmp / "positions.png"),
                         *[a for s in [*TINY_MODEL, "train.valid_every=2"] for a in ("--set", s)]])
    args.factors = [int(f) for f in args.factors.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(kinds_known))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; expected some of {list(kinds_known)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    report = {"block": args.block, "steps": args.steps, "batch": args.batch, "factors": args.factors, "loss": {},
              "train_minutes": {}}
    for kind in kinds:
        best = train_kind(kind, args)
        report["loss"][kind] = evaluate_kind(best, args)
        report["train_minutes"][kind] = round(last_summary(best.parent)["seconds"] / 60, 1)
        print(json.dumps({kind: report["loss"][kind]}), file=sys.stderr)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "positions.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.figure:
        figure(report, Path(args.figure), args.block)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
