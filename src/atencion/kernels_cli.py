"""``atencion kernels``: the decoding kernels of this CPU (atencion/nn/matvec.py, matvec.cpp). ``build``
compiles them now (once per CPU; otherwise the first decoding, or the server's start, does);
``status`` says what is built, for which CPU, and which product each shape and number of rows uses and
why; ``benchmark`` times the kernels against F.linear per shape and rows, records the choice (the
record later processes read) and prints it as a table.

Also ``compare_compile``, the fused decoding step against ``torch.compile`` of the plain one (a
measurement to run alone: ``python -m atencion.kernels_cli compile``). torch is imported inside the
functions: ``atencion --help`` does not load it."""

from __future__ import annotations

import argparse
import time

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


def compare_compile(batches: tuple[int, ...] = (1, 16), steps: int = 32, layers: int = 30, d_model: int = 576,
                    heads: int = 9, kv_heads: int = 3, d_ff: int = 1536, vocab: int = 49152) -> None:
    """Milliseconds per decoding step of a Llama-shaped decoder (default SmolLM-135M's shape, random
    weights) at each batch size: the fused step (nn/fused.py, the kernels) against ``torch.compile`` of the
    plain step (inductor, ``freezing`` and ``cpp_wrapper`` where they work; the kernels off inside the graph).
    Printed as it goes; run it alone on the machine (timings of a shared machine mean little)."""
    import os

    import torch

    from .config import ModelConfig
    from .nn import matvec
    from .nn.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder", norm="rmsnorm", norm_first=True, positional="rope", activation="swiglu",
                      bias=False, scale_embedding=False, dropout=0.0, n_layers=layers, d_model=d_model,
                      n_heads=heads, n_kv_heads=kv_heads, d_ff=d_ff, vocab_size=vocab, max_positions=1024)
    model = Transformer(cfg).eval()
    print(f"decoder: {layers} layers, d_model {d_model}, {heads} heads ({kv_heads} kv), d_ff {d_ff}, vocab {vocab}; "
          f"{torch.get_num_threads()} threads; kernels {'loaded' if matvec.kernel() is not None else 'absent'}")

    def run(step, batch: int) -> float:
        ids = torch.randint(4, vocab, (batch, 17), generator=torch.Generator().manual_seed(batch))
        state = model.init_state()
        with torch.no_grad():
            model.decode_step(ids[:, :16], state, last=1)  # the prompt, eager
            token = ids[:, 16:]
            for _ in range(3):  # warm-up (and compilation)
                token = step(token, state)[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(steps):
                token = step(token, state)[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - start) / steps * 1e3

    import torch._inductor.config as inductor

    inductor.freezing = True
    compiled = None
    for cpp_wrapper in (True, False):
        inductor.cpp_wrapper = cpp_wrapper
        try:
            torch._dynamo.reset()
            candidate = torch.compile(model.decode_step, dynamic=True)
            run(candidate, 1)
            compiled, wrapper = candidate, cpp_wrapper
            break
        except Exception as err:  # report and try without cpp_wrapper
            print(f"torch.compile with cpp_wrapper={cpp_wrapper} failed: {str(err).splitlines()[0][:200]}")
    for batch in batches:
        os.environ.pop("ATENCION_FUSED", None)
        fused = run(model.decode_step, batch)
        os.environ["ATENCION_FUSED"] = "0"
        by_layer = run(model.decode_step, batch)
        os.environ.pop("ATENCION_FUSED", None)
        line = f"batch {batch}: fused step {fused:.2f} ms, layer by layer {by_layer:.2f} ms"
        if compiled is not None:
            line += f", torch.compile (cpp_wrapper={wrapper}) {run(compiled, batch):.2f} ms"
        print(line, flush=True)


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="python -m atencion.kernels_cli",
                                     description="compile: the fused step against torch.compile's")
    parser.add_argument("what", choices=["compile"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", default="1,16")
    options = parser.parse_args()
    compare_compile(tuple(_ints(options.batches, "--batches")), options.steps, options.layers)
    sys.exit(0)
