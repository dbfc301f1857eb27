"""Table 3's ablations that a CPU can run, on Multi30k English→German with the Transformer-Tiny
recipe, the same minutes each (docs/rnn.md, experiment 5).

    python -m benchmarks.table3 --out runs/table3 --minutes 8 --threads 1 --only base_seed1
    python -m benchmarks.table3 --out runs/table3 --report     # the table, beside the paper's

Every row is benchmarks/multi30k.py (configs/multi30k_en_de_tiny.yaml) with one change, the
warm-up shortened to --warmup updates (the recipe's 2,000 outlast these budgets), greedy
validation every epoch, and the best checkpoint (by validation BLEU) scored on test2016 with
beam 5; no checkpoint averaging (at these budgets the last epochs are still improving). The
unchanged recipe runs with three seeds first: the spread of those three is the yardstick each
row is read against. Each run writes OUT/ROW/table3.json: validation perplexity and BLEU of the
best checkpoint, test2016 BLEU (tokenized), updates and parameters.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import DATA, SMOKE_HELP, smoke_dir, tiny_multi30k

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
ROWS = {
    "base_seed1": ["train.seed=1"],
    "base_seed2": ["train.seed=2"],
    "base_seed3": ["train.seed=3"],
    "E_learned_positions": ["model.positional=learned", "model.max_positions=256"],
    "A_heads_1": ["model.n_heads=1"],
    "A_heads_8": ["model.n_heads=8"],
    "pre_LN": ["model.norm_first=true"],
    "attention_dropout_0.1": ["model.attention_dropout=0.1"],
    "vocab_8k": ["data.vocab_size=8000"],
    "vocab_16k": ["data.vocab_size=16000"],
}
# Vaswani et al. 2017, Table 3 (newstest2013 dev, En→De, the base model of h = 8, d_model 512):
# perplexity, BLEU. Transformer-Tiny has h = 4: its unchanged recipe is the paper's row A with h = 4,
# and A_heads_8 is the paper's base row.
PAPER = {"base": (5.00, 25.5), "A_heads_8": (4.92, 25.8), "A_heads_1": (5.29, 24.9),
         "E_learned_positions": (4.92, 25.7)}


def run(name: str, args) -> dict:
    from benchmarks import multi30k

    out = Path(args.out) / name
    sets = [f"train.threads={args.threads}", f"train.warmup={args.warmup}", "decode.beam=1", "train.log_every=100",
            *args.set, *ROWS[name]]
    result = multi30k.main(["--minutes", str(args.minutes), "--out", str(out), "--average", "0", "--data", args.data,
                            *[a for s in sets for a in ("--set", s)]])
    records = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines()]
    best = next(r for r in records if r.get("step") == result["train"]["best_step"] and "valid_ppl" in r)
    from atencion.nn.model_dir import load_model

    record = {"row": name, "minutes": args.minutes, "threads": args.threads, "settings": ROWS[name],
              "parameters": load_model(result["train"]["best_model"]).num_parameters(),
              "updates": result["train"]["steps"], "valid_ppl": round(best["valid_ppl"], 3),
              "valid_bleu_greedy": best["valid_bleu_tok"], "test2016_bleu_tok": result["test2016_best"]["bleu_tok"]}
    (out / "table3.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return record


def report(args) -> None:
    records = {name: json.loads((Path(args.out) / name / "table3.json").read_text())
               for name in ROWS if (Path(args.out) / name / "table3.json").is_file()}
    seeds = [r for name, r in records.items() if name.startswith("base_seed")]
    if seeds:
        bleus = [r["test2016_bleu_tok"] for r in seeds]
        ppls = [r["valid_ppl"] for r in seeds]
        print(f"yardstick: {len(seeds)} seeds of the unchanged recipe, test2016 BLEU {statistics.mean(bleus):.2f} "
              f"(range {min(bleus)}–{max(bleus)}), valid PPL {statistics.mean(ppls):.2f} "
              f"(range {min(ppls)}–{max(ppls)})\n")
    print("| row | change | parameters | updates | valid PPL | test2016 BLEU | paper dev PPL | paper dev BLEU |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in records.items():
        paper = PAPER.get("base" if name.startswith("base") else name, ("", ""))
        print(f"| {name} | {' '.join(r['settings'])} | {r['parameters']:,} | {r['updates']} | {r['valid_ppl']} | "
              f"{r['test2016_bleu_tok']} | {paper[0]} | {paper[1]} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/table3")
    parser.add_argument("--minutes", type=float, default=8, help="training minutes per row (default: 8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=400,
                        help="warm-up updates (default: 400; the recipe's 2,000 would not end within minutes)")
    parser.add_argument("--only", choices=list(ROWS), action="append", help="run these rows only")
    parser.add_argument("--report", action="store_true", help="no training: the table of the runs")
    parser.add_argument("--data", default=str(DATA / "multi30k"), help="Multi30k directory with tok/ (default: "
                        "../shared/data/multi30k)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every row, before the row's own change (repeatable)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here two rows, then the report")
    args = parser.parse_args(argv)
    if args.smoke:
        from benchmarks import multi30k

        with smoke_dir("table3") as tmp:
            common = ["--out", str(tmp / "table3"), "--data", str(tiny_multi30k(tmp / "multi30k"))]
            main([*common, "--minutes", "0", "--threads", "1", "--warmup", "1", "--only", "base_seed1", "--only",
                  "A_heads_1", *[a for s in multi30k.SMOKE_SETS for a in ("--set", s)]])
            return main([*common, "--report"])
    if args.report:
        report(args)
        return
    for name in args.only or list(ROWS):
        run(name, args)


if __name__ == "__main__":
    main()
