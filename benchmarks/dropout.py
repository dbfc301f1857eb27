"""The CPU dropout mask drawn 16 bits at a time (nn/dropout.py's fast_dropout, what atencion's
Dropout runs in training) against torch's own, torch.nn.functional.dropout(x, p, training=True).

    python -m benchmarks.dropout                               # the shapes training uses, a table
    python -m benchmarks.dropout --json                        # one JSON object
    python -m benchmarks.dropout --smoke                      # a look, not a result

Shapes (default): (64, 24, 512), a sub-layer output of a d_model-512 model on a batch of 64
sentences of 24 tokens, and (4096, 512), the same number of tokens packed (the encoder runs its
position-wise layers on the real tokens only); float32, p = 0.1, training mode. Two measurements
per shape: the forward call alone (``forward``) and the forward call with the backward pass of a
gradient of ones (``forward+backward``).

The two run in turn in one process, --rounds times, each round in the other order than the one
before; in a round each runs --reps calls after --warmup untimed ones, and its time is their
mean. The ratio of a round is torch's time over atencion's (above 1: atencion is faster); the
table gives, per shape and measurement, the median ratio over the rounds, their range (lowest
and highest) and their count, with each one's median milliseconds per call. Run it on a quiet
machine: other jobs on the cores move both times and the ratio. ``kept`` is the share of elements
atencion's mask keeps (0.9 expected at p = 0.1), a check that it drops at all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from atencion.nn.dropout import Dropout
from benchmarks.common import SMOKE_HELP

DEFAULT_SHAPES = "64x24x512,4096x512"
KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    shapes = []
    for part in text.split(","):
        try:
            shape = tuple(int(n) for n in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {part!r} is not a shape like 64x24x512") from None
        if not shape or min(shape) < 1:
            raise SystemExit(f"--shapes: {part!r} is not a shape like 64x24x512")
        shapes.append(shape)
    return shapes


def timed(call: Callable[[], None], reps: int, warmup: int) -> float:
    """Mean seconds of one call over ``reps`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps


def engine(drop: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, backward: bool) -> Callable[[], None]:
    """One call of ``drop`` on ``x``: the forward pass alone, or with the backward pass of a gradient of ones."""
    grad = torch.ones_like(x)

    def call() -> None:
        if backward:
            x.grad = None
            drop(x).backward(grad)
        else:
            with torch.no_grad():
                drop(x)
    return call


def measure(shape: tuple[int, ...], p: float, backward: bool, rounds: int, reps: int, warmup: int) -> dict:
    x = torch.randn(shape, requires_grad=backward)
    ours = Dropout(p).train()
    engines = {"atencion": engine(ours, x, backward), "torch": engine(lambda t: F.dropout(t, p, training=True), x,
                                                                        backward)}
    seconds: dict[str, list[float]] = {"atencion": [], "torch": []}
    for r in range(rounds):
        for name in (["atencion", "torch"] if r % 2 == 0 else ["torch", "atencion"]):
            seconds[name].append(timed(engines[name], reps, warmup))
    with torch.no_grad():  # outside the timed calls: the share atencion's mask keeps
        kept = statistics.mean(float((ours(x) != 0).float().mean()) for _ in range(3))
    ratios = [t / a for a, t in zip(seconds["atencion"], seconds["torch"])]
    return {"shape": list(shape), "measure": "forward+backward" if backward else "forward",
            "atencion_ms": round(1e3 * statistics.median(seconds["atencion"]), 3),
            "torch_ms": round(1e3 * statistics.median(seconds["torch"]), 3),
            "ratio_median": round(statistics.median(ratios), 2),
            "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)], "rounds": len(ratios),
            "kept": round(kept, 4)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated, e.g. {DEFAULT_SHAPES} (default)")
    parser.add_argument("--p", type=float, default=0.1, help="drop probability (default 0.1, the paper's)")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds (default 15)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per engine and round (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before each timing (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        return main(["--shapes", "8x4x16", "--rounds", "2", "--reps", "2", "--warmup", "1", "--threads", "1"])
    if args.rounds < 1 or args.reps < 1 or args.warmup < 0 or not 0 < args.p < 1:
        parser.error("--rounds and --reps must be at least 1, --warmup at least 0, --p in (0, 1)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = [measure(shape, args.p, backward, args.rounds, args.reps, args.warmup)
            for shape in parse_shapes(args.shapes) for backward in (False, True)]
    result = {"p": args.p, "threads": torch.get_num_threads(), "torch": torch.__version__, "reps": args.reps,
              "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"dropout p={args.p}, float32, CPU, {result['threads']} thread(s), torch {torch.__version__}; "
              f"ratio = torch's time / atencion's, per round")
        print(f"{'shape':>14} {'measure':>17} {'atencion ms':>12} {'torch ms':>9} {'ratio':>6} {'range':>12} "
              f"{'rounds':>6} {'kept':>6}")
        for r in rows:
            shape = "x".join(map(str, r["shape"]))
            span = f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}"
            print(f"{shape:>14} {r['measure']:>17} {r['atencion_ms']:>12.3f} {r['torch_ms']:>9.3f} "
                  f"{r['ratio_median']:>6.2f} {span:>12} {r['rounds']:>6} {r['kept']:>6.3f}")
    return result


if __name__ == "__main__":
    main()
