"""Learning curves of language-model runs: training and validation loss (nats per token) against
updates, one line pair per run, from each run's log.jsonl.

    python -m benchmarks.lm_curve --out docs/shakespeare_curve.png \
        "baby GPT=runs/shakespeare" "6 layers, block 128=runs/shakespeare-30min" --reference 1.47
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import SMOKE_HELP, smoke_dir, smoke_requested

KIND = "experiment"  # reports the quality of training runs (benchmarks/__init__.py lists the two groups)


def main(argv: list[str] | None = None) -> None:
    smoke = smoke_requested(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*" if smoke else "+", metavar="LABEL=RUN_DIR",
                        help="a label and a training run directory")
    parser.add_argument("--out", required=not smoke, help="the PNG to write")
    parser.add_argument("--reference", type=float, action="append", default=[],
                        help="a horizontal line at this loss (e.g. a published figure)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here the curves of a made-up log")
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("lm_curve") as tmp:
            (tmp / "run").mkdir()
            records = [{"step": s, "loss": 3.0 / s ** 0.3} for s in range(1, 21)] + \
                      [{"step": s, "valid_loss": 3.1 / s ** 0.3} for s in (5, 10, 20)]
            (tmp / "run" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            main([f"made-up={tmp / 'run'}", "--out", str(tmp / "curve.png"), "--reference", "1.47"])
            print(f"lm_curve: drew {len(records)} records, {(tmp / 'curve.png').stat().st_size} bytes of PNG")
        return

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for item in args.runs:
        label, _, run = item.rpartition("=")
        records = [json.loads(x) for x in (Path(run) / "log.jsonl").read_text().splitlines()]
        train = [(r["step"], r["loss"]) for r in records if "loss" in r and "step" in r]
        valid = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
        line, = ax.plot([s for s, _ in train], [v for _, v in train], alpha=0.45, linewidth=1,
                        label=f"{label or run}: training")
        ax.plot([s for s, _ in valid], [v for _, v in valid], marker="o", markersize=3, color=line.get_color(),
                label=f"{label or run}: validation")
    for value in args.reference:
        ax.axhline(value, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{value}", (ax.get_xlim()[1], value), ha="right", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("update")
    ax.set_ylabel("loss (nats per character)")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(args.out)


if __name__ == "__main__":
    main()
