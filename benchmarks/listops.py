"""Attention at length on Long Range Arena's ListOps (Tay et al. 2021, Table 1's ListOps column):
the encoder of configs/listops_full.yaml trained with each kind of attention for the same number
of updates, its test accuracy printed beside the accuracy LRA published for that kind.

    python benchmarks/listops.py --steps 2000                        # every kind, LRA's data
    python benchmarks/listops.py --kinds full,window --seeds 1,2,3   # some kinds, three seeds each
    python benchmarks/listops.py --out runs/listops-look --train 200 --valid 20 --test 20 --steps 5 --kinds full

Steps (a finished step is reused when the command is run again; an interrupted run resumes):
1. OUT/data: train.tsv, valid.tsv, test.tsv written by atencion.data.listops (LRA's recipe and
   its 96,000 / 2,000 / 2,000 examples, or --train/--valid/--test), made when missing.
2. OUT/KIND-stepsN-seedS: configs/listops_KIND.yaml trained for N updates (train.max_steps) from
   train.seed S, on OUT/data; its best model is the one of the best validation accuracy.
3. That model scored on OUT/data/test.tsv as `atencion evaluate --tsv` scores it.
Prints a table (accuracy per kind, the median over the seeds and each seed's; LRA's number; the
training minutes), the share of the test set's most frequent label (what always answering it
scores) and what the outermost operator alone scores (the training set's most frequent label for
it: 35% on LRA's data, about LRA's Transformer row), and writes
OUT/listops.json. A kind whose config cannot be read (model.attention unknown to this version)
is reported with the reason, and the others still run.
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

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("full", "flash", "window", "longformer", "bigbird", "linformer", "performer")
# LRA's Table 1, ListOps column (accuracy, %): the row of the same attention. Flash attention is exact
# attention computed in tiles, the Transformer's row; LRA's "Local Attention" is a window.
LRA = {"full": ("Transformer", 36.37), "flash": ("Transformer", 36.37), "window": ("Local Attention", 15.82),
       "longformer": ("Longformer", 35.63), "bigbird": ("BigBird", 36.05), "linformer": ("Linformer", 35.70),
       "performer": ("Performer", 18.01)}
LRA_BEST = ("Reformer", 37.27)


def prepare(data: Path, sizes: dict[str, int], seed: int) -> Path:
    from atencion.data.listops import write_listops

    if not all((data / f"{split}.tsv").is_file() for split in sizes):
        write_listops(data, sizes, seed, force=True)
    return data


def read_log(run: Path) -> list[dict]:
    path = run / "log.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def train_run(kind: str, seed: int, data: Path, args) -> Path:
    """The finished run of ``kind`` from ``seed``: trained now unless it is there already."""
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    run = Path(args.out) / f"{kind}-steps{args.steps}-seed{seed}"
    if any("summary" in r for r in read_log(run)):
        return run
    sets = [f"data.train_tsv={data / 'train.tsv'}", f"data.valid_tsv={data / 'valid.tsv'}",
            f"train.max_steps={args.steps}", f"train.seed={seed}", f"train.threads={args.threads}",
            "train.progress=false", f"train.valid_every={args.valid_every or max(1, args.steps // 4)}",
            f"train.log_every={max(1, args.steps // 40)}", *args.set]
    cfg = load_config(ROOT / "configs" / f"listops_{kind}.yaml", sets)
    train(cfg, run, resume=(run / "checkpoints").is_dir())
    return run


def score_test(run: Path, data: Path) -> dict:
    """The run's best model on test.tsv, scored by what `atencion evaluate --tsv` calls."""
    import torch

    from atencion.tasks.classify import evaluate_classifier_dir

    summary = [r["summary"] for r in read_log(run) if "summary" in r][-1]
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scores = evaluate_classifier_dir(summary["best_model"], {"tsv": str(data / "test.tsv"), "device": device,
                                                             "max_input_tokens": 2048, "batch_tokens": 8192})
    return {"accuracy": round(100 * scores["accuracy"], 2), "best_step": summary["best_step"],
            "steps": summary["steps"], "minutes": round(summary["seconds"] / 60, 1),
            "test_minutes": round((time.perf_counter() - start) / 60, 1)}


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
        lines.append(f"| {kind} | {accuracy} | {published:.2f}, {row} | {minutes} | {runs[0]['steps']} |")
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
    parser.add_argument("--valid-every", type=int, default=0, help="updates between validations (default: steps/4)")
    parser.add_argument("--train", type=int, default=96_000, help="training examples if the data is made")
    parser.add_argument("--valid", type=int, default=2_000)
    parser.add_argument("--test", type=int, default=2_000)
    parser.add_argument("--data-seed", type=int, default=0, help="the generator's seed (default: 0)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every run, as atencion train --set")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: expected some of {','.join(KINDS)}, got {args.kinds!r}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from atencion.errors import AtencionError

    data = prepare(Path(args.out) / "data", {"train": args.train, "valid": args.valid, "test": args.test},
                   args.data_seed)
    report = {"steps": args.steps, "seeds": seeds, "data": str(data), "majority_share": majority_share(
        data / "test.tsv"), "first_operator_share": first_operator_share(data / "train.tsv", data / "test.tsv"),
        "lra": {kind: LRA[kind][1] for kind in kinds}, "kinds": {}}
    for kind in kinds:
        try:
            runs = [score_test(train_run(kind, seed, data, args), data) for seed in seeds]
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
