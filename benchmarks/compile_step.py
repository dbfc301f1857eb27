"""The fused decoding step (nn/fused.py: every layer in one call of atencion's kernels) against
``torch.compile`` of the plain step (inductor, ``freezing``, and ``cpp_wrapper`` where it works) and
against the plain step itself (layer by layer, eager): milliseconds per step of a Llama-shaped decoder,
SmolLM-135M's shape by default, random weights, at each batch size. Issue #53 asked whether the compiled
step comes within 10% of the kernel's, which would retire the C++ (docs/results.md has the answer).

    python -m benchmarks.compile_step [--layers 30] [--steps 32] [--batches 1,16]   # alone on the machine
    python -m benchmarks.compile_step --smoke   # 2 narrow layers, 2 steps: a check, not a result
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import SMOKE_HELP

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)


def compare(batches: tuple[int, ...] = (1, 16), steps: int = 32, layers: int = 30, d_model: int = 576,
                    heads: int = 9, kv_heads: int = 3, d_ff: int = 1536, vocab: int = 49152) -> None:
    """Milliseconds per decoding step of a Llama-shaped decoder (default SmolLM-135M's shape, random
    weights) at each batch size: the fused step (nn/fused.py, the kernels) against ``torch.compile`` of the
    plain step (inductor, ``freezing`` and ``cpp_wrapper`` where they work; the kernels off inside the graph).
    Printed as it goes; run it alone on the machine (timings of a shared machine mean little)."""
    from atencion.config import ModelConfig
    from atencion.nn import matvec
    from atencion.nn.transformer import Transformer

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", default="1,16", help="batch sizes, comma-separated (default: 1,16)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here 2 layers of d_model 64")
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    if args.smoke:
        compare((1,), steps=2, layers=2, d_model=64, heads=4, kv_heads=2, d_ff=128, vocab=256)
    else:
        compare(batches, args.steps, args.layers)


if __name__ == "__main__":
    main()
