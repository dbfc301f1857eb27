"""How fast torch and atencion multiply one row by a decoder's weights on this CPU: the bandwidth (GB/s of
float32 weights read) of batch-1 generation's matrix products, at each thread count.

A SmolLM-135M-shaped decoder's matrices (30 layers of q/k/v 960 × 576, output 576 × 576, gate and
up 1,536 × 576, down 576 × 1,536: 425 MB, more than any cache, so every pass reads them from
memory), each multiplied by one row (or --rows), by four torch expressions of the same product:
``F.linear(x, W)`` (what Hugging Face runs, and atencion for more than 16 rows), ``torch.mv(W, x)``, ``x @ Wᵀ``
with Wᵀ stored contiguous, oneDNN's linear on packed weights (``torch.utils.mkldnn``), and atencion's
own kernels (atencion/nn/matvec.cpp): the dot products decoding on the CPU uses for up to 5 rows, and
the panels' product it uses for 6 to 16 (AVX-512 or AVX2). Median of ``--rounds`` passes;
from 6 rows on the product is bound by arithmetic more than by memory (GFLOP/s = GB/s × rows / 2).
docs/results.md compares the figure with llama.cpp's about 22 GB/s on the same weights
(``benchmarks/speed.py --parts llama``).

    python -m benchmarks.matvec                  # threads 1 and 2
    python -m benchmarks.matvec --threads 1,2,4 --rounds 7
    python -m benchmarks.matvec --rows 5         # a beam of 5
    python -m benchmarks.matvec --rows 16        # a batch of 16
    python -m benchmarks.matvec --int8           # int8 weights: fbgemm's dynamic linear against the int8 kernels
                                                 # (dot products; panels, which int8 decoding uses from
                                                 # 1 row with AVX-512 VNNI, from 3 with AVX2)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from atencion.nn import matvec
from benchmarks.common import SMOKE_HELP

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)
SHAPES = [(960, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # one layer's (out, in)


def bandwidth(products, rounds: int) -> float:
    """GB/s of weights read: ``products`` is a list of (function, weight bytes), run once each per pass."""
    nbytes = sum(size for _, size in products)
    for run, _ in products:  # warm-up
        run()
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for run, _ in products:
            run()
        times.append(time.perf_counter() - began)
    return nbytes / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated (default: 1,2)")
    parser.add_argument("--layers", type=int, default=30, help="layers of matrices (default: 30, SmolLM-135M's)")
    parser.add_argument("--rounds", type=int, default=5, help="timed passes per figure (default: 5)")
    parser.add_argument("--rows", type=int, default=1, help="rows multiplied at once, a beam's (default: 1; "
                        f"at most {matvec.PANEL_ROWS})")
    parser.add_argument("--int8", action="store_true", help="int8 weights (nn/quantize.py's layers): PyTorch's "
                        "dynamic int8 linear (fbgemm) against atencion's int8 kernel; GB/s of int8 weights read")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here one layer, one pass, float32 "
                        "then int8")
    args = parser.parse_args(argv)
    if args.smoke:
        for extra in ([], ["--int8"]):
            main(["--threads", "1", "--layers", "1", "--rounds", "1", *extra])
        return None
    if not 1 <= args.rows <= matvec.PANEL_ROWS:
        parser.error(f"--rows: expected 1 to {matvec.PANEL_ROWS}, got {args.rows}")
    import torch.utils.mkldnn as mkldnn

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=generator) * 0.02 for _ in range(args.layers) for out, inp in SHAPES]
    rows = {inp: torch.randn(args.rows, inp, generator=generator) for _, inp in SHAPES}
    if args.int8:
        return int8_main(args, weights, rows)
    transposed = [w.t().contiguous() for w in weights]
    packed = []
    with torch.no_grad():
        for w in weights:
            layer = torch.nn.Linear(w.size(1), w.size(0), bias=False)
            layer.weight.copy_(w)
            packed.append(mkldnn.to_mkldnn(layer))
    packed_rows = {inp: row.to_mkldnn() for inp, row in rows.items()}
    size = [w.numel() * 4 for w in weights]
    ways = {
        "F.linear(x, W)": [(lambda w=w: F.linear(rows[w.size(1)], w), s) for w, s in zip(weights, size)],
        **({"torch.mv(W, x)": [(lambda w=w: torch.mv(w, rows[w.size(1)][0]), s) for w, s in zip(weights, size)]}
           if args.rows == 1 else {}),
        "x @ Wt (contiguous)": [(lambda t=t: rows[t.size(0)] @ t, s) for t, s in zip(transposed, size)],
        "oneDNN packed linear": [(lambda m=m, w=w: m(packed_rows[w.size(1)]), s)
                                 for m, w, s in zip(packed, weights, size)],
    }
    kernel = matvec.kernel()
    if kernel is None:
        print("atencion's kernel (atencion/nn/matvec.cpp) did not compile here: its row is left out")
    else:
        ways["atencion's matvec kernel"] = [(lambda w=w: kernel(rows[w.size(1)], w, None), s)
                                            for w, s in zip(weights, size)]
        panels_kernel = matvec.KERNELS.matmul_panels
        if panels_kernel is not None:
            laid_out = [matvec.panels(w) for w in weights]
            ways["atencion's panels kernel"] = [(lambda w=w, p=p: panels_kernel(rows[w.size(1)], p, w.size(0), None), s)
                                                for w, p, s in zip(weights, laid_out, size)]
    report(ways, args, f"{sum(size) / 1e6:.0f} MB of float32 weights")


def int8_main(args, weights, rows) -> None:
    import warnings

    from atencion.nn.quantize import Int8Linear

    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao
        warnings.simplefilter("ignore")
        layers = [Int8Linear(w, None) for w in weights]
    size = [layer._int8.numel() for layer in layers]
    ways = {"fbgemm linear_dynamic": [(lambda q=q: torch.ops.quantized.linear_dynamic(rows[q._int8.size(1)], q._packed,
                                                                                      True), s)
                                      for q, s in zip(layers, size)]}
    if matvec.kernel() is None:
        print("atencion's kernel (atencion/nn/matvec.cpp) did not compile here: its row is left out")
    else:
        int8_kernel = matvec.KERNELS.matvec_int8
        ways["atencion's int8 kernel"] = [(lambda q=q: int8_kernel(rows[q._int8.size(1)], q._int8, q._scales, q._sums,
                                                                   None), s)
                                          for q, s in zip(layers, size)]
        if matvec.KERNELS.matmul_int8_panels is not None:
            laid_out = [matvec.int8_panels(q._int8) for q in layers]
            ways["atencion's int8 panels"] = [(lambda q=q, p=p: matvec.KERNELS.matmul_int8_panels(
                rows[q._int8.size(1)], p, q._int8.size(0), q._scales, q._sums, None), s)
                for q, p, s in zip(layers, laid_out, size)]
    report(ways, args, f"{sum(size) / 1e6:.0f} MB of int8 weights")


def report(ways: dict, args, what: str) -> None:
    counts = [int(t) for t in args.threads.split(",") if t]
    print(f"{what}, {args.rows} row{'s' if args.rows > 1 else ''}; GB/s read (median of {args.rounds} passes)"
          + ("" if args.int8 else "; GFLOP/s = GB/s × rows / 2"))
    print(f"{'product':<26}" + "".join(f"{f'{t} thread' + ('s' if t > 1 else ''):>12}" for t in counts))
    with torch.inference_mode():
        for name, products in ways.items():
            figures = []
            for t in counts:
                torch.set_num_threads(t)
                figures.append(bandwidth(products, args.rounds))
            print(f"{name:<26}" + "".join(f"{g:>12.1f}" for g in figures))


if __name__ == "__main__":
    main()
