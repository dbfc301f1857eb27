"""Transformer-Tiny on Multi30k: train, average the last epoch checkpoints, evaluate on test2016.

    python -m benchmarks.multi30k --minutes 20 --out runs/m30k-en-de
    python -m benchmarks.multi30k --tgt fr --out runs/m30k-en-fr
    python -m benchmarks.multi30k --smoke          # tiny made-up data, 4 updates: a check, not a result

Reads the tok/ files (lower-cased, Moses-tokenized) of --data (default ../shared/data/multi30k;
`atencion download multi30k --out DIR` fetches them elsewhere) and prints one JSON object:
training time, tokens/s, best validation BLEU, and test2016 bleu_tok (tokenized lower-cased
BLEU, the published metric), sacreBLEU and chrF on those same tokenized files, and sacreBLEU
and chrF on the raw test2016 references after recasing (casing learnt from raw/train) and
detokenizing the output (raw_bleu, raw_bleu_lc, raw_chrf), for the averaged model and for the
best single checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from benchmarks.common import DATA, ROOT, SMOKE_HELP, smoke_dir, tiny_multi30k

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
# --smoke (and the smoke runs of the scripts built on this one): a tiny model, 4 updates, two epochs of the tiny data
SMOKE_SETS = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "data.vocab_size=60",
              "train.max_tokens=256", "train.max_steps=4", "train.warmup=1", "train.log_every=1"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DATA / "multi30k"),
                        help="Multi30k directory with tok/ (default: ../shared/data/multi30k)")
    parser.add_argument("--src", default="en", help="source language (default: en)")
    parser.add_argument("--tgt", default="de", choices=["de", "fr", "en"], help="target language (default: de)")
    parser.add_argument("--out", default="runs/multi30k", help="output directory (must not hold a run)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "multi30k_en_de_tiny.yaml"))
    parser.add_argument("--minutes", type=float, default=0, help="training time limit (0: the config's)")
    parser.add_argument("--average", type=int, default=10,
                        help="average the last N checkpoints (default: 10; 0: no average, the best checkpoint only)")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("multi30k") as tmp:
            return main(["--data", str(tiny_multi30k(tmp / "multi30k")), "--out", str(tmp / "run"), "--tgt", args.tgt,
                         "--average", "2", "--beam", "2", *[a for s in SMOKE_SETS + args.set for a in ("--set", s)]])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    from atencion.allocator import keep_freed_memory
    from atencion.decode import DecodeConfig
    from atencion.evaluate import evaluate
    from atencion.train.checkpoint import average_checkpoints, list_checkpoints
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    tok = Path(args.data) / "tok"
    files = {f"{split}_{side}": str(tok / f"{name}.lc.norm.tok.{lang}.gz")
             for split, name in (("train", "train"), ("valid", "val"))
             for side, lang in (("src", args.src), ("tgt", args.tgt))}
    overrides = [f"data.{key}={value}" for key, value in files.items()]
    if args.minutes:
        overrides.append(f"train.time_limit_minutes={args.minutes}")
    cfg = load_config(args.config, overrides + args.set)
    out = Path(args.out)
    keep_freed_memory()  # as the atencion commands do
    summary = train(cfg, out / "run")

    checkpoints = list_checkpoints(out / "run" / "checkpoints")[-args.average:] if args.average else []
    if checkpoints:
        average_checkpoints(checkpoints, out / "averaged")
    test_src = tok / f"test_2016_flickr.lc.norm.tok.{args.src}.gz"
    test_ref = tok / f"test_2016_flickr.lc.norm.tok.{args.tgt}.gz"
    raw = Path(args.data) / "raw"
    raw_options = {}
    if (raw / f"test_2016_flickr.{args.tgt}.gz").is_file() and (raw / f"train.{args.tgt}.gz").is_file():
        raw_options = {"raw_ref": raw / f"test_2016_flickr.{args.tgt}.gz", "recase_from": raw / f"train.{args.tgt}.gz"}
    result = {"pair": f"{args.src}-{args.tgt}", "train": summary, "averaged_checkpoints": len(checkpoints)}
    for name, model_dir in (("averaged", out / "averaged" if checkpoints else None), ("best", summary["best_model"])):
        if model_dir is None:
            continue
        scores = evaluate(model_dir, test_src, test_ref, DecodeConfig(beam=args.beam, alpha=args.alpha),
                          output=out / f"test2016.{name}.{args.tgt}", **raw_options)
        keys = ("bleu_tok", "bleu", "chrf", "raw_bleu", "raw_bleu_lc", "raw_chrf")
        result[f"test2016_{name}"] = {k: scores[k] for k in keys if k in scores}
    result["valid_curve"] = learning_curve(out / "run" / "log.jsonl", out / "curve.png",
                                           f"Transformer-Tiny, Multi30k {args.src}→{args.tgt}")
    print(json.dumps(result))
    return result


def learning_curve(log_path: Path, png: Path, title: str) -> list[tuple[float, float]]:
    """Validation BLEU (tokenized) against wall-clock minutes, from a run's log.jsonl, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    curve = [(r["seconds"] / 60, r["valid_bleu_tok"]) for r in records if "valid_bleu_tok" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=90)
    ax.plot([m for m, _ in curve], [b for _, b in curve], marker=".")
    ax.set_xlabel("wall-clock minutes (training + validation)")
    ax.set_ylabel("validation BLEU (tokenized)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return [(round(m, 2), b) for m, b in curve]


if __name__ == "__main__":
    main()
