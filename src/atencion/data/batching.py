"""Token-based batching (§5.1): batches of about N source + N target tokens, sentences of
similar length together, shuffled reproducibly from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AtencionError

Example = tuple[list[int], list[int]]  # (source ids, target ids), without BOS/EOS


@dataclass
class Batch:
    src: Tensor       # (batch, src_len): ids + EOS, right-padded
    tgt_in: Tensor    # (batch, tgt_len): BOS + ids (the target shifted right, for teacher forcing)
    tgt_out: Tensor   # (batch, tgt_len): ids + EOS, the tokens to predict
    n_tokens: int     # real target tokens (what the loss is averaged over)

    def to(self, device) -> "Batch":
        return Batch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device), self.n_tokens)


def collate(examples: list[Example], pad_id: int, bos_id: int, eos_id: int) -> Batch:
    src_len = max(len(s) for s, _ in examples) + 1
    src = torch.full((len(examples), src_len), pad_id, dtype=torch.long)
    for row, (s, _) in enumerate(examples):
        src[row, : len(s) + 1] = torch.tensor(s + [eos_id])
    return Batch(src, *shift_targets([t for _, t in examples], pad_id, bos_id, eos_id))


def shift_targets(targets: list[list[int]], pad_id: int, bos_id: int, eos_id: int) -> tuple[Tensor, Tensor, int]:
    """Teacher forcing's two views of each target (ids without BOS/EOS), right-padded: BOS + ids
    (the decoder's input) and ids + EOS (what it predicts), and the number of tokens predicted."""
    tgt_len = max(len(t) for t in targets) + 1
    tgt_in = torch.full((len(targets), tgt_len), pad_id, dtype=torch.long)
    tgt_out = torch.full((len(targets), tgt_len), pad_id, dtype=torch.long)
    for row, t in enumerate(targets):
        tgt_in[row, : len(t) + 1] = torch.tensor([bos_id] + t)
        tgt_out[row, : len(t) + 1] = torch.tensor(t + [eos_id])
    return tgt_in, tgt_out, sum(len(t) + 1 for t in targets)


def token_batches(lengths: list[tuple[int, int]], max_tokens: int, seed: int | None) -> list[list[int]]:
    """Group example indices into batches whose padded size stays within ``max_tokens`` on each
    side (batch size × longest sentence, EOS/BOS included).

    Examples are sorted by length, with ties broken at random (from ``seed``), so that a batch
    holds sentences of similar length and padding stays small; the order of the batches is then
    shuffled with the same seed. ``seed=None`` keeps the sorted order (for evaluation).
    """
    if max_tokens <= 0:
        raise AtencionError(f"max_tokens must be positive, got {max_tokens}")
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    if seed is not None:
        rng.shuffle(order)
    order.sort(key=lambda i: (lengths[i][1], lengths[i][0]))
    batches, current, longest_src, longest_tgt = [], [], 0, 0
    for i in order:
        s, t = lengths[i][0] + 1, lengths[i][1] + 1
        new_src, new_tgt = max(longest_src, s), max(longest_tgt, t)
        if current and (len(current) + 1) * max(new_src, new_tgt) > max_tokens:
            batches.append(current)
            current, new_src, new_tgt = [], s, t
        current.append(i)
        longest_src, longest_tgt = new_src, new_tgt
    if current:
        batches.append(current)
    if seed is not None:
        rng.shuffle(batches)
    return batches
