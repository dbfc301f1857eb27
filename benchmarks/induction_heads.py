"""In-context learning and induction heads (Olsson et al. 2022) on a CPU: a two-layer
attention-only decoder (``model.d_ff: 0``) trained on Tiny Shakespeare in SentencePiece pieces,
with the in-context learning score and every head's prefix-matching and copying scores
(viz/induction.py) recorded at checkpoints along training.

    python -m benchmarks.induction_heads --out runs/induction \\
        --figure docs/figures/induction_heads_first.png --json docs/figures/induction_heads_first.json
    python -m benchmarks.induction_heads --out runs/induction-2 --steps 6000 --every 200 --batch 4 \\
        --weight-decay 0 --figure docs/figures/induction_heads_second.png \\
        --json docs/figures/induction_heads_second.json
    python -m benchmarks.induction_heads --smoke                                              # a look

The first is the default run (17.4 minutes at one thread, beside another one-thread job); neither
run formed an induction head (docs/results.md).

The text: the first 90% of the file (the last 10% is held out, as nanoGPT splits it), one stream
of pieces with ``</s>`` after each line (tasks/lm.py's ``text_stream``). Each update reads
``--batch`` rows of ``--context`` pieces; a share of them (``--repeat-share``) are a span of 16
to 256 pieces repeated until the row is full, a span of the text (``--repeats text``) or of
random pieces (``--repeats random``): Olsson et al. saw the heads form after billions of tokens
of natural text, and repeated spans reward an induction head from the start, which a CPU's
budget needs. The heads are scored on random pieces repeated (with ``--repeats random`` the kind
of row it trained on, with ``text`` not), and the in-context learning score on the held-out text
alone (rows of ``--context`` pieces, one every 256 pieces of it): the mean loss of the token at
index 500 minus that at index 50.

Writes OUT/model (a model directory: ``atencion serve --model OUT/model`` shows its heads),
the JSON (settings, minutes, and per checkpoint the step, pieces read, training loss, the ICL
score and the (layers, heads) score arrays) and the figure. Prints the JSON's summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

from benchmarks.common import DATA, SMOKE_HELP, smoke_dir, tiny_lines, write_gz

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)


def stream(args):
    """(tokenizer, training pieces, held-out pieces) of the text."""
    import torch

    from atencion.data.text import read_text, split_tail
    from atencion.data.tokenizer import Tokenizer
    from atencion.tasks.lm import text_stream

    train_lines, valid_lines = split_tail(read_text(args.text, "--text"), 0.1)
    tokenizer = Tokenizer.train_text(train_lines, vocab_size=args.vocab)
    as_tensor = lambda lines: torch.tensor(text_stream(lines, tokenizer), dtype=torch.long)  # noqa: E731
    return tokenizer, as_tensor(train_lines), as_tensor(valid_lines)


def batch(train, args, rng: random.Random):
    """``args.batch`` rows of ``args.context + 1`` pieces (inputs and the next pieces): spans of
    the text, and, with probability ``args.repeat_share`` each, a span (of the text, or of random
    pieces: ``args.repeats``) repeated to fill the row."""
    import torch

    rows = []
    for _ in range(args.batch):
        if rng.random() < args.repeat_share:
            span = rng.randrange(16, 257)
            if args.repeats == "random":   # ids 4 … vocab − 1: the special ones are never drawn
                piece = torch.tensor([rng.randrange(4, args.vocab_size) for _ in range(span)])
            else:
                start = rng.randrange(train.numel() - span)
                piece = train[start:start + span]
            rows.append(piece.repeat(args.context // span + 2)[:args.context + 1])
        else:
            start = rng.randrange(train.numel() - args.context - 1)
            rows.append(train[start:start + args.context + 1])
    return torch.stack(rows)


def model_config(vocab_size: int, args):
    from atencion import ModelConfig

    return ModelConfig(vocab_size=vocab_size, arch="decoder", task="lm", n_layers=2, d_model=args.d_model,
                       n_heads=args.heads, d_ff=0, dropout=0.0, norm_first=True, positional="rope",
                       max_positions=args.context, scale_embedding=False)


def checkpoint(model, valid_rows, step: int, pieces: int, loss: float | None, started: float) -> dict:
    from atencion.viz.induction import icl_score, induction_scores

    scores = induction_scores(model, length=100, rows=8)
    return {"step": step, "pieces": pieces, "minutes": round((time.time() - started) / 60, 2),
            "train_loss": None if loss is None else round(loss, 4), "icl": round(icl_score(model, valid_rows), 4),
            **{key: value for key, value in scores.to_dict().items() if key not in ("length", "rows")},
            "induction_heads": scores.induction_heads()}


def train(args) -> dict:
    import torch
    import torch.nn.functional as F

    from atencion import Transformer
    from atencion.nn.model_dir import save_model_dir
    from atencion.viz.induction import text_rows

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer, train_ids, valid_ids = stream(args)
    args.vocab_size = tokenizer.vocab_size
    valid_rows = text_rows(valid_ids, args.context)
    model = Transformer(model_config(tokenizer.vocab_size, args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    warmup = lambda step: min(1.0, (step + 1) / 100)  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    started, records, recent = time.time(), [], []
    records.append(checkpoint(model, valid_rows, 0, 0, None, started))   # before the first update: no loss yet
    for step in range(1, args.steps + 1):
        rows = batch(train_ids, args, rng)
        model.train()
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        recent = [*recent[-(args.every - 1):], loss.item()] if args.every > 1 else [loss.item()]
        if step % args.every == 0 or step == args.steps:
            records.append(checkpoint(model, valid_rows, step, step * args.batch * args.context,
                                      sum(recent) / len(recent), started))
            best = {key: [max(layer) for layer in records[-1][key]]       # each layer's best head
                    for key in ("prefix_matching", "copying", "previous_token")}
            print(json.dumps({**{k: records[-1][k] for k in ("step", "minutes", "train_loss", "icl")}, **best}),
                  file=sys.stderr)
    save_model_dir(Path(args.out) / "model", model.eval(), tokenizer)
    formed = next((r["step"] for r in records if r["induction_heads"]), None)
    settings = {key: getattr(args, key) for key in ("steps", "every", "batch", "context", "vocab", "d_model",
                                                     "heads", "lr", "weight_decay", "repeat_share", "repeats", "seed",
                                                     "threads")}
    return {"settings": settings, "minutes": round((time.time() - started) / 60, 1),
            "parameters": model.num_parameters(), "valid_rows": len(valid_rows),
            "first_step_with_induction_heads": formed, "checkpoints": records}


def figure(report: dict, path: Path) -> None:
    """The ICL score and every head's scores against the update; layers and heads counted from 1,
    as the explorer page counts them. Each score's panel draws the heads of the layer that score is
    about in colour (the second layer's for prefix matching and copying, the first's for the
    previous token) and the other layer's in pale grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records, s = report["checkpoints"], report["settings"]
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(7.5, 10.0))
    axes = fig.subplots(4, 1, sharex=True)
    axes[0].plot(steps, [r["icl"] for r in records], marker="o", markersize=3, color="black")
    axes[0].axhline(0, color="grey", linestyle=":", linewidth=1)
    axes[0].set_ylabel("ICL score (nats)\nloss@500 − loss@50")
    panels = ((axes[1], "prefix_matching", "prefix matching", 1), (axes[2], "copying", "copying", 1),
              (axes[3], "previous_token", "previous token", 0))
    for ax, key, title, shown in panels:
        layers, heads = len(records[0][key]), len(records[0][key][0])
        for layer in range(layers):
            for head in range(heads):
                values = [r[key][layer][head] for r in records]
                style = dict(linewidth=1.5) if layer == shown else dict(color="lightgrey", linewidth=1)
                ax.plot(steps, values, label=f"head {head + 1}" if layer == shown else None, **style)
        ax.set_ylabel(f"{title} score\n(colour: layer {shown + 1})")
        ax.set_ylim(-0.02, 1.02)
    axes[1].legend(fontsize=7, ncol=4, loc="upper left")
    formed = report["first_step_with_induction_heads"]
    for ax in axes:
        ax.grid(alpha=0.3)
        if formed is not None:
            ax.axvline(formed, color="firebrick", linestyle="--", linewidth=1)
    axes[3].set_xlabel(f"update ({s['batch']} rows × {s['context']} pieces each)")
    fig.suptitle(f"2-layer attention-only decoder on Tiny Shakespeare ({s['vocab']} pieces), "
                 f"{int(100 * s['repeat_share'])}% of rows {s['repeats']} spans repeated\n"
                 f"lr {s['lr']}, weight decay {s['weight_decay']}"
                 + ("; dashed: the first induction head" if formed is not None else "; no induction head"),
                 fontsize=9)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/induction", help="the model directory goes to OUT/model")
    parser.add_argument("--text", default=str(DATA / "tinyshakespeare" / "input.txt.gz"))
    parser.add_argument("--steps", type=int, default=3000, help="updates (default 3,000)")
    parser.add_argument("--every", type=int, default=100, help="updates between checkpoints (default 100)")
    parser.add_argument("--batch", type=int, default=8, help="rows per update (default 8)")
    parser.add_argument("--context", type=int, default=512, help="pieces per row (default 512; >= 501)")
    parser.add_argument("--vocab", type=int, default=1024, help="SentencePiece pieces (default 1,024)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8, help="heads per layer (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's, after 100 updates of warm-up (default 3e-3)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's (default 0.1)")
    parser.add_argument("--repeat-share", type=float, default=0.5, help="share of repeated rows (default 0.5)")
    parser.add_argument("--repeats", choices=["text", "random"], default="random",
                        help="what a repeated row repeats: random pieces (default) or a span of the text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--figure", help="write the scores against updates to this PNG")
    parser.add_argument("--json", help="write the report here too (it always goes to OUT/induction.json)")
    parser.add_argument("--replot", metavar="JSON", help="only draw --figure from the report JSON of a run")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("induction_heads") as tmp:
            words = ["".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=5)) for i in range(300)]
            text = write_gz(tmp / "text.txt.gz", tiny_lines(1500, words=words))  # enough pieces for --vocab 128
            return main(["--out", str(tmp), "--text", str(text), "--steps", "2", "--every", "1", "--batch", "1",
                         "--context", "501", "--vocab", "128", "--d-model", "16",
                         "--heads", "2", "--threads", "1", "--figure", str(tmp / "induction.png")])
    if args.replot:
        report = json.loads(Path(args.replot).read_text(encoding="utf-8"))
        figure(report, Path(args.figure or Path(args.replot).with_suffix(".png")))
        return report
    if args.context < 501:
        parser.error("--context must be at least 501: the ICL score reads the token at index 500")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    report = train(args)
    text = json.dumps(report, indent=1) + "\n"
    (Path(args.out) / "induction.json").write_text(text, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    if args.figure:
        figure(report, Path(args.figure))
    summary = {key: report[key] for key in ("minutes", "parameters", "first_step_with_induction_heads")}
    print(json.dumps({**summary, "first": report["checkpoints"][0]["icl"], "last": report["checkpoints"][-1]["icl"]}))
    return report


if __name__ == "__main__":
    main()
