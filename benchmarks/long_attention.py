"""What each attention kind buys at length: time and peak memory of one self-attention layer,
forward and backward, against the sequence length, beside eq. (1) computed explicitly and torch's
fused kernel; exponents fitted on n ≥ 2,048; Table 1 of the seeds extended with a measured row per
kind; a log-log figure.

The layer: d_model 256, 4 heads (d_k 64), batch 1, bidirectional (an encoder's; ``--causal`` for a
decoder's, where linformer does not apply). Each point runs in a fresh process (its peak memory is
that process's high-water mark, as viz/table1.py's ``measure_peak_memory`` reads it; the time is
the median of ``--repeats`` passes after a warm-up). A point predicted from the last two to need
more than 70% of the memory available now, or more than ``--max-seconds`` per pass, is not run and
is recorded as such.

    python -m benchmarks.long_attention                      # 256 … 32,768, every kind
    python -m benchmarks.long_attention --lengths 1024 4096 --kinds flash window --out runs/long
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, SMOKE_HELP, smoke_dir

KIND = "speed"  # a speed (and memory) benchmark (benchmarks/__init__.py lists the two groups)
KINDS = {  # name → (model.attention, the cost of one layer as the seeds' Table 1 would write it)
    "eq. (1) explicit": (None, "O(n²·d)"),
    "torch fused (full)": ({"kind": "full"}, "O(n²·d)"),
    "flash": ({"kind": "flash", "q_tile": 256, "k_tile": 256}, "O(n²·d), memory O(n·d)"),
    "window": ({"kind": "window", "window": 256}, "O(n·w·d)"),
    "longformer": ({"kind": "longformer", "window": 256, "global_tokens": 1}, "O(n·(w+g)·d)"),
    "bigbird": ({"kind": "bigbird", "block_size": 64, "random_blocks": 3, "global_blocks": 1}, "O(n·(4+r)·b·d)"),
    "linformer": ({"kind": "linformer", "proj_len": 256}, "O(n·k·d)"),
    "performer": ({"kind": "performer", "features": 256}, "O(n·m·d)"),
}
D_MODEL, HEADS = 256, 4


def measure(kind: str, n: int, repeats: int, causal: bool) -> dict:
    """One point, in this process: median seconds of forward + backward, and the peak memory growth."""
    import statistics

    import torch

    from atencion.config import ModelConfig
    from atencion.nn.attention import MultiHeadAttention
    from atencion.nn.kinds import make_kind
    from atencion.viz.table1 import measure_peak_memory

    torch.manual_seed(0)
    attention, _ = KINDS[kind]
    cfg = ModelConfig(vocab_size=8, d_model=D_MODEL, n_heads=HEADS, max_positions=max(n, 256),
                      arch="decoder" if causal else "encoder", attention=attention)
    layer = MultiHeadAttention(D_MODEL, HEADS, kind=make_kind(cfg, causal, 0))
    explicit = attention is None
    x = torch.randn(1, n, D_MODEL, requires_grad=True)
    mask = None
    if causal and layer.kind is None:
        from atencion.nn.attention import causal_mask

        mask = causal_mask(n)
    times: list[float] = []

    def step():
        start = time.perf_counter()
        out, _ = layer(x, mask=mask, need_weights=explicit)
        out.sum().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)

    step()  # warm-up
    times.clear()
    peak = measure_peak_memory(step)
    for _ in range(repeats - 1):
        step()
    return {"kind": kind, "n": n, "seconds": statistics.median(times), "peak_bytes": peak, "repeats": repeats}


def available_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def predict(points: list[dict], n: int, key: str) -> float | None:
    """``key`` at length n from the last two measured points' power law (None with fewer)."""
    done = [p for p in points if p.get(key)]
    if len(done) < 2:
        return None
    (n0, y0), (n1, y1) = [(p["n"], p[key]) for p in done[-2:]]
    slope = max(1.0, math.log(y1 / y0) / math.log(n1 / n0)) if y1 > 0 and y0 > 0 else 2.0
    return y1 * (n / n1) ** slope


def fit(points: list[dict], key: str, smallest: int = 2048) -> float | None:
    from atencion.viz.table1 import fit_exponent

    usable = [p for p in points if p["n"] >= smallest and p.get(key)]
    if len(usable) < 2:
        return None
    return fit_exponent([p["n"] for p in usable], [p[key] for p in usable])


def figure(results: dict[str, list[dict]], path: Path, causal: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    for kind, points in results.items():
        done = [p for p in points if p.get("seconds")]
        if done:
            t_ax.loglog([p["n"] for p in done], [p["seconds"] for p in done], "o-", label=kind, base=2)
            m_ax.loglog([p["n"] for p in done], [p["peak_bytes"] / 2**20 for p in done], "o-", label=kind, base=2)
    t_ax.set(xlabel="sequence length n", ylabel="seconds, forward + backward", title="time")
    m_ax.set(xlabel="sequence length n", ylabel="peak memory growth (MiB)", title="memory")
    t_ax.legend(fontsize=8)
    fig.suptitle(f"one {'causal' if causal else 'bidirectional'} self-attention layer, d_model {D_MODEL}, "
                 f"{HEADS} heads, batch 1 (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results: dict[str, list[dict]]) -> str:
    """Table 1 extended: the seeds' cost per layer beside the measured exponents and figures."""
    lines = ["| layer | cost per layer | time exponent (n ≥ 2,048) | memory exponent | s at 8,192 | s at 16,384 | "
             "MiB at 8,192 | longest run |", "|---|---|---|---|---|---|---|---|"]

    def at(points, n, key, scale=1.0, fmt="{:.3f}"):
        p = next((p for p in points if p["n"] == n), None)
        if p is None:
            return "—"
        return fmt.format(p[key] / scale) if p.get(key) else p.get("skipped", "—")

    for kind, points in results.items():
        longest = max((p["n"] for p in points if p.get("seconds")), default=0)
        exponents = [fit(points, key) for key in ("seconds", "peak_bytes")]
        lines.append(f"| {kind} | {KINDS[kind][1]} | " + " | ".join("—" if e is None else f"{e:.2f}" for e in exponents)
                     + f" | {at(points, 8192, 'seconds')} | {at(points, 16384, 'seconds')} | "
                     f"{at(points, 8192, 'peak_bytes', 2**20, '{:.0f}')} | {longest:,} |")
    return "\n".join(lines)


def ratios(results: dict[str, list[dict]]) -> list[str]:
    """The issue's targets as ratios measured in this run."""
    def value(kind, n, key):
        return next((p.get(key) for p in results.get(kind, []) if p["n"] == n), None)

    out = []
    flash, explicit = value("flash", 8192, "peak_bytes"), value("eq. (1) explicit", 8192, "peak_bytes")
    if flash and explicit:
        out.append(f"flash / eq. (1) explicit peak memory at 8,192: {flash / explicit:.3f} (target <= 0.1)")
    for kind in ("flash", "window", "linformer", "performer"):
        mine, fused = value(kind, 16384, "seconds"), value("torch fused (full)", 16384, "seconds")
        if mine and fused:
            out.append(f"torch fused / {kind} time at 16,384: {fused / mine:.2f}x" +
                       (" (target >= 5x)" if kind == "window" else ""))
    explicit_32k = next((p for p in results.get("eq. (1) explicit", []) if p["n"] == 32768), None)
    flash_32k = value("flash", 32768, "seconds")
    if explicit_32k is not None:
        out.append(f"at 32,768: eq. (1) explicit {explicit_32k.get('skipped', 'ran')}; flash "
                   f"{'ran in %.1f s' % flash_32k if flash_32k else 'did not run'}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2 ** i for i in range(8, 16)])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS), metavar="KIND")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="skip a point predicted slower per pass")
    parser.add_argument("--causal", action="store_true", help="a decoder's layer (linformer is left out)")
    parser.add_argument("--out", type=Path, default=Path("runs/long_attention"))
    parser.add_argument("--point", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)  # one point, this process
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here two kinds at 64 and 128")
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("long_attention") as tmp:
            return main(["--lengths", "64", "128", "--kinds", "eq. (1) explicit", "torch fused (full)",
                         "--repeats", "1", "--out", str(tmp)])
    if args.point:
        print(json.dumps(measure(args.point[0], int(args.point[1]), args.repeats, args.causal)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.kinds if not (args.causal and k == "linformer")]
    results: dict[str, list[dict]] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    for kind in kinds:
        points = results.setdefault(kind, [])
        for n in sorted(args.lengths):
            memory, seconds = predict(points, n, "peak_bytes"), predict(points, n, "seconds")
            if points and points[-1].get("skipped"):
                skipped = points[-1]["skipped"]
            elif memory and memory > 0.7 * available_bytes():
                skipped = f"does not fit: ~{memory / 2**30:.0f} GiB predicted"
            elif seconds and seconds > args.max_seconds:
                skipped = f"not run: ~{seconds:.0f} s per pass predicted"
            else:
                skipped = None
            if skipped:
                points.append({"kind": kind, "n": n, "skipped": skipped})
                print(f"{kind:>20} n={n:>6}: {skipped}", flush=True)
                continue
            command = [sys.executable, "-m", "benchmarks.long_attention", "--point", kind, str(n), "--repeats",
                       str(args.repeats)]
            done = subprocess.run(command + (["--causal"] if args.causal else []), capture_output=True, text=True,
                                  env=env, cwd=ROOT)
            if done.returncode != 0:
                reason = "killed (out of memory)" if done.returncode < 0 else done.stderr.strip().splitlines()[-1]
                points.append({"kind": kind, "n": n, "skipped": reason})
                print(f"{kind:>20} n={n:>6}: {reason}", flush=True)
                continue
            point = json.loads(done.stdout.strip().splitlines()[-1])
            points.append(point)
            print(f"{kind:>20} n={n:>6}: {point['seconds']:.4f} s, {point['peak_bytes'] / 2**20:.0f} MiB", flush=True)
        (args.out / "long_attention.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    figure(results, args.out / "long_attention.png", args.causal)
    print()
    print(report(results))
    print()
    for line in ratios(results):
        print(line)
    print(f"\nthreads: {os.environ.get('OMP_NUM_THREADS', 'torch default')}; written: {args.out}/long_attention.json, "
          f"long_attention.png")


if __name__ == "__main__":
    main()
