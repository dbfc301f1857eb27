"""The bottleneck, measured: BLEU against source length for an RNN without attention, an RNN with
attention and a Transformer, the same minutes each, on the demo grammar's long sentences
(docs/rnn.md, experiment 1a; Bahdanau et al. 2015, Figure 2).

    python -m benchmarks.bottleneck --out runs/bottleneck --minutes 6 --threads 1 --only rnn_none
    python -m benchmarks.bottleneck --out runs/bottleneck --report docs/figures/rnn_bottleneck.png

The corpus: ``grammar.split_long`` (nested relative clauses, adverbs, clauses joined by y/pero),
Spanish sentences of 5 to 60 words spread evenly, --train pairs to train on, 300 to validate and
--test held out. The models, all with the demo's recipe and vocabulary (configs/toy_es_en.yaml,
400 BPE pieces), its time limit replaced by --minutes and early stopping off:
``rnn_none`` and ``rnn_bahdanau`` are configs/toy_es_en_rnn.yaml (a bidirectional GRU of 2×128,
a GRU decoder of 256) with attention none and bahdanau; ``transformer`` is the demo's
Transformer (3+3 layers, d_model 128). Each run writes OUT/NAME/bottleneck.json: parameters,
updates, and per bucket of source words the test sentences, exact match, BLEU and chrF (beam 4).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import ROOT, SMOKE_HELP, smoke_dir

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
MODELS = {"rnn_none": ("toy_es_en_rnn.yaml", ["model.rnn.attention=none"]),
          "rnn_bahdanau": ("toy_es_en_rnn.yaml", []),
          "transformer": ("toy_es_en.yaml", [])}
BUCKETS = [(5, 14), (15, 24), (25, 34), (35, 44), (45, 60)]


def corpus(out: Path, n_train: int, n_test: int, seed: int, n_valid: int = 300) -> dict:
    from atencion.demo import grammar

    data = out / "data"
    if not (data / "test.es").is_file():
        train_pairs, held_out = grammar.split_long(n_train, n_valid + n_test, seed=seed)
        for name, pairs in (("train", train_pairs), ("valid", held_out[:n_valid]), ("test", held_out[n_valid:])):
            grammar.write_corpus(pairs, data, name)
    return {name: {lang: data / f"{name}.{lang}" for lang in ("es", "en")} for name in ("train", "valid", "test")}


def run(name: str, args) -> dict:
    import torch

    from atencion.data.corpus import read_lines
    from atencion.decode.translate import translate_lines
    from atencion.evaluate import score_by_length
    from atencion.nn.model_dir import load_model_dir
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    out = Path(args.out)
    files = corpus(out, args.train, args.test, args.seed, args.valid)
    config, extra = MODELS[name]
    sets = [f"data.train_src={files['train']['es']}", f"data.train_tgt={files['train']['en']}",
            f"data.valid_src={files['valid']['es']}", f"data.valid_tgt={files['valid']['en']}",
            "data.max_len=160", f"train.time_limit_minutes={args.minutes}", "train.patience=0",
            "train.max_epochs=1000", f"train.threads={args.threads}", "train.progress=false", *extra, *args.set]
    cfg = load_config(ROOT / "configs" / config, sets)
    summary = train(cfg, out / name / "run")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_dir(summary["best_model"])
    sources, refs = read_lines(files["test"]["es"]), read_lines(files["test"]["en"])
    hyps = [t[0].text for t in translate_lines(model, tokenizer, sources, cfg.decode)]
    (out / name / "test.hyp.en").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    record = {"model": name, "minutes": args.minutes, "threads": args.threads, "config": config, "settings": extra,
              "parameters": model.num_parameters(), "updates": summary["steps"], "tok_s": summary["tok_s"],
              "buckets": score_by_length(sources, hyps, refs, BUCKETS)}
    (out / name / "bottleneck.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return record


def report(args) -> None:
    from atencion.viz.plots import line_figure, save

    records = [json.loads((Path(args.out) / name / "bottleneck.json").read_text())
               for name in MODELS if (Path(args.out) / name / "bottleneck.json").is_file()]
    print("| source words | sentences | " + " | ".join(f"{r['model']} BLEU (exact)" for r in records) + " |")
    print("|---|---|" + "---|" * len(records))
    for k, bucket in enumerate(records[0]["buckets"]):
        cells = [f"{r['buckets'][k]['bleu']} ({r['buckets'][k]['exact_match']:.2f})" for r in records]
        print(f"| {bucket['words']} | {bucket['sentences']} | " + " | ".join(cells) + " |")
    print("\n| model | parameters | updates | tokens/s |\n|---|---|---|---|")
    for r in records:
        print(f"| {r['model']} | {r['parameters']:,} | {r['updates']} | {r['tok_s']} |")
    series = {r["model"]: ([b["words"] for b in r["buckets"]], [b["bleu"] for b in r["buckets"]]) for r in records}
    save(line_figure(series, "source sentence length (Spanish words)", "BLEU on held-out sentences",
                     f"the demo grammar's long sentences, {records[0]['minutes']:g} minutes each"), args.report)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bottleneck")
    parser.add_argument("--minutes", type=float, default=6, help="training minutes per model (default: 6)")
    parser.add_argument("--train", type=int, default=30000, help="training pairs (default: 30000)")
    parser.add_argument("--test", type=int, default=600, help="held-out test pairs (default: 600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=list(MODELS), action="append", help="train these models only")
    parser.add_argument("--report", metavar="PNG", help="no training: the table and figure of the runs")
    parser.add_argument("--valid", type=int, default=300, help="validation pairs (default: 300)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every model, after its own settings (repeatable)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here every model, then the report")
    args = parser.parse_args(argv)
    if args.smoke:
        sets = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.rnn.hidden=16",
                "model.rnn.decoder_hidden=32", "data.vocab_size=120", "train.max_steps=2", "train.valid_every=2",
                "train.max_tokens=512", "decode.beam=2"]
        with smoke_dir("bottleneck") as tmp:
            for name in MODELS:
                extra = [s for s in sets if MODELS[name][0] == "toy_es_en_rnn.yaml" or ".rnn." not in s]
                main(["--out", str(tmp), "--minutes", "1", "--train", "60", "--valid", "8", "--test", "10",
                      "--threads", "1", "--only", name, *[a for s in extra for a in ("--set", s)]])
            return main(["--out", str(tmp), "--report", str(tmp / "bottleneck.png")])
    if args.report:
        report(args)
        return
    for name in args.only or list(MODELS):
        run(name, args)


if __name__ == "__main__":
    main()
