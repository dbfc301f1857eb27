"""Adapting a language model to Tiny Shakespeare: full fine-tuning, LoRA (Hu et al. 2021),
prefix-tuning (Li and Liang 2021) and prompt tuning (Lester et al. 2021) from the same base, beside
the base as it is and a model trained on Shakespeare from scratch, each for the same updates.

    python -m benchmarks.adapt_lm --out runs/adapt_lm                  # about 15 min at one thread
    python -m benchmarks.adapt_lm --out runs/adapt_lm --seeds 1 2 3    # the adaptations three times each
    python -m benchmarks.adapt_lm --out runs/adapt_lm-smoke --base-steps 20 --steps 10   # a look
    python -m benchmarks.adapt_lm --smoke                                                # seconds: a check

Steps (a finished step is reused when the command is run again):
1. OUT/data: the English side of Multi30k's training set (the base's text), Tiny Shakespeare's
   first 90% (the adaptations' text) and its last 10% (held out, nanoGPT's split), and one
   character vocabulary made from both texts (OUT/data/tokenizer), so that the base reads every
   character of Shakespeare.
2. OUT/base: configs/shakespeare_char.yaml's GPT (4 layers, d_model 128, blocks of 64 characters,
   80 learned positions: the prefix's or prompt's 16 places come before a block's)
   trained on the captions for --base-steps updates.
3. From OUT/base/best, for --steps updates of Shakespeare each (the config's other settings: 12
   blocks an update, AdamW, a cosine schedule; the rates are not tuned):
   ``full`` every weight (lr 1e-3); ``lora`` rank 8 on attention and feed-forward (lr 3e-3);
   ``prefix`` 16 places a layer made by PEFT's projection (hidden 64; lr 5e-3); ``prompt`` 16
   embeddings from the vocabulary's (lr 5e-3); and ``scratch``, the same GPT from random weights
   (lr 1e-3).
Each model's loss on the held-out tail (nats per character, blocks of 64) is the figure, beside
its trainable parameters. Prints one JSON object (also OUT/adapt_lm.json): per method each seed's
loss and the median and range.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from pathlib import Path

from benchmarks.common import DATA, ROOT, SMOKE_HELP, TINY_MODEL, smoke_dir, tiny_multi30k, tiny_text

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
CONFIG = ROOT / "configs" / "shakespeare_char.yaml"
# 16 more learned positions than the blocks: prefix and prompt places come first (tokens after them)
COMMON = ["model.max_positions=80", "train.valid_every=1000000", "train.progress=false", "train.tensorboard=false",
          "train.keep_last=1"]
METHODS = {
    "full": ["train.lr_peak=1e-3"],
    "lora": ["train.lora={rank: 8, alpha: 16, targets: [attention, ffn]}", "train.lr_peak=3e-3"],
    "prefix": ["train.prefix={length: 16, projection: true, hidden: 64}", "train.lr_peak=5e-3"],
    "prompt": ["train.prompt={length: 16, init: vocab}", "train.lr_peak=5e-3"],
    "scratch": ["train.lr_peak=1e-3"],
}


def prepare(out: Path, sources: Path = DATA) -> Path:
    from atencion.data.text import split_tail
    from atencion.data.tokenizer import Tokenizer

    data = out / "data"
    if (data / "tokenizer").is_dir():
        return data
    with gzip.open(sources / "multi30k" / "raw" / "train.en.gz", "rt", encoding="utf-8") as f:
        captions = f.read().splitlines()
    with gzip.open(sources / "tinyshakespeare" / "input.txt.gz", "rt", encoding="utf-8") as f:
        shakespeare = f.read().splitlines()
    train, valid = split_tail(shakespeare, 0.1)
    data.mkdir(parents=True, exist_ok=True)
    for name, lines in (("captions", captions), ("shakespeare.train", train), ("shakespeare.valid", valid)):
        (data / f"{name}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    Tokenizer.train_text(captions + train, kind="char").save(data / "tokenizer")
    return data


def run(config_overrides: list[str], out: Path) -> Path:
    """Train configs/shakespeare_char.yaml with the overrides into ``out`` (reused if done)."""
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    if not (out / "best").is_dir():
        train(load_config(CONFIG, [*COMMON, *config_overrides]), out)
    return out / "best"


def score(model_dir: Path, data: Path) -> dict:
    from atencion.data.text import read_text
    from atencion.nn.model_dir import load_model_dir
    from atencion.tasks.lm import evaluate_lm

    model, tokenizer = load_model_dir(model_dir)
    lines = read_text(str(data / "shakespeare.valid.txt"), "held-out text")
    return {"valid_loss": round(evaluate_lm(model, tokenizer, lines, block_size=64)["loss"], 4),
            "parameters": model.num_parameters()}


def adapter_parameters(model_dir: Path) -> int | None:
    """The parameters of a directory's adapters (LoRA, prefix, prompt, with the head), or None."""
    from safetensors import safe_open

    path = model_dir / "adapters.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/adapt_lm")
    parser.add_argument("--base-steps", type=int, default=3000, help="the base's updates (default 3,000)")
    parser.add_argument("--steps", type=int, default=1000, help="each adaptation's updates (default 1,000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="train.seed of the adaptations")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--data", default=str(DATA), help="where multi30k/raw/train.en.gz and "
                        "tinyshakespeare/input.txt.gz are (default: ../shared/data)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run, after the method's (repeatable)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("adapt_lm") as tmp:
            tiny_multi30k(tmp / "data" / "multi30k")
            tiny_text(tmp / "data" / "tinyshakespeare" / "input.txt.gz")
            sets = [*TINY_MODEL, "train.max_tokens=256"]
            return main(["--out", str(tmp / "adapt_lm"), "--data", str(tmp / "data"), "--base-steps", "2", "--steps",
                         "2", *[a for s in sets for a in ("--set", s)]])
    out = Path(args.out)
    data = prepare(out, Path(args.data))
    threads = f"train.threads={args.threads}"
    base = run([f"data.train_text={data / 'captions.txt'}", f"data.valid_text={data / 'shakespeare.valid.txt'}",
                f"data.tokenizer_dir={data / 'tokenizer'}", f"train.max_steps={args.base_steps}", threads, *args.set],
               out / "base")
    report = {"settings": vars(args), "base": score(base, data), "methods": {}}
    for name, overrides in METHODS.items():
        runs = []
        for seed in args.seeds:
            start = [] if name == "scratch" else [f"train.init_from={base}"]
            text = [f"data.train_text={data / 'shakespeare.train.txt'}",
                    f"data.valid_text={data / 'shakespeare.valid.txt'}"]
            if name == "scratch":
                text.append(f"data.tokenizer_dir={data / 'tokenizer'}")
            run_dir = out / f"{name}_seed{seed}"
            best = run([*text, *start, *overrides, f"train.max_steps={args.steps}", f"train.seed={seed}", threads,
                        *args.set], run_dir)
            scores = score(best, data)
            runs.append({"seed": seed, **scores, "trained": adapter_parameters(best) or scores["parameters"]})
            print(json.dumps({"method": name, **runs[-1]}), file=sys.stderr, flush=True)
        losses = [r["valid_loss"] for r in runs]
        report["methods"][name] = {"runs": runs, "median": statistics.median(losses),
                                   "range": [min(losses), max(losses)]}
    (out / "adapt_lm.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({"base": report["base"]["valid_loss"],
                      **{name: m["median"] for name, m in report["methods"].items()}}))
    return report


if __name__ == "__main__":
    main()
