"""``atencion kernels``: the decoding kernels of this CPU (atencion/nn/matvec.py, matvec.cpp). ``build``
compiles them now (once per CPU; otherwise the first decoding, or the server's start, does);
``status`` says what is built, for which CPU, and which product each shape and number of rows uses and
why; ``benchmark`` times the kernels against F.linear per shape and rows, records the choice (the
record later processes read) and prints it as a table.

torch is imported inside the functions: ``atencion --help`` does not load it."""

from __future__ import annotations

import argparse

from .errors import AtencionError

# SmolLM-135M's products (d_model 576, 9 heads and 3 key/value heads of 64, d_ff 1536): W^QKV, W^O, W1 and W3, W2
DEFAULT_SHAPES = "960x576,576x576,1536x576,576x1536"


def add_kernels_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("build", help="compile the kernels for this CPU now (once, about a minute)",
                       description="Compile the decoding kernels for this CPU now (once, about a minute).")
    actions.add_parser("status", help="what is built, for which CPU, and what each shape uses and why",
                       description="What is built, for which CPU flags, and what each shape uses and why.")
    bench = actions.add_parser("benchmark", help="time the kernels against F.linear per shape; record the choice",
                               description="Time the kernels against F.linear per weight shape and number of "
                                           "rows, record the faster (later processes use it) and print a table.")
    bench.add_argument("--model", help="a model directory: its weight shapes (default: --shapes)")
    bench.add_argument("--shapes", default=DEFAULT_SHAPES,
                       help=f"weight shapes NxK, comma-separated (default: SmolLM-135M's, {DEFAULT_SHAPES})")
    bench.add_argument("--rows", default="1,5,16", help="numbers of rows, comma-separated, 1 to 16 (default: 1,5,16)")
    bench.add_argument("--threads", type=int, default=0, help="torch's threads (default: torch's own)")


def _ints(text: str, what: str, sep: str = ",") -> list[int]:
    try:
        return [int(v) for v in text.split(sep) if v.strip()]
    except ValueError:
        raise AtencionError(f"{what}: expected integers separated by {sep!r}, got {text!r}") from None


def _row(n: int, k: int, rows: int, threads: int, timing: tuple[float, float] | None, won: bool) -> str:
    if timing is None:
        return f"{n}x{k:<10} {rows:>4} {threads:>7} {'':>10} {'':>11}  {'kernel' if won else 'F.linear'}"
    ours, theirs = timing
    why = f"{theirs / ours:.2f}× faster" if won else f"F.linear {ours / theirs:.2f}× faster"
    return (f"{n}x{k:<10} {rows:>4} {threads:>7} {ours * 1e6:>10.1f} {theirs * 1e6:>11.1f}  "
            f"{'kernel' if won else 'F.linear'} ({why})")


HEADER = f"{'shape':<12} {'rows':>4} {'threads':>7} {'kernel µs':>10} {'F.linear µs':>11}  uses"


def cmd_kernels(args: argparse.Namespace) -> None:
    """The decoding kernels of this CPU: build them, show what is built and used, or benchmark them."""
    from .nn import matvec

    kernels = matvec.KERNELS
    if args.action == "status":
        _status(kernels)
        return
    if kernels.load() is None:
        raise AtencionError(f"the decoding kernels cannot be loaded here: {kernels.reason}; decoding on the CPU "
                            f"uses F.linear")
    if args.action == "build":
        print(f"built for this CPU ({kernels.for_cpu.model}; {kernels.for_cpu.vectors}): {kernels.directory}")
        return
    _benchmark(kernels, args)


def _status(kernels) -> None:
    """What is built, for which CPU, which kernels it holds, the policy, and each measured choice."""
    loaded = kernels.load(build=False)
    cpu = kernels.for_cpu
    print(f"cpu: {cpu.model}; vector instructions: {cpu.vectors}")
    print(f"build: {kernels.directory} ({'built' if loaded is not None else kernels.reason})")
    if loaded is not None:
        simd = kernels.module.simd
        print(f"kernels: dot products{', panels, attention, whole decoding step' if simd else ''} "
              f"({'AVX-512' if simd == 16 else 'AVX2' if simd == 8 else 'no SIMD'}); int8 panels "
              f"{'from ' + str(kernels.int8_panels_from) + ' rows' if kernels.matmul_int8_panels else 'none'}")
    policy = {"measured": "where measured faster than F.linear (ATENCION_MATVEC unset)",
              "always": "wherever they apply (ATENCION_MATVEC=1)",
              "off": "never (ATENCION_MATVEC=0)"}.get(kernels.policy or "", "not loaded")
    print(f"used: {policy}")
    if kernels.choices:
        print(HEADER)
        for (n, k, rows, threads), won in sorted(kernels.choices.items()):
            print(_row(n, k, rows, threads, kernels.timings.get((n, k, rows, threads)), won))
    elif loaded is not None:
        print("no shape measured yet: each is, the first time it is decoded (or: atencion kernels benchmark)")


def _shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The weight shapes to time: --model's products, else --shapes."""
    from .nn import matvec

    if args.model:
        from .nn.model_dir import load_model_dir

        return matvec.shapes_of(load_model_dir(args.model, "cpu")[0])
    shapes = [tuple(_ints(shape, "--shapes", "x")) for shape in args.shapes.split(",") if shape.strip()]
    if not shapes or not all(len(s) == 2 and min(s) > 0 for s in shapes):
        raise AtencionError(f"--shapes: expected NxK,... (e.g. {DEFAULT_SHAPES}), got {args.shapes!r}")
    return shapes


def _benchmark(kernels, args: argparse.Namespace) -> None:
    """Time each shape at each number of rows, record the choice, print the table as it goes."""
    import torch

    from .nn import matvec

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = _ints(args.rows, "--rows")
    if not rows or not all(1 <= r <= matvec.PANEL_ROWS for r in rows):
        raise AtencionError(f"--rows: expected numbers from 1 to {matvec.PANEL_ROWS}, got {args.rows!r}")
    shapes = _shapes(args)
    print(HEADER)
    threads = torch.get_num_threads()
    for r in rows:
        if r > matvec.MAX_ROWS and kernels.matmul_panels is None:
            print(f"{r} rows: no panels kernel on this CPU (neither AVX-512 nor AVX2): F.linear")
            continue
        for n, k in shapes:
            won = kernels.measure(n, k, r, again=True)
            print(_row(n, k, r, threads, kernels.timings[n, k, r, threads], won), flush=True)
