"""The ladder on real data: Multi30k German→English, from an RNN without attention to the
Transformer, each trained for the same minutes (docs/rnn.md, experiments 1b and 2).

    python -m benchmarks.rnn_ladder --out runs/ladder --minutes 15 --threads 1 --only gru_bahdanau
    python -m benchmarks.rnn_ladder --out runs/ladder --report docs/figures    # the table and figures

Each rung is benchmarks/multi30k.py --src de --tgt en with the settings of RUNGS (the Transformer
is the Transformer-Tiny recipe), and the same schedule for all: warm-up 500 updates to a peak
learning rate of 3e-3, gradients clipped to norm 1, dropout 0.3, greedy validation every epoch.
Test2016 is translated with beam 5 by the best checkpoint. Each run writes OUT/RUNG/ladder.json:
the scores, updates, training tokens/s, and decoding sentences/s (test2016, beam 5 and greedy,
timed apart from training). ``--report`` reads them all and prints the table in markdown, BLEU
per source-length bucket, and draws validation BLEU against minutes (rnn_ladder.png) and test
BLEU against source length (rnn_buckets_multi30k.png).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import DATA, SMOKE_HELP, smoke_dir, tiny_multi30k

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
RNN = ["model.arch=rnn", "model.d_model=128"]
BAHDANAU = RNN + ["model.n_layers=1", "model.rnn.hidden=128", "model.rnn.decoder_hidden=256",
                  "model.rnn.attention=bahdanau"]
RUNGS = {
    # Sutskever et al. 2014 (the tutorials' first model): a 2-layer LSTM, one summary vector
    "lstm_none": RNN + ["model.n_layers=2", "model.rnn.cell=lstm", "model.rnn.bidirectional=false",
                        "model.rnn.hidden=256", "model.rnn.decoder_hidden=256", "model.rnn.attention=none"],
    # Cho et al. 2014: a GRU, the summary fed at every step
    "gru_none": RNN + ["model.n_layers=1", "model.rnn.bidirectional=false", "model.rnn.hidden=256",
                       "model.rnn.decoder_hidden=256", "model.rnn.attention=none"],
    # Bahdanau et al. 2015: a bidirectional GRU encoder, additive attention from s_{t-1}
    "gru_bahdanau": BAHDANAU,
    # Luong et al. 2015: "general" attention from s_t, input feeding
    "gru_luong": RNN + ["model.n_layers=1", "model.rnn.hidden=128", "model.rnn.decoder_hidden=256",
                        "model.rnn.attention=luong"],
    "transformer": [],
    # beside the ladder: the Transformer pre-LN (Table 3's row that learns fastest early), and a
    # second seed of the top rung, for its spread
    "transformer_preln": ["model.norm_first=true"],
    "gru_bahdanau_seed2": BAHDANAU + ["train.seed=2"],
}
COMMON = ["train.warmup=500", "train.lr_peak=0.003", "train.clip_norm=1.0", "decode.beam=1",
          "train.log_every=100"]
TUTORIAL = {"lstm_none": 13.9, "gru_none": 21.0, "gru_bahdanau": 28.0, "transformer": 36.0}
BUCKETS = [(1, 8), (9, 12), (13, 16), (17, 20), (21, 60)]


def run(name: str, args) -> dict:
    import torch

    from atencion.data.corpus import read_lines
    from atencion.decode import DecodeConfig
    from atencion.decode.translate import translate_lines
    from atencion.nn.model_dir import load_model_dir
    from benchmarks import multi30k

    out = Path(args.out) / name
    sets = [f"train.threads={args.threads}", *COMMON, *RUNGS[name], *args.set]
    result = multi30k.main(["--src", "de", "--tgt", "en", "--minutes", str(args.minutes), "--out", str(out),
                            "--data", args.data,
                            *[a for s in sets for a in ("--set", s)]])
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_dir(result["train"]["best_model"])
    sources = read_lines(Path(args.data) / "tok" / "test_2016_flickr.lc.norm.tok.de.gz")
    speed = {}
    for beam in (5, 1):
        start = time.perf_counter()
        translate_lines(model, tokenizer, sources, DecodeConfig(beam=beam))
        speed[f"beam{beam}_sentences_per_s"] = round(len(sources) / (time.perf_counter() - start), 1)
    record = {"rung": name, "minutes": args.minutes, "threads": args.threads, "settings": sets,
              "parameters": model.num_parameters(), "updates": result["train"]["steps"],
              "train_tok_s": result["train"].get("tok_s"), "test2016_best": result["test2016_best"],
              "test2016_averaged": result.get("test2016_averaged"), "valid_curve": result["valid_curve"], **speed}
    (out / "ladder.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return record


def report(args) -> None:
    from atencion.data.corpus import read_lines
    from atencion.evaluate import score_by_length
    from atencion.viz.plots import line_figure, save

    tok = Path(args.data) / "tok"
    sources = read_lines(tok / "test_2016_flickr.lc.norm.tok.de.gz")
    refs = read_lines(tok / "test_2016_flickr.lc.norm.tok.en.gz")
    records = [json.loads((Path(args.out) / name / "ladder.json").read_text())
               for name in RUNGS if (Path(args.out) / name / "ladder.json").is_file()]
    print("| model | parameters | updates | train tokens/s | test2016 BLEU (tok) | BLEU per minute | "
          "decode sent/s beam 5 | greedy | tutorial (GPU) |")
    print("|---|---|---|---|---|---|---|---|---|")
    buckets = {}
    for r in records:
        bleu = r["test2016_best"]["bleu_tok"]
        print(f"| {r['rung']} | {r['parameters'] / 1e6:.2f}M | {r['updates']} | {r['train_tok_s']} | {bleu} | "
              f"{bleu / r['minutes']:.2f} | {r['beam5_sentences_per_s']} | {r['beam1_sentences_per_s']} | "
              f"{TUTORIAL.get(r['rung'], '')} |")
        hyps = read_lines(Path(args.out) / r["rung"] / "test2016.best.en", allow_empty=True)
        buckets[r["rung"]] = [(b["words"], b["sentences"], b["bleu_tok"])
                              for b in score_by_length(sources, hyps, refs, BUCKETS)]
    print()
    print("| source words | sentences | " + " | ".join(buckets) + " |")
    print("|---|---|" + "---|" * len(buckets))
    first = next(iter(buckets.values()))
    for k, (label, n, _) in enumerate(first):
        print(f"| {label} | {n} | " + " | ".join(str(rows[k][2]) for rows in buckets.values()) + " |")
    figures = Path(args.report)
    curves = {r["rung"]: ([m for m, _ in r["valid_curve"]], [b for _, b in r["valid_curve"]]) for r in records}
    save(line_figure(curves, "wall-clock minutes (training + validation)", "validation BLEU (greedy, tokenized)",
                     "Multi30k de→en, the same minutes each", marker="."), figures / "rnn_ladder.png")
    lengths = {name: ([label for label, _, _ in rows], [b for _, _, b in rows]) for name, rows in buckets.items()}
    save(line_figure(lengths, "source sentence length (words)", "test2016 BLEU (tokenized)",
                     "Multi30k de→en: BLEU against source length"), figures / "rnn_buckets_multi30k.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/ladder", help="one directory per rung under it")
    parser.add_argument("--data", default=str(DATA / "multi30k"))
    parser.add_argument("--minutes", type=float, default=15, help="training minutes per rung (default: 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default: 1)")
    parser.add_argument("--only", choices=list(RUNGS), action="append", help="run these rungs only")
    parser.add_argument("--report", metavar="FIGURES_DIR", help="no training: the table and figures of the runs")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every rung, after its own settings (repeatable)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here two rungs, then the report")
    args = parser.parse_args(argv)
    if args.smoke:
        from benchmarks import multi30k

        with smoke_dir("rnn_ladder") as tmp:
            common = ["--out", str(tmp / "ladder"), "--data", str(tiny_multi30k(tmp / "multi30k"))]
            main([*common, "--minutes", "1", "--threads", "1", "--only", "gru_bahdanau", "--only", "transformer",
                  *[a for s in multi30k.SMOKE_SETS for a in ("--set", s)]])
            return main([*common, "--report", str(tmp)])
    if args.report:
        report(args)
        return
    for name in args.only or list(RUNGS):
        run(name, args)


if __name__ == "__main__":
    main()
