"""LoRA on translation: a trained Multi30k English→German model adapted to English→French, against
full fine-tuning from the same model and against training from scratch, each for the same minutes.

    python -m benchmarks.multi30k --out runs/m30k-base --minutes 30          # the En→De model first
    python -m benchmarks.lora_transfer --base runs/m30k-base/averaged --out runs/lora-fr --minutes 20
    python -m benchmarks.lora_transfer ... --only lora    # one run (two can share a 2-core CPU, --threads 1)

Each run is benchmarks/multi30k.py --tgt fr (the Transformer-Tiny recipe, validation every epoch,
the last 10 epoch checkpoints averaged, test2016 with beam 5):
- ``scratch``: the recipe as it is, with its own joint En+Fr vocabulary;
- ``full``: train.init_from the En→De model (its En+De vocabulary, every weight trained),
  warm-up 200 updates and peak learning rate --lr (a trained model needs no long warm-up);
- ``lora``: the same start and schedule, the weights frozen, LoRA adapters (--rank, on every
  linear layer: attention, cross-attention and feed-forward) trained;
- ``lora_embeddings``: the same with adapters on the embedding table too (and so on the output
  projection tied to it).
Prints one JSON object (also OUT/lora_transfer.json): per run the test2016 scores of the best
checkpoint (by validation BLEU) and of the average of the last 10 epoch checkpoints (at 20
minutes these include the first epochs: the best checkpoint is the figure to read), updates,
tokens/s, trainable parameters, Adam's state and checkpoint size on disk; with --figure,
validation BLEU (greedy) against minutes for the runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import DATA, SMOKE_HELP, smoke_dir, smoke_requested, tiny_multi30k

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
RUNS = ("scratch", "full", "lora", "lora_embeddings")


def run_sets(name: str, args) -> list[str]:
    sets = ["decode.beam=1", "train.keep_last=10", "train.log_every=100", f"train.threads={args.threads}", *args.set]
    if name == "scratch":
        return sets
    sets += [f"train.init_from={args.base}", "train.warmup=200", f"train.lr_peak={args.lr}"]
    if name.startswith("lora"):
        targets = "[all, embeddings]" if name == "lora_embeddings" else "all"
        sets.append(f"train.lora={{rank: {args.rank}, alpha: {2 * args.rank}, dropout: 0.1, targets: {targets}}}")
    return sets


def sizes(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from atencion.train.checkpoint import list_checkpoints

    checkpoint = list_checkpoints(run_dir / "checkpoints")[-1]
    moments = load_file(str(checkpoint / "optimizer.safetensors"))
    return {"trainable_parameters": sum(t.numel() for k, t in moments.items() if k.endswith(".exp_avg")),
            "optimizer_state_bytes": (checkpoint / "optimizer.safetensors").stat().st_size,
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file())}


def one(name: str, args) -> dict:
    from benchmarks import multi30k

    out = Path(args.out) / name
    cached = out / "result.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    argv = ["--tgt", "fr", "--out", str(out), "--minutes", str(args.minutes), "--data", args.data]
    result = multi30k.main(argv + [a for s in run_sets(name, args) for a in ("--set", s)])
    keep = {"test2016_best": result["test2016_best"], "test2016_averaged": result["test2016_averaged"],
            "valid_curve": result["valid_curve"],
            "updates": result["train"]["steps"], "tok_s": result["train"]["tok_s"],
            "minutes": round(result["train"]["seconds"] / 60, 1), **sizes(out / "run")}
    cached.write_text(json.dumps(keep, indent=2) + "\n")
    return keep


def figure(results: dict, png: str) -> None:
    from atencion.viz.plots import line_figure, save

    labels = {"scratch": "from scratch (own En+Fr vocabulary)", "full": "full fine-tuning of the En→De model",
              "lora": "LoRA on the En→De model (weights frozen)",
              "lora_embeddings": "LoRA, embedding table adapted too"}
    series = {labels[name]: ([m for m, _ in r["valid_curve"]], [b for _, b in r["valid_curve"]])
              for name, r in results.items()}
    save(line_figure(series, "wall-clock minutes (training + validation)", "validation BLEU, En→Fr (greedy, tokenized)",
                     "Multi30k En→Fr: adapting an En→De Transformer-Tiny", marker="."), png)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=not smoke_requested(argv),
                        help="a trained Multi30k En→De model directory (plain weights)")
    parser.add_argument("--out", default="runs/lora-fr")
    parser.add_argument("--minutes", type=float, default=20.0, help="training time of each run (default: 20)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 · rank; default: 8)")
    parser.add_argument("--lr", type=float, default=0.003, help="peak learning rate of full and lora (default: 0.003)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default: 1)")
    parser.add_argument("--only", choices=RUNS, action="append", help="run only these (repeatable)")
    parser.add_argument("--figure", help="write the validation curves to this PNG")
    parser.add_argument("--data", default=str(DATA / "multi30k"), help="Multi30k directory with tok/ (default: "
                        "../shared/data/multi30k)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here an En→De base of 4 updates first")
    args = parser.parse_args(argv)
    if args.smoke:
        from benchmarks import multi30k

        with smoke_dir("lora_transfer") as tmp:
            data = str(tiny_multi30k(tmp / "multi30k"))
            sets = [a for s in multi30k.SMOKE_SETS for a in ("--set", s)]
            multi30k.main(["--data", data, "--out", str(tmp / "base"), "--average", "2", "--beam", "1", *sets])
            return main(["--base", str(tmp / "base" / "averaged"), "--out", str(tmp / "lora-fr"), "--data", data,
                         "--minutes", "0", "--figure", str(tmp / "curves.png"), *sets])
    results = {name: one(name, args) for name in (args.only or RUNS)}
    if args.figure:
        figure(results, args.figure)
    report = {name: {k: v for k, v in r.items() if k != "valid_curve"} for name, r in results.items()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.only:
        (Path(args.out) / "lora_transfer.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
