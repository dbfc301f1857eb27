"""Attention at length on Long Range Arena's ListOps (Tay et al. 2021, Table 1's ListOps column):
the encoder of configs/listops_full.yaml trained with each kind of attention for the same number
of updates, its test accuracy printed beside the accuracy LRA published for that kind.

    python -m benchmarks.listops --steps 300 --full-seeds 1,2,3      # every kind, LRA's data
    python -m benchmarks.listops --kinds full,window --seeds 1,2,3   # some kinds, three seeds each
    python -m benchmarks.listops --warmup-steps 0 --steps 2000       # whole examples only (the plateau)
    python -m benchmarks.listops --out runs/listops-look --train 200 --valid 20 --test 20 --steps 5 \
        --warmup-steps 5 --kinds full

Steps (a finished step is reused when the command is run again; an interrupted run resumes):
1. OUT/data: train.tsv, valid.tsv, test.tsv written by atencion.data.listops (LRA's recipe and
   its 96,000 / 2,000 / 2,000 examples, or --train/--valid/--test), made when missing, and
   OUT/data/prefixL: train.tsv and valid.tsv with each example cut to its first L symbols.
2. OUT/KIND-warmWxL-seedS: configs/listops_KIND.yaml trained for W updates (--warmup-steps) from
   train.seed S on OUT/data/prefixL. Whole examples of 500-2,000 symbols alone hold every kind at
   the majority label for thousands of updates (docs/results.md); the prefixes teach it in a few
   hundred to read the outermost operator, and step 3 goes on from there (staged training, short
   inputs before long ones: Press et al. 2021, Shortformer).
3. OUT/KIND-stepsN-warmWxL-seedS: the same config trained for N updates (train.max_steps) on
   OUT/data from step 2's best model (train.init_from), at the config's learning rate or --lr-peak X
   (then OUT/KIND-stepsN-lrX-warmWxL-seedS); its best model is the one of the best
   validation accuracy. (With --warmup-steps 0: OUT/KIND-stepsN-seedS, from scratch.)
4. That model scored on OUT/data/test.tsv as `atencion evaluate --tsv` scores it (kept in the
   run's test.json).
Prints a table (accuracy per kind, the median over the seeds and each seed's; LRA's number; the
training minutes of both stages), each run's validation accuracy against updates, the share of
the test set's most frequent label (what always answering it scores) and what the outermost
operator alone scores (the training set's most frequent label for it: 35% on LRA's data, about
LRA's Transformer row), and writes OUT/listops.json. A kind whose config cannot be read
(model.attention unknown to this version) is reported with the reason, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import ROOT, SMOKE_HELP, TINY_MODEL, finished, read_log, smoke_dir

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
KINDS = ("full", "flash", "window", "longformer", "bigbird", "linformer", "performer")
# LRA's Table 1, ListOps column (accuracy, %): the row of the same attention. Flash attention is exact
# attention computed in tiles, the Transformer's row; LRA's "Local Attention" is a window.
LRA = {"full": ("Transformer", 36.37), "flash": ("Transformer", 36.37), "window": ("Local Attention", 15.82),
       "longformer": ("Longformer", 35.63), "bigbird": ("BigBird", 36.05), "linformer": ("Linformer", 35.70),
       "performer": ("Performer", 18.01)}
LRA_BEST = ("Reformer", 37.27)


def prepare(data: Path, sizes: dict[str, int], seed: int, prefixes: int | None) -> Path:
    """``data`` with its splits (and its examples cut to their first ``prefixes`` symbols), made when missing."""
    from atencion.data.listops import PREFIX_SPLITS, write_listops, write_prefixes

    if not all((data / f"{split}.tsv").is_file() for split in sizes):
        write_listops(data, sizes, seed, force=True)
    if prefixes and not all((data / f"prefix{prefixes}" / f"{split}.tsv").is_file() for split in PREFIX_SPLITS):
        write_prefixes(data, prefixes, force=True)
    return data


def train_runs(kind: str, seed: int, data: Path, args) -> list[Path]:
    """The finished runs of ``kind`` from ``seed``, each trained now unless it is there already:
    one, or with ``--warmup-steps`` W two: W updates on the examples cut to their first
    ``--warmup-length`` symbols, then the whole examples from that model (``train.init_from``)."""
    if not args.warmup_steps:
        return [_train(kind, seed, data, args.steps, Path(args.out) / f"{kind}-steps{args.steps}-seed{seed}",
                       args, [])]
    warm = f"warm{args.warmup_steps}x{args.warmup_length}"
    start = _train(kind, seed, data / f"prefix{args.warmup_length}", args.warmup_steps,
                   Path(args.out) / f"{kind}-{warm}-seed{seed}", args, [])
    lr = [f"train.lr_peak={args.lr_peak}"] if args.lr_peak else []
    name = f"{kind}-steps{args.steps}" + (f"-lr{args.lr_peak:g}" if args.lr_peak else "") + f"-{warm}-seed{seed}"
    return [start, _train(kind, seed, data, args.steps, Path(args.out) / name, args,
                          [f"train.init_from={start / 'best'}", *lr])]


def _train(kind: str, seed: int, data: Path, steps: int, run: Path, args, sets: list[str]) -> Path:
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    if finished(run):
        return run
    sets = [f"data.train_tsv={data / 'train.tsv'}", f"data.valid_tsv={data / 'valid.tsv'}",
            f"train.max_steps={steps}", f"train.seed={seed}", f"train.threads={args.threads}",
            "train.progress=false", f"train.valid_every={args.valid_every or max(1, steps // 4)}",
            f"train.log_every={max(1, steps // 40)}", *sets, *args.set]
    cfg = load_config(ROOT / "configs" / f"listops_{kind}.yaml", sets)
    train(cfg, run, resume=(run / "checkpoints").is_dir())
    return run


def score_test(runs: list[Path], data: Path) -> dict:
    """The last run's best model on test.tsv, scored by what `atencion evaluate --tsv` calls; the
    minutes and updates of every run that led to it."""
    import torch

    from atencion.tasks.classify import evaluate_classifier_dir

    kept = runs[-1] / "test.json"  # a run scored once: the table printed again reads it
    if kept.is_file():
        return json.loads(kept.read_text(encoding="utf-8"))
    summaries = [[r["summary"] for r in read_log(run) if "summary" in r][-1] for run in runs]
    summary = summaries[-1]
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scores = evaluate_classifier_dir(summary["best_model"], {"tsv": str(data / "test.tsv"), "device": device,
                                                             "max_input_tokens": 2048, "batch_tokens": 8192})
    result = {"accuracy": round(100 * scores["accuracy"], 2), "best_step": summary["best_step"],
              "steps": summary["steps"], "warmup_steps": sum(s["steps"] for s in summaries[:-1]),
              "minutes": round(sum(s["seconds"] for s in summaries) / 60, 1),
              "test_minutes": round((time.perf_counter() - start) / 60, 1)}
    kept.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return result


def seed_result(runs: list[Path], data: Path, seed: int) -> dict:
    """``score_test`` of the runs, with the seed and each run's validation accuracy (%) at each
    validated update: the warm-up's on the prefixes, then the whole examples'."""
    curves = [{r["step"]: round(100 * r["valid_accuracy"], 1) for r in read_log(run) if "valid_accuracy" in r}
              for run in runs]
    return {**score_test(runs, data), "seed": seed, "valid_curve": curves[-1],
            "warmup_curve": curves[0] if len(curves) > 1 else {}}


def majority_share(test: Path) -> float:
    labels = [line.split("\t", 1)[0] for line in test.read_text(encoding="utf-8").splitlines()]
    return round(100 * max(labels.count(label) for label in set(labels)) / len(labels), 2)


def first_operator_share(train: Path, test: Path) -> float:
    """Test accuracy (%) of answering, for each expression, the label most frequent in training among the
    expressions with the same outermost operator: what the first symbol alone tells. A model below it has
    not learnt to read even that."""
    def rows(path: Path):
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                label, text = line.rstrip("\n").split("\t", 1)
                yield text.split(" ", 1)[0], label

    counts: dict[str, Counter] = {}
    for operator, label in rows(train):
        counts.setdefault(operator, Counter())[label] += 1
    overall = sum(counts.values(), Counter()).most_common(1)[0][0]
    answers = {operator: c.most_common(1)[0][0] for operator, c in counts.items()}
    scored = [answers.get(operator, overall) == label for operator, label in rows(test)]
    return round(100 * sum(scored) / len(scored), 2)


def table(report: dict) -> str:
    lines = ["| attention | test accuracy (%) | LRA (%), its row | training minutes | updates |",
             "|---|---|---|---|---|"]
    for kind, result in report["kinds"].items():
        row, published = LRA[kind]
        if "error" in result:
            reason = result["error"].split(";")[0]  # the first clause: the whole message is in the JSON
            lines.append(f"| {kind} | not run: {reason} | {published:.2f}, {row} | | |")
            continue
        runs = result["runs"]
        each = ", ".join(f"{r['accuracy']:.2f}" for r in runs)
        accuracy = f"{result['accuracy']:.2f}" + (f" ({each})" if len(runs) > 1 else "")
        minutes = ", ".join(f"{r['minutes']:.1f}" for r in runs)
        warmup = runs[0]["warmup_steps"]
        updates = (f"{warmup} on prefixes + " if warmup else "") + str(runs[0]["steps"])
        updates += f" at lr_peak {report['lr_peak']:g}" if report.get("lr_peak") else ""
        lines.append(f"| {kind} | {accuracy} | {published:.2f}, {row} | {minutes} | {updates} |")
    lines += ["", "Validation accuracy (%) against updates, each run (the warm-up's on the prefixes' validation set):",
              "", "| attention, seed | warm-up | whole examples |", "|---|---|---|"]
    for kind, result in report["kinds"].items():
        for run in result.get("runs", []):
            warmup, whole = (", ".join(f"{step}: {acc}" for step, acc in run[curve].items())
                             for curve in ("warmup_curve", "valid_curve"))
            lines.append(f"| {kind}, {run['seed']} | {warmup} | {whole} |")
    lines.append(f"\nThe test set's most frequent label: {report['majority_share']:.2f}% (always answering it); "
                 f"the training set's most frequent label for the outermost operator: "
                 f"{report['first_operator_share']:.2f}% (the first symbol alone). "
                 f"LRA's best ListOps row: {LRA_BEST[0]} {LRA_BEST[1]:.2f}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/listops", help="data and one run directory per kind and seed")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated (default: all: {','.join(KINDS)})")
    parser.add_argument("--steps", type=int, default=2000, help="updates per run, the budget (default: 2000)")
    parser.add_argument("--seeds", default="1", help="comma-separated train.seed values, one run each (default: 1)")
    parser.add_argument("--full-seeds", help="full attention's seeds, if others than --seeds (LRA's Transformer row "
                        "is the one the issue asks a median of: 1,2,3)")
    parser.add_argument("--warmup-steps", type=int, default=400, help="updates on the examples cut to their first "
                        "--warmup-length symbols before the whole examples, from that model (0: none; default: 400)")
    parser.add_argument("--warmup-length", type=int, default=32, help="symbols kept in the warm-up (default: 32)")
    parser.add_argument("--lr-peak", type=float, help="train.lr_peak of the whole examples' stage, after the "
                        "warm-up (default: the config's, 1e-3); named in its run directory: KIND-stepsN-lrX-warm...")
    parser.add_argument("--valid-every", type=int, default=0, help="updates between validations (default: steps/4)")
    parser.add_argument("--train", type=int, default=96_000, help="training examples if the data is made")
    parser.add_argument("--valid", type=int, default=2_000)
    parser.add_argument("--test", type=int, default=2_000)
    parser.add_argument("--data-seed", type=int, default=0, help="the generator's seed (default: 0)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every run, as atencion train --set")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("listops") as tmp:
            return main(["--out", str(tmp), "--train", "40", "--valid", "8", "--test", "8", "--steps", "2",
                         "--warmup-steps", "2", "--kinds", "full", "--threads", "1",
                         *[a for s in TINY_MODEL for a in ("--set", s)]])
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: expected some of {','.join(KINDS)}, got {args.kinds!r}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    full_seeds = [int(s) for s in (args.full_seeds or args.seeds).split(",") if s]
    if args.warmup_steps < 0 or args.warmup_length < 1:
        parser.error("--warmup-steps must be >= 0 and --warmup-length >= 1")
    if args.lr_peak is not None and (args.lr_peak <= 0 or not args.warmup_steps):
        parser.error("--lr-peak: expected a learning rate > 0 for the stage after a warm-up (--warmup-steps > 0); "
                     "without one, use --set train.lr_peak=X")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from atencion.errors import AtencionError

    data = prepare(Path(args.out) / "data", {"train": args.train, "valid": args.valid, "test": args.test},
                   args.data_seed, args.warmup_length if args.warmup_steps else None)
    report = {"steps": args.steps, "lr_peak": args.lr_peak,
              "warmup": {"steps": args.warmup_steps, "length": args.warmup_length},
              "seeds": seeds, "full_seeds": full_seeds, "data": str(data), "majority_share": majority_share(
        data / "test.tsv"), "first_operator_share": first_operator_share(data / "train.tsv", data / "test.tsv"),
        "lra": {kind: LRA[kind][1] for kind in kinds}, "kinds": {}}
    for kind in kinds:
        try:
            runs = [seed_result(train_runs(kind, seed, data, args), data, seed)
                    for seed in (full_seeds if kind == "full" else seeds)]
        except AtencionError as err:
            report["kinds"][kind] = {"error": str(err)}
            print(f"listops {kind}: {err}", file=sys.stderr)
            continue
        report["kinds"][kind] = {"accuracy": round(statistics.median(r["accuracy"] for r in runs), 2), "runs": runs}
        print(json.dumps({kind: report["kinds"][kind]}), file=sys.stderr)
    (Path(args.out) / "listops.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(table(report))
    return report


if __name__ == "__main__":
    main()
