"""Long-context language modelling with each attention kind: the character-level GPT of
configs/shakespeare_long.yaml (4 layers, 4 heads, d_model 128, RoPE, blocks of 1,024 characters of
Tiny Shakespeare) trained once per ``model.attention.kind`` for the same wall-clock budget; then,
per kind, validation loss against time, the final validation loss, the loss by position within
the block (does a token far into the block gain from the context before it?), and the resident
memory of generating 10× the block token by token with the key/value cache (a sliding window's
cache stays ``window`` keys long and the causal Performer's running sums one size; full
attention's cache grows with the text).

    python -m benchmarks.long_context --minutes 10                      # every kind, 10 minutes each
    python -m benchmarks.long_context --minutes 10 --kinds full,window --attention window.window=128
    python -m benchmarks.long_context --minutes 0.2 --kinds full,flash --generate-kinds full,flash \\
        --set data.block_size=128 --set model.max_positions=128 --set train.max_tokens=512 --out runs/lc-smoke

Linformer is left out: it projects the keys along the whole length, so no query can be kept from
the future, and the config refuses it for a decoder. A budget of wall-clock time favours the fast
kinds, as it should; each run also records its updates and tokens/s, so a reader on another
machine can compare by updates instead. The budget counts validation too (the trainer's clock),
so a slow kind also validates slowly. A run that finished with the same command is reused; a run
directory left by other settings is refused.

The loss by position reads the validation text (the run's held-out tail) in whole, non-overlapping
blocks of the training length, as ``atencion evaluate`` scores a language model (``lm_scores``),
and keeps each position's loss apart: position p is predicted from the p + 1 characters before it
in its block. Prints a table, writes OUT/long_context.json and OUT/long_context.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from benchmarks.common import DATA, ROOT, SMOKE_HELP, TINY_MODEL, finished, smoke_dir, tiny_text

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
DEFAULT_KINDS = ("full", "flash", "window", "longformer", "bigbird", "performer")


# training --------------------------------------------------------------------------------------

def train_command(kind: str, args) -> list[str]:
    """The `atencion train` command of one kind's run."""
    run = Path(args.out) / kind
    command = [sys.executable, "-m", "atencion", "train", args.config, "--out", str(run),
               f"--set=model.attention.kind={kind}", f"--set=train.time_limit_minutes={args.minutes}",
               f"--set=data.train_text={args.text}", f"--set=train.threads={args.threads}"]
    command += [f"--set=model.attention.{key}={value}" for key, value in args.attention.get(kind, {}).items()]
    return command + [f"--set={item}" for item in args.set]


def train_kind(kind: str, args) -> Path:
    """Train ``kind`` (or reuse the finished run of the same command); its run directory."""
    run = Path(args.out) / kind
    command = train_command(kind, args)
    mark = run / "long_context_command.json"
    if run.exists():
        if finished(run) and mark.is_file() and json.loads(mark.read_text())["command"][1:] == command[1:]:
            return run
        raise SystemExit(f"{run} holds a run of other settings or an unfinished one; remove it or give another --out")
    subprocess.run(command, check=True)
    mark.write_text(json.dumps({"command": command}) + "\n", encoding="utf-8")
    return run


def read_run(run: Path) -> dict:
    """What the trainer logged (log.jsonl): the validation curve, updates, minutes, tokens/s."""
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    summary = [r["summary"] for r in records if "summary" in r][-1]
    curve = [(round(r["seconds"] / 60, 3), r["step"], round(r["valid_loss"], 4)) for r in records if "valid_loss" in r]
    return {"updates": summary["steps"], "minutes": round(summary["seconds"] / 60, 2), "tok_s": summary["tok_s"],
            "stopped_by": summary["stopped_by"], "final_valid_loss": curve[-1][2],
            "best_valid_loss": min(c[2] for c in curve), "best_step": summary["best_step"], "valid_curve": curve}


# loss by position ------------------------------------------------------------------------------

def position_losses(model, stream, block_size: int, batch_blocks: int):
    """Mean next-token loss at each position 0 … block_size − 1 of the whole, non-overlapping
    blocks of ``stream`` (lm_scores' blocks, without its shorter last one), (block_size,)."""
    import torch
    import torch.nn.functional as F

    from atencion.data.text import lm_blocks
    from atencion.tasks.base import evaluating, model_device

    blocks = lm_blocks(stream.numel(), block_size)
    if not blocks:
        raise SystemExit(f"the validation text has {stream.numel()} tokens, fewer than one block of {block_size} + 1")
    total = torch.zeros(block_size, dtype=torch.float64)
    with evaluating(model):
        for i in range(0, len(blocks), batch_blocks):
            rows = torch.stack([stream[s: s + n + 1] for s, n in blocks[i: i + batch_blocks]]).to(model_device(model))
            logits = model(rows[:, :-1]).float()
            loss = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none")  # (rows, block)
            total += loss.sum(0).double().cpu()
    return total / len(blocks)


def evaluate_positions(run: Path, buckets: list[int], batch_tokens: int) -> dict:
    """The best model of ``run`` on its validation text: loss per position and per bucket of positions."""
    import torch
    import yaml

    from atencion.data.text import read_text, split_tail
    from atencion.nn.model_dir import load_model_dir
    from atencion.tasks.base import evaluating
    from atencion.tasks.lm import lm_scores, text_stream

    config = yaml.safe_load((run / "config.yaml").read_text())
    block, data = config["data"]["block_size"], config["data"]
    lines = read_text(data["valid_text"], "data.valid_text") if data.get("valid_text") else \
        split_tail(read_text(data["train_text"], "data.train_text"), data["valid_fraction"])[1]
    model, tokenizer = load_model_dir(run / "best")
    stream = torch.tensor(text_stream(lines, tokenizer), dtype=torch.long)
    batch_blocks = max(1, batch_tokens // block)
    per_position = position_losses(model, stream, block, batch_blocks)
    # the same predictions as lm_scores (atencion evaluate) on the first whole blocks: a check of the alignment
    head = stream[: min(2, (stream.numel() - 1) // block) * block + 1]
    with evaluating(model):
        reference = lm_scores(model, head, block, batch_blocks, "cpu")["loss"]
    mine = float(position_losses(model, head, block, batch_blocks).mean())
    if abs(mine - reference) > 1e-4 * max(1.0, reference):
        raise SystemExit(f"{run}: loss by position ({mine:.6f}) disagrees with lm_scores ({reference:.6f})")
    edges = [b for b in buckets if b < block] + [block]
    by_bucket = {f"{a}-{b - 1}": round(float(per_position[a:b].mean()), 4) for a, b in zip(edges, edges[1:])}
    return {"block_size": block, "blocks": stream.numel() // block, "loss_whole_blocks": round(float(
        per_position.mean()), 4), "by_bucket": by_bucket, "per_position": [round(float(x), 4) for x in per_position]}


# generation with a cache -----------------------------------------------------------------------

def resident_mib() -> float:
    """This process's resident memory (Linux /proc/self/status VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def cache_mib(state) -> float:
    """The bytes held by the self-attention caches of a decoding state (keys, values or running sums), MiB."""
    import torch

    seen, total = set(), 0
    for cache in state.self_caches:
        for value in [*vars(cache).values(), *vars(getattr(cache, "state", None) or cache).values()]:
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total / 2 ** 20


def generation_memory(run: Path, tokens: int, every: int, seed: int, threads: int) -> dict:
    """``measure_generation`` in a fresh process, so that the resident memory is the model's and
    the generation's only (what training or evaluating freed would otherwise be reused first)."""
    command = [sys.executable, "-m", "benchmarks.long_context", "--measure-generation", str(Path(run).resolve()),
               f"--generate-tokens={tokens}", f"--every={every}", f"--seed={seed}", f"--threads={threads}"]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout)


def measure_generation(run: Path, tokens: int, every: int, seed: int) -> dict:
    """Sample ``tokens`` tokens one at a time from a line break with the model's cache
    (init_state, decode_step, choose_next: what `atencion generate` runs) and record, every
    ``every`` tokens, the resident memory, the caches' own size and the speed."""
    import torch

    from atencion.decode.sample import choose_next
    from atencion.nn.model_dir import load_model_dir
    from atencion.tasks.base import evaluating
    from atencion.tasks.lm import prompt_ids

    model, tokenizer = load_model_dir(run / "best")
    generator = torch.Generator().manual_seed(seed)
    points, text = [], deque(maxlen=200)  # the sample's end: nothing that grows with the text
    with evaluating(model):
        state = model.init_state()
        logits = model.decode_step(torch.tensor([prompt_ids(tokenizer, "")]), state)[:, -1]
        points.append({"tokens": 0, "rss_mib": round(resident_mib(), 1), "cache_mib": round(cache_mib(state), 2)})
        began = time.perf_counter()
        for step in range(1, tokens + 1):
            token = choose_next(logits, 1.0, 0, 1.0, generator)
            text.append(int(token))
            logits = model.decode_step(token[:, None], state)[:, -1]
            if step % every == 0 or step == tokens:  # tok_s: over the tokens since the last point
                now = time.perf_counter()
                points.append({"tokens": step, "rss_mib": round(resident_mib(), 1),
                               "cache_mib": round(cache_mib(state), 2),
                               "tok_s": round((step - points[-1]["tokens"]) / (now - began), 1)})
                began = now
    return {"points": points, "sample_end": tokenizer.decode(list(text))}


# the report ------------------------------------------------------------------------------------

def table(report: dict) -> str:
    buckets = sorted({b for r in report["runs"].values() for b in r["positions"]["by_bucket"]},
                     key=lambda b: int(b.split("-")[0]))
    head = ["kind", "updates", "minutes", "tok/s", "final valid", "best valid", *[f"pos {b}" for b in buckets]]
    rows = [head]
    for kind, r in report["runs"].items():
        by = r["positions"]["by_bucket"]
        rows.append([kind, str(r["updates"]), f"{r['minutes']:.2f}", str(r["tok_s"]), f"{r['final_valid_loss']:.4f}",
                     f"{r['best_valid_loss']:.4f}", *[f"{by[b]:.4f}" if b in by else "-" for b in buckets]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    for kind, g in report["generation"].items():
        series = ", ".join(f"{p['tokens']}: {p['rss_mib']:.1f}" for p in g["points"])
        lines.append(f"generation, {kind}: resident MiB by tokens generated {{{series}}}; caches "
                     f"{g['points'][0]['cache_mib']:.2f} → {g['points'][-1]['cache_mib']:.2f} MiB, "
                     f"{g['points'][1]['tok_s']:.0f} → {g['points'][-1]['tok_s']:.0f} tokens/s")
    return "\n".join(lines)


def figure(report: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = 3 if report["generation"] else 2
    fig = Figure(figsize=(5.2 * panels, 4.2))
    curve, positions = fig.add_subplot(1, panels, 1), fig.add_subplot(1, panels, 2)
    colours = {kind: f"C{i}" for i, kind in enumerate(report["runs"])}  # one colour per kind in every panel
    for kind, r in report["runs"].items():
        curve.plot([c[0] for c in r["valid_curve"]], [c[2] for c in r["valid_curve"]], marker="o", markersize=3,
                   color=colours[kind], label=f"{kind} ({r['updates']} updates)")
        losses = r["positions"]["per_position"]  # position p is predicted from p + 1 characters
        edges = sorted({round(2 ** (k / 4)) for k in range(4 * int(math.log2(len(losses))) + 1)} | {len(losses) + 1})
        bins = [(a, b) for a, b in zip(edges, edges[1:])]  # context lengths [a, b): a quarter-octave each
        positions.plot([math.sqrt(a * (b - 1)) for a, b in bins], [sum(losses[a - 1:b - 1]) / (b - a) for a, b in bins],
                       color=colours[kind], marker=".", label=kind)
    curve.set_xlabel("minutes of training (the same budget for each kind)")
    curve.set_ylabel("validation loss (nats/char)")
    curve.set_title("Validation loss against time", fontsize=10)
    positions.set_xscale("log", base=2)
    positions.set_xlabel("characters of context (position in the block + 1)")
    positions.set_ylabel("validation loss (nats/char)")
    positions.set_title("Loss against position, best model", fontsize=10)
    for ax in (curve, positions):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if report["generation"]:
        memory = fig.add_subplot(1, panels, 3)
        for kind, g in report["generation"].items():
            memory.plot([p["tokens"] for p in g["points"]], [p["rss_mib"] for p in g["points"]], marker="o",
                        markersize=3, color=colours[kind], label=kind)
        memory.axvline(report["block_size"], color="grey", linestyle=":", linewidth=1)
        memory.set_xlabel("tokens generated (dotted: the training block)")
        memory.set_ylabel("resident memory (MiB)")
        memory.set_title("Generating with the key/value cache", fontsize=10)
        memory.grid(alpha=0.3)
        memory.legend(fontsize=8)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def parse_attention(items: list[str], parser) -> dict[str, dict[str, str]]:
    """``--attention KIND.KEY=VALUE`` items as {kind: {key: value}}."""
    settings: dict[str, dict[str, str]] = {}
    for item in items:
        name, _, value = item.partition("=")
        kind, _, key = name.partition(".")
        if not (kind and key and value):
            parser.error(f"--attention {item!r}: expected KIND.KEY=VALUE, e.g. window.window=128")
        settings.setdefault(kind, {})[key] = value
    return settings


def main(argv: list[str] | None = None) -> dict:
    import atencion.nn  # noqa: F401  (the attention kinds are in ATTENTION_KINDS once nn/ is imported)
    from atencion.config import ATTENTION_KINDS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/long_context", help="one run directory per kind is made here")
    parser.add_argument("--config", default=str(ROOT / "configs" / "shakespeare_long.yaml"))
    parser.add_argument("--text", default=str(DATA / "tinyshakespeare" / "input.txt.gz"),
                        help="the training text (data.train_text; the validation text is its last 10%%)")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="comma-separated attention kinds")
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget per kind (default: 10)")
    parser.add_argument("--attention", action="append", default=[], metavar="KIND.KEY=VALUE",
                        help="a setting of one kind, e.g. window.window=128 (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run, e.g. data.block_size=128 (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default: 1)")
    parser.add_argument("--buckets", default="0,64,256,512", help="first positions of the position buckets")
    parser.add_argument("--generate-kinds", default="window,performer,full",
                        help="kinds whose models generate --generate-tokens tokens with the cache (of those trained)")
    parser.add_argument("--generate-tokens", type=int, default=0,
                        help="tokens to generate (default: 10 × the block)")
    parser.add_argument("--every", type=int, default=0, help="record memory every N tokens (default: the block)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--measure-generation", metavar="RUN_DIR",
                        help="only generate with RUN_DIR/best and print the memory series as JSON (the benchmark "
                             "runs this in a fresh process per kind)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here full attention only")
    args = parser.parse_args(argv)
    if args.smoke:
        sets = [*TINY_MODEL, "data.block_size=32", "model.max_positions=32", "train.max_tokens=128",
                "train.max_steps=3", "train.valid_every=3", "train.log_every=1"]
        with smoke_dir("long_context") as tmp:
            return main(["--out", str(tmp / "runs"), "--text", str(tiny_text(tmp / "text.txt.gz")), "--kinds", "full",
                         "--minutes", "1", "--buckets", "0,8,16", "--generate-kinds", "full", "--generate-tokens",
                         "40", "--every", "20", *[a for s in sets for a in ("--set", s)]])
    if args.measure_generation:
        import torch

        torch.set_num_threads(args.threads)
        report = measure_generation(Path(args.measure_generation), args.generate_tokens, args.every or 1024, args.seed)
        print(json.dumps(report))
        return report
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; expected some of {list(ATTENTION_KINDS)}")
    if "linformer" in kinds:
        parser.error("--kinds: linformer projects the keys along the whole length, so it cannot be causal: it is "
                     "for encoders, and this is a language model")
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    args.attention = parse_attention(args.attention, parser)
    buckets = sorted({int(b) for b in args.buckets.split(",")} | {0})
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch

    torch.set_num_threads(args.threads)
    report: dict = {"minutes": args.minutes, "config": args.config, "set": args.set, "attention": args.attention,
                    "runs": {}, "generation": {}}
    runs = {}
    for kind in kinds:
        runs[kind] = train_kind(kind, args)
        report["runs"][kind] = {**read_run(runs[kind]), "positions": evaluate_positions(runs[kind], buckets, 4096)}
        report["block_size"] = report["runs"][kind]["positions"]["block_size"]
        print(json.dumps({kind: {k: v for k, v in report["runs"][kind].items() if k != "positions"}}), file=sys.stderr)
    block = report["block_size"]
    tokens, every = args.generate_tokens or 10 * block, args.every or block
    for kind in [k for k in args.generate_kinds.split(",") if k in runs]:
        report["generation"][kind] = generation_memory(runs[kind], tokens, every, args.seed, args.threads)
    out = Path(args.out)
    (out / "long_context.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    figure(report, out / "long_context.png")
    print(table(report))
    return report


if __name__ == "__main__":
    main()
