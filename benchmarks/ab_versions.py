"""Is this checkout slower than another one? Training steps and beam search of the same model,
and generation steps of a decoder-only model, old and new taking turns in one process, with the
ratio taken pair by pair.

    git worktree add /tmp/old HEAD~3
    python -m benchmarks.ab_versions /tmp/old/src            # 12 pairs, about two minutes on 2 cores
    ATENCION_FUSED=0 python -m benchmarks.ab_versions /tmp/old/src   # generation layer by layer
    python -m benchmarks.ab_versions --smoke                 # this checkout against itself, in seconds

The generation rows time 40 steps of batch ``--rows`` after a 16-token prompt, of ``--lm``'s shape
(SmolLM-135M's by default: its products dominate) and of the same preset shrunk to 30 layers of
d_model 64 (its products take microseconds: what is left is the step's cost around them).

The other checkout's package is copied as ``atencion_old`` (its imports are relative, so both
live side by side); both models get the same weights and must give the same beams. Across
processes this machine's noise (±20%) hides a few percent, so the comparison alternates inside
one process. Prints, for time new/old, the median and range of the pairs (below 1: faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, SMOKE_HELP, smoke_requested, timed

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)


def main(argv: list[str] | None = None) -> None:
    smoke = smoke_requested(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_src", nargs="?" if smoke else None,
                        help="the src/ directory of the other checkout (it holds atencion/)")
    parser.add_argument("--pairs", type=int, default=12, help="alternations (default: 12)")
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary (default: 8000)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--lm", default="smollm-135m", help="decoder-only preset whose generation steps are "
                        "timed (default: smollm-135m; none: skip them)")
    parser.add_argument("--lm-vocab", type=int, default=49152, help="its vocabulary (default: 49152, SmolLM's)")
    parser.add_argument("--rows", type=int, default=1, help="generation batch (default: 1)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here this checkout against itself "
                        "(OLD_SRC: this src/), one pair, gpt-tiny's generation")
    args = parser.parse_args(argv)
    if args.smoke:
        return main([args.old_src or str(ROOT / "src"), "--pairs", "1", "--vocab", "300", "--threads", "1",
                     "--lm", "gpt-tiny", "--lm-vocab", "256"])
    package = Path(args.old_src) / "atencion"
    if not (package / "__init__.py").is_file():
        sys.exit(f"{args.old_src}: no atencion package there (give the other checkout's src/)")
    holder = Path(tempfile.mkdtemp())
    shutil.copytree(package, holder / "atencion_old")
    init = holder / "atencion_old" / "__init__.py"  # imported by its path: nothing added to sys.path
    spec = importlib.util.spec_from_file_location("atencion_old", init, submodule_search_locations=[str(init.parent)])
    sys.modules["atencion_old"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["atencion_old"])

    import atencion_old
    import torch
    from atencion_old.decode.search import beam_search as old_beam

    try:  # the loss lives in tasks/ since the redesign, in train/ before it
        from atencion_old.tasks.loss import generator_loss as old_loss
    except ImportError:
        from atencion_old.train.loss import generator_loss as old_loss

    import atencion
    from atencion.decode.search import beam_search as new_beam
    from atencion.tasks.loss import generator_loss as new_loss

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    new = atencion.Transformer(atencion.ModelConfig.preset(args.preset, vocab_size=args.vocab))
    old = atencion_old.Transformer(atencion_old.ModelConfig.preset(args.preset, vocab_size=args.vocab))
    names = {".res_self.": ".res_attn."} if any(".res_attn." in n for n in old.state_dict()) else {}
    state = {}  # an older checkout may name a parameter differently (the encoder's res_attn)
    for name, value in new.state_dict().items():
        for now, then in names.items():
            name = name.replace(now, then) if name.startswith("encoder.") else name
        state[name] = value
    old.load_state_dict(state)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, args.vocab, (64, 24), generator=g)
    src[32:, 18:] = 0
    tgt = torch.randint(4, args.vocab, (64, 26), generator=g)
    tgt[:, 0] = 2
    tgt[40:, 20:] = 0
    out = tgt.roll(-1, 1)

    def train_steps(model, loss_fn, n=3):
        model.train()
        for _ in range(n):
            hidden = model(src, tgt, select=out != 0, project=False)
            loss, _ = loss_fn(hidden, model.generator.weight, None, out[out != 0], 0, 0.1)
            loss.backward()

    @torch.no_grad()
    def decode(model, beam_fn):
        model.eval()
        return beam_fn(model, src[:32], 4, 0.6, 0, 25)

    same = [[h.tokens for h in x] for x in decode(new, new_beam)] == [[h.tokens for h in x] for x in
                                                                      decode(old, old_beam)]
    train_ratio, decode_ratio = [], []
    for _ in range(args.pairs):
        decode_ratio.append(timed(lambda: decode(new, new_beam)) / timed(lambda: decode(old, old_beam)))
        train_ratio.append(timed(lambda: train_steps(new, new_loss)) / timed(lambda: train_steps(old, old_loss)))
    print(f"same beams: {same}; preset {args.preset}, vocabulary {args.vocab}, {args.threads} threads")
    for name, r in (("training (3 steps, 64 x 24/26 tokens)", train_ratio),
                    ("beam search (32 sentences, beam 4)", decode_ratio)):
        report(name, r)
    if args.lm != "none":
        small = dict(n_layers=30, d_model=64, d_ff=128, n_heads=4, vocab_size=256)
        for label, overrides in ((args.lm, dict(vocab_size=args.lm_vocab)),
                                 (f"{args.lm} shrunk to 30 layers of d_model 64", small)):
            generation(atencion, atencion_old, label, args.lm, overrides, args.rows, args.pairs)
    shutil.rmtree(holder, ignore_errors=True)


def report(name: str, ratios: list[float]) -> None:
    print(f"{name}: time new/old median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, "
          f"{len(ratios)} pairs)")


def generation(new_pkg, old_pkg, label: str, preset: str, overrides: dict, rows: int, pairs: int) -> None:
    """40 generation steps of batch ``rows`` in each checkout, taking turns; the same logits in both."""
    import torch

    if "n_heads" in overrides and new_pkg.ModelConfig.preset(preset, vocab_size=256).n_kv_heads:
        overrides = dict(overrides, n_kv_heads=2)  # grouped-query attention kept, for 4 heads
    models = []
    for package in (new_pkg, old_pkg):
        torch.manual_seed(0)
        try:
            models.append(package.Transformer(package.ModelConfig.preset(preset, **overrides)).eval())
        except Exception as err:  # an older checkout without the preset or one of its keys
            print(f"generation ({label}): skipped, the other checkout cannot build it ({err})")
            return
    models[1].load_state_dict(models[0].state_dict())
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(4, models[0].cfg.vocab_size, (1, 16), generator=g).expand(rows, -1).contiguous()
    token = torch.full((rows, 1), 5)

    @torch.inference_mode()
    def steps(model, n=40):
        state = model.init_state()
        model.decode_step(prompt, state, last=1)
        began = time.perf_counter()
        for _ in range(n):
            logits = model.decode_step(token, state)
        return time.perf_counter() - began, logits

    (_, new_logits), (_, old_logits) = steps(models[0], 2), steps(models[1], 2)
    ratios = []
    for i in range(pairs):  # each checkout first in every other pair
        seconds = {j: steps(models[j])[0] for j in ((0, 1) if i % 2 else (1, 0))}
        ratios.append(seconds[0] / seconds[1])
    print(f"same logits: {torch.equal(new_logits, old_logits)}")
    report(f"generation, {label}, batch {rows} (40 steps)", ratios)


if __name__ == "__main__":
    main()
