"""Scaling laws (Kaplan et al. 2020) on a CPU: decoders of eight sizes, from 12 thousand to 4.7
million non-embedding parameters (2.6 orders of magnitude), trained on the same characters for the
same number of tokens, their held-out loss fitted against size (L(N) = (N_c / N)^α_N, and the same
plus an irreducible L_∞) and against compute (the frontier), with the Chinchilla rule beside it.

    python -m benchmarks.scaling --out runs/scaling                      # 72 min at 1 thread, under load
    python -m benchmarks.scaling --fit runs/scaling/scaling.json \\
        --figure docs/figures/scaling.png --table docs/figures/scaling_fit.json
    python -m benchmarks.scaling --smoke                                 # a look

The text: Tiny Shakespeare and the English side of Multi30k's training set (../shared/data), in
characters, the last 10% of each held out (nanoGPT's split). Every model reads the same batches
(``--batch`` rows of ``--context`` characters, drawn from the seed) for ``--steps`` updates: a
fixed token budget, not training to convergence, so the larger models stop further from their
own converged loss (the fit with L_∞ takes that in; the docs say how). The learning rate follows
Kaplan et al.'s rule for their models (their eq. D.1: 0.003239 − 0.0001395 ln N), with 100 updates
of warm-up and a cosine decay to a tenth. Each checkpoint (log-spaced updates) records the
held-out loss on ``--eval-rows`` rows; the last one records every held-out row's loss, which
the fit's bootstrap resamples.

The run writes OUT/scaling.json after each size (a cut run keeps the sizes it finished, and
running it again with the same OUT goes on with the next); ``--fit`` reads it, fits
(viz/scaling.py), prints the table and draws the figure.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import time
from pathlib import Path

from benchmarks.common import DATA, SMOKE_HELP, smoke_dir, tiny_multi30k, tiny_text

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
TEXTS = (DATA / "tinyshakespeare" / "input.txt.gz", DATA / "multi30k" / "raw" / "train.en.gz")
# (layers, d_model, heads): non-embedding parameters from about 12 k to 4.7 M (12 · layers · d_model², plus
# biases and norms); d_ff = 4 d_model, 16 dimensions per head at the small end.
SIZES = ((1, 32, 2), (2, 32, 2), (2, 48, 3), (2, 64, 4), (3, 96, 4), (4, 128, 4), (4, 192, 6), (6, 256, 8))


def read_texts(paths) -> tuple[list[str], list[str]]:
    """Training and held-out lines: the last 10% of each text held out."""
    from atencion.data.text import split_tail

    train, valid = [], []
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
        head, tail = split_tail(lines, 0.1)
        train += head
        valid += tail
    return train, valid


def model_config(vocab_size: int, layers: int, d_model: int, heads: int, context: int):
    from atencion import ModelConfig

    return ModelConfig(vocab_size=vocab_size, arch="decoder", task="lm", n_layers=layers, d_model=d_model,
                       n_heads=heads, d_ff=4 * d_model, dropout=0.0, norm_first=True, positional="learned",
                       max_positions=context, scale_embedding=False)


WARMUP = 100   # updates of warm-up; the frontier's fit starts after them


def kaplan_lr(n: int) -> float:
    """Kaplan et al.'s learning rate for a model of n non-embedding parameters (their eq. D.1)."""
    return 0.003239 - 0.0001395 * math.log(n)


def checkpoints(steps: int) -> list[int]:
    """About 12 log-spaced updates from 10 to ``steps``, ``steps`` included."""
    return sorted({max(1, round(10 * (steps / 10) ** (i / 11))) for i in range(12)} | {steps})


def row_losses(model, rows) -> list[float]:
    """Each held-out row's mean next-character loss."""
    import torch
    import torch.nn.functional as F

    model.eval()
    losses = []
    with torch.no_grad():
        for chunk in rows.split(64):
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")
            losses += loss.mean(1).tolist()
    return losses


def train_size(size, train_ids, valid_rows, vocab_size: int, args) -> dict:
    import torch
    import torch.nn.functional as F

    from atencion import Transformer
    from atencion.viz.scaling import non_embedding_parameters, training_flops_per_token

    layers, d_model, heads = size
    torch.manual_seed(args.seed)
    model = Transformer(model_config(vocab_size, layers, d_model, heads, args.context))
    n = non_embedding_parameters(model)
    lr = kaplan_lr(n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / WARMUP, 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))))
    rng = random.Random(args.seed)            # the same batches for every size
    eval_rows = valid_rows[:: max(1, len(valid_rows) // args.eval_rows)][: args.eval_rows]
    marks, records, started = set(checkpoints(args.steps)), [], time.time()
    for step in range(1, args.steps + 1):
        starts = [rng.randrange(train_ids.numel() - args.context - 1) for _ in range(args.batch)]
        rows = torch.stack([train_ids[s:s + args.context + 1] for s in starts])
        model.train()
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step in marks:
            held_out = sum(row_losses(model, eval_rows)) / len(eval_rows)
            records.append({"step": step, "tokens": step * args.batch * args.context,
                            "train_loss": round(loss.item(), 4), "valid_loss": round(held_out, 5),
                            "minutes": round((time.time() - started) / 60, 2)})
            print(json.dumps({"size": list(size), **records[-1]}), file=sys.stderr, flush=True)
    final = row_losses(model, valid_rows)
    return {"layers": layers, "d_model": d_model, "heads": heads, "non_embedding": n,
            "parameters": model.num_parameters(), "lr": round(lr, 6),
            "flops_per_token": training_flops_per_token(n, layers, args.context, d_model),
            "minutes": round((time.time() - started) / 60, 2),
            "checkpoints": records, "valid_loss": sum(final) / len(final), "row_losses": [round(x, 5) for x in final]}


def run(args) -> dict:
    import torch

    from atencion.data.tokenizer import Tokenizer
    from atencion.tasks.lm import text_stream

    torch.set_num_threads(args.threads)
    train_lines, valid_lines = read_texts(args.texts or TEXTS)
    tokenizer = Tokenizer.train_text(train_lines, kind="char")
    train_ids = torch.tensor(text_stream(train_lines, tokenizer), dtype=torch.long)
    valid_ids = torch.tensor(text_stream(valid_lines, tokenizer), dtype=torch.long)
    width = args.context + 1
    valid_rows = valid_ids[: valid_ids.numel() // width * width].view(-1, width)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scaling.json"
    settings = {key: getattr(args, key) for key in ("steps", "batch", "context", "eval_rows", "seed", "threads")}
    report = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if report and report["settings"] != settings:
        sys.exit(f"{path}: made with other settings ({report['settings']}); give another --out")
    report = report or {"settings": settings, "vocab_size": tokenizer.vocab_size,
                        "train_tokens": train_ids.numel(), "valid_tokens": valid_rows.numel(),
                        "valid_rows": len(valid_rows), "models": []}
    done = {(m["layers"], m["d_model"], m["heads"]) for m in report["models"]}
    for size in SIZES[: args.sizes]:
        if size in done:
            continue
        report["models"].append(train_size(size, train_ids, valid_rows, tokenizer.vocab_size, args))
        path.write_text(json.dumps(report) + "\n", encoding="utf-8")
        model = report["models"][-1]
        print(json.dumps({k: model[k] for k in ("layers", "d_model", "non_embedding", "valid_loss", "minutes")}))
    return report


def fit_run(args) -> None:
    from atencion.viz.scaling import fit_runs

    report = json.loads(Path(args.fit).read_text(encoding="utf-8"))
    table = fit_runs(report["models"], samples=args.samples, after_step=WARMUP)
    text = json.dumps(table, indent=1) + "\n"
    if args.table:
        Path(args.table).write_text(text, encoding="utf-8")
    if args.figure:
        figure(report, table, Path(args.figure))
    for name in ("power_law", "with_floor"):
        fit = table[name]
        print(json.dumps({"fit": name, "alpha": fit["alpha"], **fit["alpha_bootstrap"], "floor": fit["floor"],
                          "error_largest_left_out": fit["error_largest_left_out"],
                          "max_error_one_left_out": max(fit["error_each_left_out"])}))
    print(json.dumps({"fit": "frontier", "alpha_C": table["frontier"]["alpha"],
                      "points": len(table["frontier"]["points"])}))


def figure(report: dict, table: dict, path: Path) -> None:
    """Three panels: held-out loss against N with both fits; every model's loss against compute
    with the frontier and its fit; the frontier's model size against compute beside Chinchilla's."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    from atencion.viz.scaling import PowerLaw, chinchilla_parameters

    models = sorted(report["models"], key=lambda m: m["non_embedding"])
    n = np.array([m["non_embedding"] for m in models], dtype=float)
    fig = Figure(figsize=(14, 4.6))
    ax_n, ax_c, ax_o = fig.subplots(1, 3)
    ax_n.scatter(n, [m["valid_loss"] for m in models], color="black", zorder=3, label="held-out loss")
    grid = np.geomspace(n.min() / 1.5, n.max() * 1.5, 100)
    for name, style, label in (("power_law", "--", "(N_c/N)^α"), ("with_floor", "-", "L_∞ + (N_c/N)^α")):
        fit = table[name]
        low, high = fit["alpha_bootstrap"]["low"], fit["alpha_bootstrap"]["high"]
        floor = f", L_∞ = {fit['floor']:.2f}" if fit["floor"] else ""
        ax_n.plot(grid, PowerLaw(fit["scale"], fit["alpha"], fit["floor"])(grid), style,
                  label=f"{label}: α = {fit['alpha']:.3f} [{low:.3f}, {high:.3f}]{floor}")
    ax_n.set(xscale="log", yscale="log", xlabel="non-embedding parameters N", ylabel="held-out loss (nats/char)",
             title="loss against size, after the same tokens")
    ax_n.legend(fontsize=7)
    for m in models:
        c = [m["flops_per_token"] * r["tokens"] for r in m["checkpoints"]]
        ax_c.plot(c, [r["valid_loss"] for r in m["checkpoints"]], linewidth=1, label=f"N = {m['non_embedding']:,}")
    front = table["frontier"]
    fc = np.array([p["compute"] for p in front["points"]])
    fitted = np.array([p["compute"] for p in front["points"] if p["fitted"]])
    ax_c.plot(fc, [p["valid_loss"] for p in front["points"]], "k.", markersize=5)
    cgrid = np.geomspace(fitted.min(), fitted.max(), 100)
    ax_c.plot(cgrid, PowerLaw(front["scale"], front["alpha"])(cgrid), "k--",
              label=f"frontier after update {front['after_step']}: α_C = {front['alpha']:.3f}")
    cgrid = np.geomspace(fc.min(), fc.max(), 100)
    ax_c.set(xscale="log", yscale="log", xlabel="training compute C (FLOP)", ylabel="held-out loss",
             title="loss against compute, every size")
    ax_c.legend(fontsize=6)
    ax_o.plot(fc, [p["non_embedding"] for p in front["points"]], "k.-", label="size on the frontier (these runs)")
    ax_o.plot(cgrid, [chinchilla_parameters(c) for c in cgrid], "--", color="firebrick",
              label="Chinchilla: D = 20 N, C = 6 N D")
    ax_o.set(xscale="log", yscale="log", xlabel="training compute C (FLOP)", ylabel="non-embedding parameters",
             title="the compute-optimal size")
    ax_o.legend(fontsize=7)
    for ax in (ax_n, ax_c, ax_o):
        ax.grid(alpha=0.3, which="both")
    for ax in (ax_n, ax_c):   # losses as plain numbers, not powers of ten
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
    s = report["settings"]
    fig.suptitle(f"decoders on Tiny Shakespeare + Multi30k English, characters; {s['steps']} updates of "
                 f"{s['batch']} × {s['context']} characters each ({s['steps'] * s['batch'] * s['context']:,} tokens, "
                 f"{s['steps'] * s['batch'] * s['context'] / report['train_tokens']:.1f} epochs)", fontsize=9)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/scaling", help="OUT/scaling.json holds the run (default runs/scaling)")
    parser.add_argument("--steps", type=int, default=1200, help="updates per size (default 1,200)")
    parser.add_argument("--batch", type=int, default=32, help="rows per update (default 32)")
    parser.add_argument("--context", type=int, default=128, help="characters per row (default 128)")
    parser.add_argument("--eval-rows", type=int, default=256, help="held-out rows at each checkpoint (default 256)")
    parser.add_argument("--sizes", type=int, default=len(SIZES), help=f"the first K sizes only (default {len(SIZES)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--fit", metavar="JSON", help="fit a run's scaling.json instead of training")
    parser.add_argument("--samples", type=int, default=1000, help="with --fit: bootstrap resamplings (default 1,000)")
    parser.add_argument("--figure", help="with --fit: draw the fits to this PNG")
    parser.add_argument("--table", help="with --fit: write the fits to this JSON")
    parser.add_argument("--texts", nargs="+", help="gzipped texts to train on (default: Tiny Shakespeare and "
                        "Multi30k's English under ../shared/data)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here the four smallest sizes, then "
                        "the fit")
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("scaling") as tmp:
            texts = [str(tiny_text(tmp / "text.txt.gz")),
                     str(tiny_multi30k(tmp / "multi30k") / "raw" / "train.en.gz")]
            main(["--out", str(tmp), "--steps", "110", "--sizes", "4", "--batch", "2", "--context", "16",
                  "--eval-rows", "4", "--threads", "1", "--texts", *texts])
            return main(["--fit", str(tmp / "scaling.json"), "--samples", "20", "--figure", str(tmp / "scaling.png"),
                         "--table", str(tmp / "fit.json")])
    if args.fit:
        fit_run(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
