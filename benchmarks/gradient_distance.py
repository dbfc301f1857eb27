"""Gradients over distance: ‖∂ o_T / ∂ x_t‖ against T − t for an LSTM and for a self-attention
stack, at initialisation and trained (docs/rnn.md, experiment 4: "los gradientes desaparecen o
explotan").

    python -m benchmarks.gradient_distance --lstm runs/ladder/lstm_none/run/best \\
        --transformer runs/ladder/transformer/run/best --figure docs/figures/rnn_gradients.png

x_t is the token embedding at position t (the input of the encoder, before any position
encoding), o_T the encoder's output at the last position T of a --length token sequence (German
test2016 sentences of Multi30k joined until they fill it). The norm is the Frobenius norm of
the Jacobian ∂ o_T / ∂ x_t (one backward pass per output dimension), averaged over --samples
sequences, in eval mode (no dropout). The LSTM is the encoder of the ladder's ``lstm_none`` (2
layers of 256, unidirectional: o_T has read the tokens one by one), the self-attention stack the
encoder of its Transformer-Tiny (4 layers, bidirectional: o_T reads every token in one step);
"init" is the same architecture freshly initialised (seed 0). Prints the norms at a few
distances as JSON; --figure draws every distance on a log scale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import DATA, SMOKE_HELP, smoke_dir, smoke_requested, tiny_multi30k

KIND = "experiment"  # measures trained models (benchmarks/__init__.py lists the two groups)


def smoke_models(tmp: Path) -> tuple[Path, Path, Path]:
    """Random stand-ins for the ladder's two models (an LSTM of 2 × 16, a 1-layer Transformer of d_model
    16) with a character vocabulary, and a tiny Multi30k-shaped data directory: what --smoke reads."""
    import torch

    from atencion import ModelConfig
    from atencion.data.corpus import read_lines
    from atencion.data.tokenizer import Tokenizer
    from atencion.nn.model_dir import build_model, save_model_dir

    data = tiny_multi30k(tmp / "multi30k")
    tokenizer = Tokenizer.train_text(read_lines(data / "tok" / "test_2016_flickr.lc.norm.tok.de.gz"), kind="char")
    shapes = {"lstm": dict(arch="rnn", d_model=16, n_layers=2, rnn=dict(cell="lstm", bidirectional=False, hidden=16,
                                                                        decoder_hidden=16, attention="none")),
              "transformer": dict(n_layers=1, d_model=16, n_heads=2, d_ff=32)}
    for name, shape in shapes.items():
        torch.manual_seed(0)
        save_model_dir(tmp / name, build_model(ModelConfig(vocab_size=tokenizer.vocab_size, **shape)).eval(), tokenizer)
    return tmp / "lstm", tmp / "transformer", data


def encoder_function(model):
    """x (1, n, d_model) token embeddings → the encoder's outputs (1, n, ·), eval mode."""
    if model.cfg.arch == "rnn":  # a bidirectional encoder: its forward direction, which reads left to right
        return lambda x: model.encoder.rnn(x)[0][..., : model.cfg.rnn["hidden"]]
    encoder = model.encoder

    def run(x):
        h = x + encoder.positions(x.size(1)) if encoder.positions is not None else x
        for layer in encoder.layers:
            h, _, _ = layer(h, None)
        return encoder.final_norm(h) if encoder.final_norm is not None else h

    return run


def jacobian_norms(model, sequences) -> list[float]:
    """Mean over ``sequences`` of ‖∂ o_T / ∂ x_t‖_F for t = T, T−1, ..., 0 (index: the distance)."""
    import torch

    model.eval()
    run = encoder_function(model)
    totals = None
    for ids in sequences:
        x = model.encoder.embed(torch.tensor([ids])).detach().requires_grad_(True)
        out = run(x)[0, -1]
        squares = torch.zeros(x.size(1))
        for k in range(out.numel()):
            (grad,) = torch.autograd.grad(out[k], x, retain_graph=True)
            squares += grad[0].pow(2).sum(-1)
        norms = squares.sqrt().flip(0)  # index = T − t
        totals = norms if totals is None else totals + norms
    return (totals / len(sequences)).tolist()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    smoke = smoke_requested(argv)
    parser.add_argument("--lstm", required=not smoke, help="model directory of the ladder's lstm_none")
    parser.add_argument("--transformer", required=not smoke, help="model directory of the ladder's transformer")
    parser.add_argument("--data", default=str(DATA / "multi30k"))
    parser.add_argument("--length", type=int, default=100, help="tokens per sequence (default: 100)")
    parser.add_argument("--samples", type=int, default=4, help="sequences averaged (default: 4)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--figure", help="write the plot here (PNG)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here random stand-ins for the models")
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("gradient_distance") as tmp:
            lstm, transformer, data = smoke_models(tmp)
            return main(["--lstm", str(lstm), "--transformer", str(transformer), "--data", str(data), "--length", "12",
                         "--samples", "1", "--threads", "1", "--figure", str(tmp / "gradients.png")])
    import torch

    from atencion.data.corpus import read_lines
    from atencion.nn.model_dir import build_model, load_model_dir

    torch.set_num_threads(args.threads)
    sentences = read_lines(Path(args.data) / "tok" / "test_2016_flickr.lc.norm.tok.de.gz")
    curves = {}
    for name, path in (("LSTM", args.lstm), ("self-attention", args.transformer)):
        trained, tokenizer = load_model_dir(path)
        stream = [i for s in sentences for i in tokenizer.encode_src(s)]
        sequences = [stream[k * args.length:(k + 1) * args.length] for k in range(args.samples)]
        torch.manual_seed(0)
        fresh = build_model(trained.cfg)
        curves[f"{name}, initialised"] = jacobian_norms(fresh, sequences)
        curves[f"{name}, trained"] = jacobian_norms(trained, sequences)
    shown = [d for d in (0, 1, 2, 5, 10, 20, 50) if d < args.length] + [args.length - 1]
    result = {"length": args.length, "samples": args.samples,
              "norms": {name: {d: float(f"{values[d]:.3g}") for d in shown} for name, values in curves.items()}}
    if args.figure:
        from atencion.viz.plots import line_figure, save

        series = {name: (list(range(len(values))), values) for name, values in curves.items()}
        styles = {name: "--" for name in curves if "initialised" in name}
        save(line_figure(series, "distance T − t (tokens)", "‖∂ o_T / ∂ x_t‖ (Frobenius)",
                         "gradient of the last output with respect to each input", marker="", log_y=True,
                         styles=styles), args.figure)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
