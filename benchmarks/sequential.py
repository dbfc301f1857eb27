"""Table 1's middle column, measured: a training step's time against sentence length for the RNN
encoder-decoder and for the Transformer on this CPU (docs/rnn.md, experiment 3).

    python -m benchmarks.sequential --threads 2 --figure docs/figures/rnn_step_time.png

Each model trains (forward, backward, Adam) on batches of a fixed number of target tokens
(--tokens: batch × length is the same at every length, as token batching makes it), source and
target of one length, random tokens. The RNN needs one sequential operation per token (O(n)), the
Transformer a constant number (O(1)) but a self-attention of n² per layer. Per length and model
it prints the median of --repeats steps (after one warm-up step), in milliseconds per step and
microseconds per target token. The models: the ladder's GRU + Bahdanau attention (bidirectional
encoder of 2×128, decoder 256), the GRU without attention (encoder and decoder 256: the fused
kernel over the whole target), and Transformer-Tiny (4+4 layers, d_model 128), all with a
10,000-piece vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import SMOKE_HELP, smoke_dir

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)
MODELS = {
    "gru_bahdanau": dict(arch="rnn", d_model=128, n_layers=1, rnn=dict(hidden=128, decoder_hidden=256)),
    "gru_none": dict(arch="rnn", d_model=128, n_layers=1,
                     rnn=dict(bidirectional=False, hidden=256, decoder_hidden=256, attention="none")),
    "transformer_tiny": dict(n_layers=4, d_model=128, d_ff=256, n_heads=4),
}


def step_times(name: str, lengths: list[int], tokens: int, repeats: int) -> list[float]:
    import torch

    from atencion import ModelConfig
    from atencion.nn.model_dir import build_model
    from atencion.tasks.loss import generator_loss

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=10000, dropout=0.1, **MODELS[name])).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    for length in lengths:
        rows = max(1, tokens // length)
        src = torch.randint(4, 10000, (rows, length))
        tgt = torch.randint(4, 10000, (rows, length + 1))
        tgt[:, 0] = 2
        measured = []
        for k in range(repeats + 1):
            start = time.perf_counter()
            hidden = model(src, tgt[:, :-1], select=tgt[:, 1:] != 0, project=False)
            loss, _ = generator_loss(hidden, model.generator.weight, model.generator.bias, tgt[:, 1:], 0, 0.1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if k:  # the first step warms up the allocator and kernels
                measured.append(time.perf_counter() - start)
        times.append(statistics.median(measured))
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8,16,32,64,128,256", help="sentence lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=4096, help="target tokens per batch (default: 4096)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per length (default: 5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--figure", help="write the plot here (PNG)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("sequential") as tmp:
            return main(["--lengths", "4,8", "--tokens", "32", "--repeats", "1", "--threads", "1",
                         "--figure", str(tmp / "step_time.png")])
    import torch

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {"lengths": lengths, "tokens": args.tokens, "threads": args.threads,
              "ms_per_step": {name: [round(1000 * t, 1) for t in step_times(name, lengths, args.tokens, args.repeats)]
                              for name in MODELS}}
    print("| length | " + " | ".join(f"{n} ms/step" for n in MODELS) + " |")
    print("|---|" + "---|" * len(MODELS))
    for i, length in enumerate(lengths):
        print(f"| {length} | " + " | ".join(str(result["ms_per_step"][n][i]) for n in MODELS) + " |")
    if args.figure:
        from atencion.viz.plots import line_figure, save

        series = {name: (lengths, values) for name, values in result["ms_per_step"].items()}
        save(line_figure(series, "sentence length (tokens, source = target)",
                         f"ms per training step ({args.tokens} target tokens)",
                         f"training step time on this CPU ({args.threads} threads)", log_x=True, log_y=True),
             args.figure)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
