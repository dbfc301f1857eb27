"""Dense against mixture of experts: the character-level GPT of configs/shakespeare_char.yaml
(4 layers, d_model 128, d_ff 512) trained three times for the same updates on Tiny Shakespeare:

- ``dense``: the config as it is;
- ``moe``: every FFN replaced by 4 experts of d_ff 256, top-2 (the same active FFN parameters per
  token as the dense model, twice the total), load-balancing loss weight 0.01;
- ``moe_noaux``: the same without the load-balancing loss (weight 0): what the router does alone.

    python -m benchmarks.moe --out runs/moe --figure docs/figures/moe_share.png
    python -m benchmarks.moe --smoke                                         # a look, not a result
    python -m benchmarks.moe --out runs/moe-top1 --top-k 1 --skip-dense --figure docs/figures/moe_share_top1.png

Prints one JSON object (and writes OUT/moe.json): per run the best validation loss (nats/char),
the training speed (the trainer's tokens/s), and the total and active parameters (those one
token passes through). With --figure, a PNG of each expert's share of the routed tokens against
the update, with and without the load-balancing loss, for one layer (--layer) or all of them. A
finished run is reused; an interrupted one resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from benchmarks.common import DATA, ROOT, SMOKE_HELP, TINY_MODEL, finished, read_log, smoke_dir, tiny_text

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
EXPERTS = 4


def runs(top_k: int, d_ff: int) -> dict[str, list[str]]:
    """The --set lines of each run: the experts' d_ff is the dense d_ff / top_k, so that a token
    passes through as many FFN weights in every run."""
    moe = ["model.d_ff=" + str(d_ff // top_k), f"model.moe.experts={EXPERTS}", f"model.moe.top_k={top_k}"]
    return {"dense": [], "moe": [*moe, "model.moe.aux_loss_weight=0.01"],
            "moe_noaux": [*moe, "model.moe.aux_loss_weight=0"]}


def train_run(name: str, args) -> Path:
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    run = Path(args.out) / name
    if finished(run):
        return run
    steps = args.steps
    sets = [f"data.train_text={args.text}", f"train.threads={args.threads}", "train.progress=false",
            f"train.log_every={max(1, steps // 40)}" if steps else None, f"train.max_steps={steps}" if steps else None,
            *runs(args.top_k, args.d_ff)[name], *args.set]
    cfg = load_config(args.config, [s for s in sets if s])
    train(cfg, run, resume=(run / "checkpoints").is_dir())
    return run


def measure(run: Path) -> dict:
    from atencion.nn.moe import active_parameters
    from atencion.nn.transformer import Transformer

    records = read_log(run)
    model = Transformer.load(run / "best")
    summary = [r["summary"] for r in records if "summary" in r][-1]
    return {"best_valid_loss": round(min(r["valid_loss"] for r in records if "valid_loss" in r), 4),
            "tok_s": summary["tok_s"], "steps": summary["steps"],
            "parameters": model.num_parameters(), "active_parameters": active_parameters(model)}


def shares(run: Path) -> tuple[list[int], list[list[list[float]]]]:
    """The steps of the log lines and, at each, the share of every expert in every MoE layer."""
    lines = [r for r in read_log(run) if "moe_share" in r]
    return [r["step"] for r in lines], [r["moe_share"] for r in lines]


def figure(out: Path, path: Path, layer: int | None, top_k: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = {"with the load-balancing loss (0.01)": out / "moe", "without it": out / "moe_noaux"}
    data = {title: shares(run) for title, run in runs.items()}
    n_layers = len(next(iter(data.values()))[1][0])
    if layer is not None and not 0 <= layer < n_layers:
        raise SystemExit(f"--layer {layer}: the model has MoE layers 0 to {n_layers - 1}")
    layers = [layer] if layer is not None else list(range(n_layers))
    fig = Figure(figsize=(9.0, 2.3 * len(layers) + 0.6))
    axes = fig.subplots(len(layers), len(runs), sharex=True, sharey=True, squeeze=False)
    for column, (title, (steps, per_step)) in enumerate(data.items()):
        for row, i in enumerate(layers):
            ax = axes[row][column]
            for expert in range(EXPERTS):
                ax.plot(steps, [s[i][expert] for s in per_step], label=f"expert {expert}")
            ax.axhline(1 / EXPERTS, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(title, fontsize=10)
            if column == 0:
                ax.set_ylabel(f"layer {i}: share")
            if row == len(layers) - 1:
                ax.set_xlabel("update")
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Char-level GPT on Tiny Shakespeare: tokens routed to each of {EXPERTS} experts "
                 f"(top-{top_k}; dotted: uniform)", fontsize=10)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/moe", help="one run directory per model is made here")
    parser.add_argument("--config", default=str(ROOT / "configs" / "shakespeare_char.yaml"))
    parser.add_argument("--text", default=str(DATA / "tinyshakespeare" / "input.txt.gz"))
    parser.add_argument("--steps", type=int, default=0, help="updates per model (default: the config's, 2,000)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--figure", help="write the expert shares to this PNG")
    parser.add_argument("--layer", type=int, help="the figure's layer (default: every layer, one row each)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2; each expert's d_ff "
                        "is the dense d_ff / top-k)")
    parser.add_argument("--skip-dense", action="store_true", help="train the two MoE runs only")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every run, as atencion train --set")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        sets = [*TINY_MODEL, "model.max_positions=16", "data.block_size=16", "train.max_tokens=64",
                "train.valid_every=2", *args.set]
        with smoke_dir("moe") as tmp:
            return main(["--out", str(tmp), "--text", str(tiny_text(tmp / "text.txt.gz")), "--steps", "2",
                         "--threads", "1", "--figure", str(tmp / "share.png"),
                         *[a for s in sets for a in ("--set", s)]])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from atencion.train.config import load_config

    args.d_ff = load_config(args.config).model.get("d_ff", 512)
    report = {}
    for name in [n for n in runs(args.top_k, args.d_ff) if not (args.skip_dense and n == "dense")]:
        report[name] = measure(train_run(name, args))
        print(json.dumps({name: report[name]}), file=sys.stderr)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.figure:
        figure(Path(args.out), Path(args.figure), args.layer, args.top_k)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
