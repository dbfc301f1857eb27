"""The key/value cache of grouped-query attention against multi-head attention: bytes held after
decoding N tokens one by one, SmolLM-135M's shape (30 layers, 9 query heads of 64, 3 key/value
heads; random weights, float32, batch 1), with ``n_kv_heads`` 3 (its own), 1 (multi-query) and 9
(multi-head). The cache holds n_kv_heads heads, so it shrinks by n_heads / n_kv_heads.

    python -m benchmarks.kv_cache [--tokens 512]
    python -m benchmarks.kv_cache --smoke        # 2 layers, 8 tokens: a check, not a result
"""

from __future__ import annotations

import argparse

import torch

from atencion import ModelConfig, Transformer
from benchmarks.common import SMOKE_HELP

KIND = "speed"  # a speed (memory) benchmark (benchmarks/__init__.py lists the two groups)


def cache_bytes(n_kv_heads: int, tokens: int, **shrink) -> int:
    torch.manual_seed(0)
    settings = {"vocab_size": 49152, "n_kv_heads": n_kv_heads, **shrink}  # SmolLM's vocabulary
    cfg = ModelConfig.preset("smollm-135m", **settings)
    model = Transformer(cfg).eval()
    ids = torch.randint(4, cfg.vocab_size, (1, tokens))
    state = model.init_state()
    with torch.inference_mode():
        for i in range(tokens):
            model.decode_step(ids[:, i:i + 1], state)
    return sum(cache.k.nbytes + cache.v.nbytes for cache in state.self_caches)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here 2 layers, vocabulary 256")
    args = parser.parse_args(argv)
    shrink = dict(n_layers=2, vocab_size=256) if args.smoke else {}
    tokens = 8 if args.smoke else args.tokens
    full = cache_bytes(9, tokens, **shrink)
    for heads in (9, 3, 1):
        size = full if heads == 9 else cache_bytes(heads, tokens, **shrink)
        print(f"n_kv_heads {heads}: {size / 2**20:.2f} MiB after {tokens} tokens "
              f"({full / size:.1f}x smaller than multi-head)", flush=True)


if __name__ == "__main__":
    main()
