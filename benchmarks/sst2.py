"""BERT by masking, then classification (result 3): a bert-tiny-shaped encoder pretrained by MLM
on plain English sentences, fine-tuned on SST-2, against the same encoder trained on SST-2 from
scratch; SST-2 dev accuracy of both, and the pretraining's masked accuracy against a guess from
unigram frequencies.

    python -m benchmarks.sst2 --out runs/sst2
    python -m benchmarks.sst2 --out runs/sst2 --mlm-steps 500 --set-classify train.max_epochs=1   # a quick look
    python -m benchmarks.sst2 --out runs/sst2 --seeds 1 2 3      # steps 3-5 with three seeds each

Steps (a finished step is reused when the command is run again):
1. OUT/data: pretrain.txt = the SST-2 training sentences (each distinct text once) and the English
   side of Multi30k's training set; train.tsv / valid.tsv = SST-2 train with 2,000 rows held out
   (they choose the checkpoint); dev.tsv = SST-2 dev (only reported: nothing is chosen on it).
2. OUT/mlm: configs/sst2_mlm.yaml.
3. OUT/finetuned: configs/sst2_classify.yaml with train.init_from = OUT/mlm/best.
4. OUT/scratch: configs/sst2_classify.yaml as it is.
5. OUT/lora: configs/sst2_lora.yaml with train.init_from = OUT/mlm/best: LoRA adapters and a new
   head trained, the pretrained encoder frozen (the LoRA paper's claim, against step 3).
With ``--seeds 1 2 3`` steps 3-5 run once per seed (train.seed; the pretraining and the data are
the same for all): OUT/finetuned, OUT/scratch, OUT/lora for seed 1 (the configs' seed) and
OUT/finetuned_seed2, ... for the others. They run step by step, each with every seed: 3, then 5,
then 4 (scratch does not use the pretraining), so the pair the LoRA claim compares comes first.
Prints one JSON object (also written to OUT/sst2.json): per classifier, each seed's dev accuracy
and the median and range over the seeds; for the fine-tuned ones their trainable parameters, the
size of Adam's state and of a model directory and of a checkpoint on disk.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import (
    DATA,
    ROOT,
    SMOKE_HELP,
    TINY_MODEL,
    finished,
    last_summary,
    smoke_dir,
    tiny_lines,
    tiny_multi30k,
    write_gz,
)

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)


def tiny_sst2(folder: Path) -> Path:
    """SST-2-shaped train.tsv.gz and dev.tsv.gz (a header, then label TAB sentence) of made-up sentences."""
    for name, n in (("train", 60), ("dev", 12)):
        lines = tiny_lines(n, seed=len(name))
        write_gz(folder / f"{name}.tsv.gz", ["label\tsentence"] + [f"{i % 2}\t{line}" for i, line in enumerate(lines)])
    return folder


def prepare(out: Path, held_out: int, seed: int, sources: Path = DATA) -> Path:
    data = out / "data"
    if (data / "dev.tsv").is_file():
        return data
    data.mkdir(parents=True, exist_ok=True)
    with gzip.open(sources / "sst2" / "train.tsv.gz", "rt", encoding="utf-8") as f:
        rows = f.read().splitlines()[1:]
    texts = list(dict.fromkeys(r.split("\t", 1)[1] for r in rows))
    with gzip.open(sources / "multi30k" / "raw" / "train.en.gz", "rt", encoding="utf-8") as f:
        english = f.read().splitlines()
    rng = random.Random(seed)
    rng.shuffle(rows)
    sentences = texts + english
    rng.shuffle(sentences)
    (data / "pretrain.txt").write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    (data / "train.tsv").write_text("".join(r + "\n" for r in rows[held_out:]), encoding="utf-8")
    (data / "valid.tsv").write_text("".join(r + "\n" for r in rows[:held_out]), encoding="utf-8")
    with gzip.open(sources / "sst2" / "dev.tsv.gz", "rt", encoding="utf-8") as f:
        (data / "dev.tsv").write_text(f.read(), encoding="utf-8")
    return data


def run(config: str, out: Path, sets: list[str], threads: int) -> Path:
    if finished(out):
        return out
    command = [sys.executable, "-m", "atencion", "train", config, "--out", str(out),
               *[f"--set={s}" for s in sets], f"--set=train.threads={threads}"]
    if (out / "checkpoints").is_dir():
        command.append("--resume")
    subprocess.run(command, check=True)
    return out


def summary(run_dir: Path) -> dict:
    return last_summary(run_dir)


def sizes(run_dir: Path) -> dict:
    """Trainable parameters (what Adam keeps moments for), Adam's state and the files on disk."""
    from safetensors.torch import load_file

    checkpoint = Path(summary(run_dir)["last_checkpoint"])
    moments = load_file(str(checkpoint / "optimizer.safetensors"))
    trainable = sum(t.numel() for name, t in moments.items() if name.endswith(".exp_avg"))

    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    return {"trainable_parameters": trainable,
            "optimizer_state_bytes": (checkpoint / "optimizer.safetensors").stat().st_size,
            "model_dir_bytes": size(run_dir / "best"), "checkpoint_bytes": size(checkpoint)}


def dev_accuracy(model_dir: Path, dev: Path) -> dict:
    from atencion.data.text import read_labelled
    from atencion.nn.model_dir import load_model_dir
    from atencion.tasks.classify import evaluate_classifier

    model, tokenizer = load_model_dir(model_dir)
    rows, _, _ = read_labelled(str(dev), model.cfg.labels)
    scores = evaluate_classifier(model, tokenizer, rows)
    return {"accuracy": round(scores["accuracy"], 4), "confusion": scores["confusion"], "sentences": len(rows)}


def masked_accuracy(mlm_dir: Path, config: str, data: Path) -> dict:
    """The pretrained model's masked accuracy on its held-out sentences (masked from a fixed
    seed), beside the accuracy of always guessing the most frequent token of the training text."""
    from atencion.data.text import read_text, split_tail
    from atencion.nn.model_dir import load_model_dir
    from atencion.tasks.mlm import evaluate_mlm
    from atencion.train.config import load_config

    cfg = load_config(config, [f"data.train_text={data / 'pretrain.txt'}"])
    model, tokenizer = load_model_dir(mlm_dir / "best")
    train_lines, valid_lines = split_tail(read_text(str(data / "pretrain.txt"), "pretrain"), cfg.data.valid_fraction)
    scores = evaluate_mlm(model, tokenizer, valid_lines, probability=cfg.data.mask_probability, count_from=train_lines)
    return {"masked_accuracy": round(scores["accuracy"], 4), "masked_loss": round(scores["loss"], 4),
            "masked_tokens": scores["masked"], "unigram_guess": scores["most_frequent_token"],
            "unigram_guess_accuracy": round(scores["most_frequent_token_accuracy"], 4)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/sst2")
    parser.add_argument("--mlm-config", default=str(ROOT / "configs" / "sst2_mlm.yaml"))
    parser.add_argument("--classify-config", default=str(ROOT / "configs" / "sst2_classify.yaml"))
    parser.add_argument("--lora-config", default=str(ROOT / "configs" / "sst2_lora.yaml"))
    parser.add_argument("--mlm-steps", type=int, default=0, help="pretraining updates (0: the config's)")
    parser.add_argument("--held-out", type=int, default=2000, help="SST-2 training rows held out to choose "
                        "checkpoints (default: 2000)")
    parser.add_argument("--seed", type=int, default=1, help="the seed of the data's shuffle and held-out rows")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="train.seed of steps 3-5, each run once "
                        "per seed (default: 1, the configs')")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--set-mlm", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--set-classify", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--set-lora", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--data", default=str(DATA), help="where sst2/ and multi30k/raw/train.en.gz are (default: "
                        "../shared/data)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("sst2") as tmp:
            tiny_sst2(tmp / "data" / "sst2")
            tiny_multi30k(tmp / "data" / "multi30k")
            tiny = [*TINY_MODEL, "data.vocab_size=60", "train.max_tokens=256", "train.max_steps=2",
                    "train.valid_every=2"]
            return main(["--out", str(tmp / "sst2"), "--data", str(tmp / "data"), "--held-out", "10", "--threads", "1",
                         *[a for s in tiny for option in ("--set-mlm", "--set-classify") for a in (option, s)]])
    out = Path(args.out)
    data = prepare(out, args.held_out, args.seed, Path(args.data))
    mlm_sets = [f"data.train_text={data / 'pretrain.txt'}", *args.set_mlm]
    if args.mlm_steps:
        mlm_sets.append(f"train.max_steps={args.mlm_steps}")
    cls_sets = [f"data.train_tsv={data / 'train.tsv'}", f"data.valid_tsv={data / 'valid.tsv'}", *args.set_classify]
    mlm = run(args.mlm_config, out / "mlm", mlm_sets, args.threads)
    # The two the LoRA claim compares first, every seed of each; scratch, which does not use the
    # pretraining, last.
    steps = {"finetuned": (args.classify_config, [*cls_sets, f"train.init_from={mlm / 'best'}"]),
             "lora": (args.lora_config, [*cls_sets, f"train.init_from={mlm / 'best'}", *args.set_lora]),
             "scratch": (args.classify_config, cls_sets)}
    runs: dict[str, list[dict]] = {name: [] for name in steps}
    for name, (config, sets) in steps.items():
        for seed in args.seeds:
            run_dir = run(config, out / (name if seed == 1 else f"{name}_seed{seed}"),
                          [*sets, f"train.seed={seed}"], args.threads)
            s = summary(run_dir)
            runs[name].append({"seed": seed, "dev": dev_accuracy(Path(s["best_model"]), data / "dev.tsv"),
                               "best_step": s["best_step"], "steps": s["steps"],
                               "minutes": round(s["seconds"] / 60, 1),
                               **(sizes(run_dir) if name != "scratch" else {})})
    report = {"pretraining": {**masked_accuracy(mlm, args.mlm_config, data),
                              "minutes": round(summary(mlm)["seconds"] / 60, 1), "steps": summary(mlm)["steps"]}}
    for name, done in runs.items():
        accuracies = [r["dev"]["accuracy"] for r in done]
        report[name] = {"runs": done, "median_dev": round(statistics.median(accuracies), 4),
                        "range_dev": [min(accuracies), max(accuracies)]}
    report["pretraining_gain_points"] = round(
        100 * (report["finetuned"]["median_dev"] - report["scratch"]["median_dev"]), 2)
    report["lora_minus_full_points"] = round(
        100 * (report["lora"]["median_dev"] - report["finetuned"]["median_dev"]), 2)
    report["lora_trainable_share"] = round(
        runs["lora"][0]["trainable_parameters"] / runs["finetuned"][0]["trainable_parameters"], 4)
    (out / "sst2.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
