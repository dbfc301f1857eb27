"""The `atencion` command line: thin argument parsing over library functions."""

from __future__ import annotations

import argparse
import sys


def cmd_presets(args: argparse.Namespace) -> None:
    """Build a tiny model, run it on an example batch, and list the presets' sizes."""
    import torch

    from . import ModelConfig, Transformer

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=args.tiny_vocab)
    model = Transformer(cfg).eval()
    src = torch.randint(4, cfg.vocab_size, (2, 7))
    src[1, 5:] = cfg.pad_id
    tgt_in = torch.randint(4, cfg.vocab_size, (2, 5))
    tgt_in[:, 0] = cfg.bos_id
    with torch.no_grad():
        logits = model(src, tgt_in)
    print(f"tiny model on an example batch: src_ids {tuple(src.shape)} + tgt_in_ids "
          f"{tuple(tgt_in.shape)} -> logits {tuple(logits.shape)}")
    print()
    print(f"{'preset':<8}{'N':>3}{'d_model':>9}{'d_ff':>7}{'h':>4}{'dropout':>9}{'vocab':>8}{'parameters':>13}")
    for name, vocab in (("tiny", args.tiny_vocab), ("base", args.vocab), ("big", args.vocab)):
        cfg = ModelConfig.preset(name, vocab_size=vocab)
        with torch.device("meta"):
            n = Transformer(cfg).num_parameters()
        print(f"{name:<8}{cfg.n_layers:>3}{cfg.d_model:>9}{cfg.d_ff:>7}{cfg.n_heads:>4}"
              f"{cfg.dropout:>9}{vocab:>8}{n / 1e6:>12.1f}M")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atencion",
        description="The Transformer of 'Attention Is All You Need': train, decode, score, inspect.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("presets", help="run a tiny model on an example batch; list preset sizes",
                       description=cmd_presets.__doc__)
    p.add_argument("--vocab", type=int, default=37000, help="vocabulary for base/big (default: 37000, the paper's)")
    p.add_argument("--tiny-vocab", type=int, default=10000, help="vocabulary for tiny (default: 10000)")
    p.set_defaults(func=cmd_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"atencion {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
