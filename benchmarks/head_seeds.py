"""Heads specialise, but not reliably: per-head AER of the demo's Transformer for two training
seeds, beside the RNN's one attention (docs/rnn.md, experiment 6).

    python -m benchmarks.head_seeds --out runs/head_seeds --seeds 1 2 --rnn runs/demo_rnn/run/best

Trains the demo (`atencion demo`, configs/toy_es_en.yaml) once per --seeds (train.seed), then
scores the cross-attention alignment of each layer and head against the grammar's gold
alignments of the 500 held-out test sentences (`atencion aer`, row shift "predict"), and, with
--rnn, of an RNN demo model's α on the same sentences (the grammar draws the same test set). It
prints the exact match of each seed, a table of per-head AER (rows: layer.head, a column per
seed), which head aligns best in each seed, and the Spearman correlation of the per-head AERs
of the first two seeds; all of it also in OUT/head_seeds.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import SMOKE_HELP, smoke_dir

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    mean = (n - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var


def main(argv: list[str] | None = None, demo: dict | None = None) -> dict:
    """``demo``: run_demo's corpus sizes (n_train, n_valid, n_test), the demo's own when None."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/head_seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rnn", help="an RNN demo model directory (configs/toy_es_en_rnn.yaml) to score too")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override of every seed's demo run (repeatable)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here a demo corpus of 200 pairs")
    args = parser.parse_args(argv)
    if args.smoke:
        sets = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "data.vocab_size=120",
                "train.max_steps=2", "train.valid_every=2", "decode.beam=1"]
        with smoke_dir("head_seeds") as tmp:
            return main(["--out", str(tmp), "--seeds", "1", "2", "--threads", "1",
                         *[a for s in sets for a in ("--set", s)]], demo=dict(n_train=200, n_valid=20, n_test=20))

    from atencion.data.corpus import read_lines
    from atencion.demo.run import run_demo
    from atencion.nn.model_dir import load_model_dir
    from atencion.viz.attention import evaluate_alignment

    out = Path(args.out)
    result = {"seeds": {}}
    data = None
    for seed in args.seeds:
        run_dir = out / f"seed{seed}"
        summary_file = run_dir / "demo.json"
        if not summary_file.is_file():
            summary = run_demo(run_dir, overrides=[f"train.seed={seed}", f"train.threads={args.threads}",
                                                   "train.progress=false", *args.set], **(demo or {}))
            summary_file.write_text(json.dumps(summary) + "\n")
        summary = json.loads(summary_file.read_text())
        data = run_dir / "data"
        model, tokenizer = load_model_dir(summary["model_dir"])
        aer = evaluate_alignment(model, tokenizer, read_lines(data / "test.es"), read_lines(data / "test.en"),
                                 read_lines(data / "test.align", allow_empty=True))
        result["seeds"][seed] = {"exact_match": summary["exact_match"], "bleu": summary["bleu"], "aer": aer}
    if args.rnn:
        model, tokenizer = load_model_dir(args.rnn)
        result["rnn"] = evaluate_alignment(model, tokenizer, read_lines(data / "test.es"),
                                           read_lines(data / "test.en"), read_lines(data / "test.align",
                                                                                    allow_empty=True))
    seeds = list(result["seeds"])
    heads = {seed: [v for layer in result["seeds"][seed]["aer"]["heads"] for v in layer] for seed in seeds}
    layers = result["seeds"][seeds[0]]["aer"]["heads"]
    names = [f"{i + 1}.{j + 1}" for i, layer in enumerate(layers) for j in range(len(layer))]
    print("exact match: " + ", ".join(f"seed {s} {result['seeds'][s]['exact_match']}" for s in seeds))
    print("\n| layer.head | " + " | ".join(f"AER seed {s}" for s in seeds) + " |")
    print("|---|" + "---|" * len(seeds))
    for k, name in enumerate(names):
        print(f"| {name} | " + " | ".join(f"{heads[s][k]:.3f}" for s in seeds) + " |")
    for s in seeds:
        best = min(range(len(names)), key=lambda k: heads[s][k])
        result["seeds"][s]["best_head"] = names[best]
        print(f"seed {s}: best head {names[best]} (AER {heads[s][best]:.3f}), layers "
              f"{result['seeds'][s]['aer']['layers']}")
    if len(seeds) >= 2:
        result["spearman_first_two"] = round(spearman(heads[seeds[0]], heads[seeds[1]]), 3)
        print(f"Spearman correlation of the per-head AERs, seeds {seeds[0]} and {seeds[1]}: "
              f"{result['spearman_first_two']}")
    if "rnn" in result:
        print(f"RNN (one attention): AER {result['rnn']['layers_mean']}")
    (out / "head_seeds.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
