"""Speculative decoding on Tiny Shakespeare (Leviathan et al. 2023; Chen et al. 2023): the
acceptance rate of a small draft's proposals and the speed-up in tokens/s over the target alone,
at batch 1, greedy (where the text must be the target's own, token for token: checked every round).

The draft is the "baby GPT" of configs/shakespeare_char.yaml (4 layers, d_model 128, 64 learned
positions, 0.8M parameters). The target is larger: configs/shakespeare_char_30min.yaml made wider
and longer, 6 layers, d_model 256, 8 heads, d_ff 1024, 256 learned positions and blocks of 256
characters (4.8M parameters), so that the text generated stays within its positions, trained on
6 blocks (1,536 characters) per update. Both are trained here if missing, by updates
(``--draft-steps``, ``--target-steps``; a finished run of the same command is reused), or given
as trained model directories (``--draft-model``, ``--target-model``). Then, for
each prompt (the start of a line of the held-out tail) and each ``--draft-tokens`` k, the target
alone and the target with the draft generate ``--new-tokens`` tokens greedily, one after the
other, timed apart; reported: median and range over the rounds of tokens/s, speed-up and
acceptance rate (accepted draft tokens per proposed one).

    python -m benchmarks.speculative                      # trains both (about 35 minutes on one thread), measures
    python -m benchmarks.speculative --draft-steps 20 --target-steps 20 --rounds 3 --new-tokens 40 \\
        --target-set train.max_tokens=512 --out runs/speculative-smoke    # a smoke run: untrained models

The target's run defaults to 1,500 updates (2.3M characters, about two passes over the training
text): about 30 minutes at the 1,275 training tokens/s it ran at here on one thread, the draft's
2,000 updates about 5 (at 5,900). Untrained models (the smoke run) agree on everything, so their
acceptance is 1 and their speed-up only shows what a verification pass costs. Timings use
``--threads`` torch threads (default 1). Prints a table; writes OUT/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import DATA, ROOT, SMOKE_HELP, finished, smoke_dir, spread, tiny_text

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)
TARGET_SHAPE = ["model.d_model=256", "model.n_heads=8", "model.d_ff=1024", "model.max_positions=256",
                "data.block_size=256", "train.max_tokens=1536", "train.time_limit_minutes=0"]


# training --------------------------------------------------------------------------------------

def train(name: str, config: str, steps: int, overrides: list[str], args) -> Path:
    """Train ``name`` under OUT (or reuse its finished run of the same command); its best model."""
    run = Path(args.out) / name
    command = [sys.executable, "-m", "atencion", "train", config, "--out", str(run),
               f"--set=data.train_text={args.text}", f"--set=train.max_steps={steps}",
               f"--set=train.threads={args.threads}", *[f"--set={item}" for item in overrides]]
    mark = run / "speculative_command.json"
    if run.exists():
        if finished(run) and mark.is_file() and json.loads(mark.read_text())["command"][1:] == command[1:]:
            return run / "best"
        raise SystemExit(f"{run} holds a run of other settings or an unfinished one; remove it or give another --out")
    subprocess.run(command, check=True)
    mark.write_text(json.dumps({"command": command}) + "\n", encoding="utf-8")
    return run / "best"


def summary(run: Path) -> dict:
    """Updates, minutes and the best validation loss of a finished run (its log.jsonl; nothing
    for a model directory that is not a run's)."""
    if not (run / "log.jsonl").is_file():
        return {}
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    done = [r["summary"] for r in records if "summary" in r][-1]
    losses = [r["valid_loss"] for r in records if "valid_loss" in r]
    return {"updates": done["steps"], "minutes": round(done["seconds"] / 60, 2),
            "best_valid_loss": round(min(losses), 4) if losses else None}


# measuring -------------------------------------------------------------------------------------

def prompts(text: str, count: int, length: int) -> list[str]:
    """The first ``length`` characters of ``count`` lines spread over the held-out tail (the last 10%)."""
    from atencion.data.text import read_text, split_tail

    _, valid = split_tail(read_text(text, "--text"), 0.1)
    lines = [line for line in valid if len(line) >= length]
    return [lines[i * len(lines) // count][:length] for i in range(count)]


def measure(target_dir: Path, draft_dir: Path, args) -> dict:
    """Per prompt and k: tokens/s of the target alone and with the draft, the acceptance rate and
    whether the texts are equal; then the median and range of each over the prompts."""
    import torch

    from atencion.decode.sample import generate_ids
    from atencion.decode.speculative import speculative_ids
    from atencion.nn.model_dir import load_model_dir
    from atencion.tasks.lm import check_draft_vocabulary, prompt_ids

    target, tokenizer = load_model_dir(target_dir)
    draft, draft_tokenizer = load_model_dir(draft_dir, what="--draft")
    check_draft_vocabulary(str(target_dir), tokenizer, str(draft_dir), draft_tokenizer)
    rounds = {k: [] for k in args.draft_tokens}
    texts = prompts(args.text, args.rounds, args.prompt_chars)
    warm = torch.tensor([prompt_ids(tokenizer, texts[0])])
    generate_ids(target, warm, 8, temperature=0)
    speculative_ids(target, draft, warm, 8, args.draft_tokens[0], temperature=0)
    for text in texts:
        ids = torch.tensor([prompt_ids(tokenizer, text)])
        began = time.perf_counter()
        alone = generate_ids(target, ids, args.new_tokens, temperature=0)
        alone_tps = args.new_tokens / (time.perf_counter() - began)
        for k in args.draft_tokens:
            tokens, stats = speculative_ids(target, draft, ids, args.new_tokens, k, temperature=0)
            rounds[k].append({"prompt": text, "target_tok_s": alone_tps, "speculative_tok_s": stats.tokens_per_second,
                              "speed_up": stats.tokens_per_second / alone_tps, "acceptance": stats.acceptance_rate,
                              "identical": torch.equal(tokens, alone)})
    return {str(k): {"rounds": r, **{key: spread([x[key] for x in r], 3) for key in
                                     ("target_tok_s", "speculative_tok_s", "speed_up", "acceptance")},
                     "identical": all(x["identical"] for x in r)} for k, r in rounds.items()}


def table(results: dict) -> str:
    def cell(s: dict, digits: int) -> str:
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"

    rows = [["k", "target tok/s", "speculative tok/s", "speed-up", "acceptance", "same text"]]
    for k, r in results.items():
        rows.append([k, cell(r["target_tok_s"], 1), cell(r["speculative_tok_s"], 1), cell(r["speed_up"], 2),
                     cell(r["acceptance"], 2), "yes" if r["identical"] else "NO"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows) + \
        "\n(median [min, max] over the prompts)"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/speculative", help="the two runs and speculative.json go here")
    parser.add_argument("--text", default=str(DATA / "tinyshakespeare" / "input.txt.gz"),
                        help="the training text (data.train_text; the validation text and the prompts: its last 10%%)")
    parser.add_argument("--draft-config", default=str(ROOT / "configs" / "shakespeare_char.yaml"))
    parser.add_argument("--target-config", default=str(ROOT / "configs" / "shakespeare_char_30min.yaml"))
    parser.add_argument("--draft-steps", type=int, default=2000, help="the draft's updates (default: 2000)")
    parser.add_argument("--target-steps", type=int, default=1500, help="the target's updates (default: 1500)")
    parser.add_argument("--draft-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override of the draft's run (repeatable)")
    parser.add_argument("--target-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override of the target's run, after its shape (repeatable)")
    parser.add_argument("--draft-model", metavar="DIR", help="a trained draft's model directory (not trained)")
    parser.add_argument("--target-model", metavar="DIR", help="a trained target's model directory (not trained)")
    parser.add_argument("--draft-tokens", default="3,5", help="k values, comma-separated (default: 3,5)")
    parser.add_argument("--rounds", type=int, default=7, help="prompts, one round each (default: 7)")
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens generated per round (default: 200)")
    parser.add_argument("--prompt-chars", type=int, default=16, help="characters of each prompt (default: 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, training and timing (default: 1)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here two tiny models of 2 updates")
    args = parser.parse_args(argv)
    if args.smoke:
        tiny = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "train.max_tokens=256",
                "train.valid_every=2"]
        with smoke_dir("speculative") as tmp:
            return main(["--out", str(tmp), "--text", str(tiny_text(tmp / "text.txt.gz")), "--draft-steps", "2",
                         "--target-steps", "2", "--rounds", "2", "--new-tokens", "12", "--threads", "1",
                         *[a for s in tiny for a in ("--draft-set", s)],
                         *[a for s in tiny for a in ("--target-set", s)]])
    args.draft_tokens = [int(k) for k in args.draft_tokens.split(",") if k]
    if min([args.rounds, args.new_tokens, args.prompt_chars, *args.draft_tokens]) < 1:
        parser.error("--rounds, --new-tokens, --prompt-chars and --draft-tokens must be positive")
    import torch

    torch.set_num_threads(args.threads)
    draft = Path(args.draft_model) if args.draft_model else \
        train("draft", args.draft_config, args.draft_steps, args.draft_set, args)
    target = Path(args.target_model) if args.target_model else \
        train("target", args.target_config, args.target_steps, TARGET_SHAPE + args.target_set, args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    made = {"draft": {"model": str(draft)} if args.draft_model else
            {"config": args.draft_config, "set": args.draft_set},
            "target": {"model": str(target)} if args.target_model else
            {"config": args.target_config, "set": TARGET_SHAPE + args.target_set}}
    report = {"draft": {**made["draft"], **summary(draft.parent)},
              "target": {**made["target"], **summary(target.parent)},
              "new_tokens": args.new_tokens, "threads": args.threads, "by_k": measure(target, draft, args)}
    (Path(args.out) / "speculative.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({name: report[name] for name in ("draft", "target")}))
    print(table(report["by_k"]))
    return report


if __name__ == "__main__":
    main()
