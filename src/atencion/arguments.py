"""What the commands' arguments share (cli.py and each task's command, tasks/): numbers checked by
argparse, so that a bad one is named by its option; the decoding options of translate, transcribe and
evaluate; --draft-tokens; the ``warn`` of a command; and ``Command``, one entry of `atencion --help`.
No torch here: `import atencion.cli` stays light."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import AtencionError

if TYPE_CHECKING:
    from .decode.settings import DecodeConfig


@dataclass(frozen=True)
class Command:
    """One command of `atencion`: its name, its line in `atencion --help`, what adds its arguments to
    its parser, and what runs it with the parsed arguments (its docstring is its --help description)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


def bounded(kind: type, lowest: float, inclusive: bool = True, highest: float | None = None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        too_low = value is not None and (value < lowest or (value == lowest and not inclusive))
        if value is None or too_low or value != value or (highest is not None and value > highest):
            bound = f"{'>=' if inclusive else '>'} {lowest}" + (f" and <= {highest}" if highest is not None else "")
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} "
                                             f"{bound}, got {text!r}")
        return value
    return parse


POSITIVE, COUNT, NON_NEGATIVE = bounded(int, 1), bounded(int, 0), bounded(float, 0.0, highest=1e6)
TTA_SHIFT_HELP = ("image classifier: average the probabilities over the image moved by every whole offset of at most "
                  "N pixels each way, (2N + 1)² views, at most 4 (test-time augmentation; default: 0, the image as "
                  "it is)")


def warner(command: str):
    """What the library warns of (its ``warn`` argument), on stderr, as one line naming the command."""
    def warn(message: str) -> None:
        print(f"atencion {command}: warning: {message}", file=sys.stderr)
    return warn


# decoding options, shared by translate, transcribe and evaluate ---------------------------

def add_decoding_arguments(p: argparse.ArgumentParser, text: bool = True) -> None:
    """The options of translate, transcribe and evaluate that make a DecodeConfig (and the model to
    decode with); ``text``: sources are text (--max-input-tokens; transcribe's are recordings)."""
    p.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, tokenizer): "
                                                   "atencion's or a Hugging Face one")
    p.add_argument("--beam", type=bounded(int, 1, highest=64), default=4,
                   help="beam size, 1 to 64; 1 is greedy (default: 4)")
    p.add_argument("--alpha", type=NON_NEGATIVE, default=0.6, help="length penalty α of Wu et al. 2016 (default: 0.6)")
    p.add_argument("--max-len-a", type=NON_NEGATIVE, default=1.0,
                   help="output length ≤ a·source length + b (default a: 1)")
    p.add_argument("--max-len-b", type=COUNT, default=50, help="(default b: 50, the paper's input length + 50)")
    p.add_argument("--batch-tokens", type=POSITIVE, default=4096,
                   help="source tokens (a recording's log-mel frames) per batch (default: 4096)")
    if text:
        p.add_argument("--max-input-tokens", type=POSITIVE, default=1024,
                       help="a line of more subword pieces is refused before decoding starts (default: 1024; "
                            "attention's memory grows with the square of the length)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    p.add_argument("--int8", action="store_true",
                   help="decode with int8 linear layers (dynamic quantization; CPU only; faster, "
                        "slightly less accurate: see docs/results.md)")


def decode_config_of(args: argparse.Namespace) -> DecodeConfig:
    """The DecodeConfig that the options of ``add_decoding_arguments`` give."""
    from .decode.settings import DecodeConfig

    return DecodeConfig(beam=args.beam, alpha=args.alpha, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                        batch_tokens=args.batch_tokens)


DRAFT_TOKENS = 4  # --draft-tokens' default, with --draft


def draft_tokens_of(args: argparse.Namespace) -> int | None:
    """--draft-tokens, with its default when --draft is given (None without --draft): refused in
    one line when given without --draft, whose option it is, rather than ignored in silence.
    For every command with both options (generate, serve); their parsers leave its default None."""
    if args.draft is None:
        if args.draft_tokens is not None:
            raise AtencionError(f"--draft-tokens {args.draft_tokens}: the tokens a draft model proposes per round "
                                f"of speculative decoding, which needs --draft DIR; give --draft or leave out "
                                f"--draft-tokens")
        return None
    return DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens


def add_sampling_arguments(p: argparse.ArgumentParser, temperature: float, seed_gives: str) -> None:
    """The sampling options of a command that draws tokens (generate, chat): --temperature (its default
    ``temperature``), --top-k, --top-p and --seed (the same seed gives ``seed_gives``), as
    decode/sample.py reads them."""
    p.add_argument("--temperature", type=NON_NEGATIVE, default=temperature,
                   help=f"divides the logits: below 1 sharper, above 1 flatter; 0 is greedy (default: {temperature:g})")
    p.add_argument("--top-k", type=COUNT, default=0,
                   help="draw only among the K most likely tokens; 0: off, 1: greedy (default: 0)")
    p.add_argument("--top-p", type=bounded(float, 0.0, inclusive=False, highest=1.0), default=1.0,
                   help="nucleus sampling: draw only among the most likely tokens whose probability reaches P, "
                        "in (0, 1]; 1: off (default: 1)")
    p.add_argument("--seed", type=bounded(int, 0, highest=2**63 - 1),
                   help=f"seed of the sampler: the same seed gives {seed_gives} (default: a fresh one)")
