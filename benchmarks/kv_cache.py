"""The key/value cache of grouped-query attention against multi-head attention: bytes held after
decoding N tokens one by one, SmolLM-135M's shape (30 layers, 9 query heads of 64, 3 key/value
heads; random weights, float32, batch 1), with ``n_kv_heads`` 3 (its own), 1 (multi-query) and 9
(multi-head). The cache holds n_kv_heads heads, so it shrinks by n_heads / n_kv_heads.

    python benchmarks/kv_cache.py [--tokens 512]
"""

from __future__ import annotations

import argparse

import torch

from atencion import ModelConfig, Transformer


def cache_bytes(n_kv_heads: int, tokens: int) -> int:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("smollm-135m", vocab_size=49152, n_kv_heads=n_kv_heads)  # SmolLM's vocabulary
    model = Transformer(cfg).eval()
    ids = torch.randint(4, cfg.vocab_size, (1, tokens))
    state = model.init_state()
    with torch.inference_mode():
        for i in range(tokens):
            model.decode_step(ids[:, i:i + 1], state)
    return sum(cache.k.nbytes + cache.v.nbytes for cache in state.self_caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    full = cache_bytes(9, args.tokens)
    for heads in (9, 3, 1):
        size = full if heads == 9 else cache_bytes(heads, args.tokens)
        print(f"n_kv_heads {heads}: {size / 2**20:.2f} MiB after {args.tokens} tokens "
              f"({full / size:.1f}x smaller than multi-head)", flush=True)


if __name__ == "__main__":
    main()
