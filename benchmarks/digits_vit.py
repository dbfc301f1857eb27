"""A ViT on scikit-learn's handwritten digits (configs/digits_vit.yaml), its test accuracy beside
scikit-learn's SVM (its own example, ``svm.SVC(gamma=0.001)``) and a logistic regression on the same
split, and its training throughput against Hugging Face's ViTForImageClassification of the same
shape, measured in the same run.

    python -m benchmarks.digits_vit                         # data, one ViT (seed 1), baselines, speed
    python -m benchmarks.digits_vit --seeds 1,2             # two ViTs: the median and the range
    python -m benchmarks.digits_vit --model runs/digits/vit-seed1/best   # a trained model: no training

Steps (a finished step is reused when the command is run again):
1. OUT/data: the digits as files (python -m atencion.data.digits): train on images 0-807, choose
   the checkpoint on 808-897 (the last 10% of the first half), test on 898-1796 (the second half).
2. OUT/vit-seedS: configs/digits_vit.yaml trained from train.seed S (its updates and minutes are
   in the table); its best model (by validation accuracy) scored on test.tsv as `atencion
   evaluate --tsv` scores it, and as `--tta-shift 1` scores it (the mean over the 9 shifts).
3. scikit-learn on the same pixels (0-16, as its example reads them): SVC(gamma=0.001) and
   LogisticRegression trained on the whole first half (898 images, scikit-learn's example) and on
   the ViT's 808 training images, scored on the test half.
4. Throughput: training images per second (forward, cross-entropy, backward, AdamW step) of the
   ViT of the config (with plain patches: Hugging Face has no shifted ones) and of a
   ViTForImageClassification holding the same weights, on the same
   random batches; the two take turns, one batch each, in the other order every round, and the
   ratio is the median of the rounds' ratios (with its range).
Prints a table and writes OUT/digits_vit.json. Use --threads 1 for the figures of a one-thread machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, SMOKE_HELP, finished, read_log, smoke_dir

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)


def prepare(data: Path) -> Path:
    from atencion.data.digits import write_digits

    if not all((data / f"{split}.tsv").is_file() for split in ("train", "valid", "test")):
        write_digits(data, force=True)
    return data


def train_run(seed: int, data: Path, args) -> Path:
    """The finished run from ``seed``: trained now unless it is there already."""
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    run = Path(args.out) / f"vit-seed{seed}"
    if finished(run):
        return run
    sets = [f"data.train_tsv={data / 'train.tsv'}", f"data.valid_tsv={data / 'valid.tsv'}", f"train.seed={seed}",
            f"train.threads={args.threads}", "train.progress=false", *args.set]
    train(load_config(args.config, sets), run, resume=(run / "checkpoints").is_dir())
    return run


def score_test(model: str, data: Path, tta_shift: int) -> dict:
    """The model's test accuracy, scored by what `atencion evaluate --tsv` calls: the images as
    they are, and averaged over their shifts by up to ``tta_shift`` pixels (`--tta-shift`)."""
    from atencion.tasks.classify import evaluate_classifier_dir

    scores = evaluate_classifier_dir(model, {"tsv": str(data / "test.tsv")})
    shifted = evaluate_classifier_dir(model, {"tsv": str(data / "test.tsv"), "tta_shift": tta_shift})
    return {"accuracy": scores["accuracy"], "accuracy_tta": shifted["accuracy"], "images": scores["examples"]}


def baselines() -> dict:
    """scikit-learn's SVC(gamma=0.001) and a logistic regression on the pixels 0-16, trained on
    the first half and on the ViT's training part of it, scored on the second half."""
    from sklearn import svm
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    from atencion.data.digits import digits_split

    digits = load_digits()
    x, y = digits.images.reshape(len(digits.images), -1), digits.target
    split = digits_split()
    test = list(split["test"])
    out = {}
    for part, rows in (("first half (898)", range(0, split["valid"].stop)), ("ViT's train (808)", split["train"])):
        rows = list(rows)
        for name, make in (("SVC(gamma=0.001)", lambda: svm.SVC(gamma=0.001)),
                           ("LogisticRegression", lambda: LogisticRegression(max_iter=10_000))):
            model = make().fit(x[rows], y[rows])
            out[f"{name}, {part}"] = float((model.predict(x[test]) == y[test]).mean())
    return out


def throughput(model_dir: str, batch: int, rounds: int, steps: int) -> dict:
    """Training images/s of the ViT in ``model_dir`` (its shape, fresh weights) and of Hugging
    Face's ViTForImageClassification holding the same weights; turns alternate (module docstring)."""
    import torch
    import torch.nn.functional as F

    from atencion.interop.vit import to_vit
    from atencion.nn.model_dir import build_model, load_config

    torch.manual_seed(0)
    cfg = load_config(model_dir)
    cfg.inputs = {**cfg.inputs, "shifted": False}  # ViTForImageClassification has no shifted patches: plain ones
    ours = build_model(cfg).train()
    theirs = to_vit(ours).train()
    size = (batch, cfg.inputs["channels"], *cfg.inputs["size"])
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(size, generator=g), torch.randint(cfg.num_labels, (batch,), generator=g))
               for _ in range(steps)]
    engines = {"atencion": (ours, lambda x: ours.classify(x)), "hf": (theirs, lambda x: theirs(pixel_values=x).logits)}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, (model, _) in engines.items()}

    def run(name: str) -> float:
        _, logits = engines[name]
        start = time.perf_counter()
        for x, y in batches:
            F.cross_entropy(logits(x), y).backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for name in engines:
        run(name)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            seconds[name].append(run(name))
    ratios = [h / a for a, h in zip(seconds["atencion"], seconds["hf"])]
    images = batch * steps
    return {"batch": batch, "steps_per_round": steps, "rounds": rounds,
            "atencion_images_s": round(images / statistics.median(seconds["atencion"])),
            "hf_images_s": round(images / statistics.median(seconds["hf"])),
            "ratio": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/digits", help="data and runs go here (default: runs/digits)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "digits_vit.yaml"))
    parser.add_argument("--seeds", default="1", help="comma-separated train.seed values, one ViT each (default: 1)")
    parser.add_argument("--model", help="a trained ViT directory to score instead of training")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--tta-shift", type=int, default=1,
                        help="also score with `evaluate --tta-shift N`, the test images averaged over their shifts of "
                             "up to N pixels (default: 1, chosen by cross-validation on the first half)")
    parser.add_argument("--batch", type=int, default=64, help="throughput: images per batch (default: 64)")
    parser.add_argument("--rounds", type=int, default=7, help="throughput: rounds per engine (default: 7)")
    parser.add_argument("--steps", type=int, default=10, help="throughput: updates per round (default: 10)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        sets = ["model.n_layers=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2", "train.max_steps=2",
                "train.valid_every=2"]
        with smoke_dir("digits_vit") as tmp:
            return main(["--out", str(tmp), "--batch", "4", "--rounds", "1", "--steps", "1", "--threads", "1",
                         *[a for s in sets for a in ("--set", s)]])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch

    torch.set_num_threads(args.threads)
    data = prepare(Path(args.out) / "data")
    report: dict = {"threads": args.threads, "vit": {}}
    if args.model:
        models = {"--model": args.model}
    else:
        models = {}
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            run = train_run(seed, data, args)
            summary = [r["summary"] for r in read_log(run) if "summary" in r][-1]
            models[f"seed {seed}"] = summary["best_model"]
            report["vit"][f"seed {seed}"] = {"updates": summary["steps"], "best_step": summary["best_step"],
                                             "minutes": round(summary["seconds"] / 60, 2)}
    for name, model in models.items():
        report["vit"].setdefault(name, {}).update(model=model, **score_test(model, data, args.tta_shift))
    report["tta_shift"] = args.tta_shift
    for key in ("accuracy", "accuracy_tta"):
        accuracies = [v[key] for v in report["vit"].values()]
        report[f"vit_{key}"] = {"median": statistics.median(accuracies), "min": min(accuracies),
                                "max": max(accuracies), "runs": len(accuracies)}
    report["baselines"] = baselines()
    report["throughput"] = throughput(next(iter(models.values())), args.batch, args.rounds, args.steps)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "digits_vit.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_table(report)
    return report


def print_table(report: dict) -> None:
    shifts = f"--tta-shift {report['tta_shift']}"
    print(f"{'model (test: images 898-1796 of load_digits)':<52}{'accuracy':>9}{shifts:>16}")
    for name, run in report["vit"].items():
        detail = f" ({run['updates']} updates, {run['minutes']} min)" if "updates" in run else ""
        print(f"{'ViT, ' + name + detail:<52}{100 * run['accuracy']:>8.2f}%{100 * run['accuracy_tta']:>15.2f}%")
    a, t = report["vit_accuracy"], report["vit_accuracy_tta"]
    if a["runs"] > 1:
        label = f"ViT, median of {a['runs']} runs"
        print(f"{label:<52}{100 * a['median']:>8.2f}%{100 * t['median']:>15.2f}%  "
              f"(ranges {100 * a['min']:.2f}-{100 * a['max']:.2f}, {100 * t['min']:.2f}-{100 * t['max']:.2f})")
    for name, accuracy in report["baselines"].items():
        print(f"{name:<52}{100 * accuracy:>8.2f}%")
    t = report["throughput"]
    print(f"training images/s ({report['threads']} thread(s), batch {t['batch']}): atencion {t['atencion_images_s']}, "
          f"Hugging Face ViT {t['hf_images_s']}; ratio {t['ratio']} (median of {t['rounds']} rounds, range "
          f"{t['ratio_min']}-{t['ratio_max']})")


if __name__ == "__main__":
    main()
