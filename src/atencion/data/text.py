"""Plain text for language models and labelled sentences for classifiers, read with the same
checks as the parallel corpora (one line naming the file and line for each mistake).

- ``read_text``: one or more plain-text files (or .gz), concatenated line by line.
- ``read_labelled``: a TSV file of ``label<TAB>text`` rows, header allowed (``read_labelled_lines``:
  with the file line of each row).
- ``lm_blocks``: the contiguous, non-overlapping blocks of a token stream that a causal
  language model trains on.
- ``mask_tokens``: BERT's masking recipe (15% of the tokens chosen; of those 80% become
  ``<mask>``, 10% a random token, 10% stay).
"""

from __future__ import annotations

import logging
import random

import torch
from torch import Tensor

from ..errors import AtencionError
from .corpus import CorpusError, read_lines

log = logging.getLogger(__name__)


def read_text(paths: str | list[str], key: str) -> list[str]:
    """The lines of every file in ``paths`` (a path or a list of them), in order; ``key``
    names the config key in messages."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise AtencionError(f"{key}: expected a file or a list of files, got an empty list")
    lines: list[str] = []
    for path in paths:
        if not isinstance(path, str):
            raise AtencionError(f"{key}: expected file paths, got {path!r}")
        lines.extend(read_lines(path, allow_empty=False))
    return lines


def split_tail(lines: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """The lines before and after the point where the last ``fraction`` of the characters
    begins (the held-out tail, as nanoGPT splits Tiny Shakespeare: the last 10%). The cut is
    made inside a line if it falls there, so that the tail is exactly that share of the text."""
    text = "".join(line + "\n" for line in lines)
    cut = int(len(text) * (1 - fraction))
    head, tail = text[:cut], text[cut:]
    return head.split("\n")[:-1] if head.endswith("\n") else head.split("\n"), tail.rstrip("\n").split("\n")


def read_labelled(path: str, labels: list[str] | None = None, header: str = "auto",
                  empty_lines: str = "skip", warn=log.warning) -> tuple[list[tuple[int, str]], list[str], int]:
    """``(label index, text)`` rows of a ``label<TAB>text`` file, the label names and the number
    of rows skipped for an empty text (see ``read_labelled_lines``)."""
    rows, labels, skipped, _ = read_labelled_lines(path, labels, header, empty_lines, warn)
    return rows, labels, skipped


def read_labelled_lines(path: str, labels: list[str] | None = None, header: str = "auto", empty_lines: str = "skip",
                        warn=log.warning) -> tuple[list[tuple[int, str]], list[str], int, list[int]]:
    """``(label index, text)`` rows of a ``label<TAB>text`` file, the label names and the number
    of rows skipped for an empty text. Training (``labels`` None) learns the names (sorted:
    numerically when they are all integers); validation and evaluation refuse a label that
    training did not see, naming the line. A row with an empty label is refused, naming its line.
    ``header``: "auto" takes the first line as a header when its label is not a label of any
    other line (SST-2's ``label<TAB>sentence``), and ``warn(message)`` hears which line and why;
    "yes", "no". Last, the file line number of each row returned (past the header and the rows
    skipped), for messages that name a row."""
    rows = _label_text_rows(path, read_lines(path))
    if header == "yes":
        rows = rows[1:]
    for label, _, number in rows:
        if not label:
            raise CorpusError(f"{path} line {number}: the label is empty; expected label<TAB>text")
    if header == "auto" and rows:
        reason = _header_reason(rows, labels)
        if reason:
            warn(f"{path} line 1: taken as a header, not a row: {reason}")
            rows = rows[1:]
    if labels is None:
        names = sorted({r[0] for r in rows})
        labels = sorted(names, key=int) if all(_is_int(x) for x in names) else names
    out, numbers, skipped = _indexed_rows(path, rows, labels, empty_lines)
    if not out:
        raise CorpusError(f"{path}: no labelled row")
    return out, labels, skipped, numbers


def _label_text_rows(path: str, lines: list[str]) -> list[tuple[str, str, int]]:
    """``(label, text, line number)`` of each ``label<TAB>text`` line, both stripped."""
    rows = []
    for number, line in enumerate(lines, start=1):
        label, sep, text = line.partition("\t")
        if not sep:
            raise CorpusError(f"{path} line {number}: expected label<TAB>text, found no tab")
        rows.append((label.strip(), text.strip(), number))
    return rows


def _header_reason(rows: list[tuple[str, str, int]], labels: list[str] | None) -> str | None:
    """Why the first row is a header (its label is no label of the others, or of ``labels``), or None."""
    first = rows[0][0]
    if labels is None and first not in {r[0] for r in rows[1:]}:
        return f"its label {first!r} appears on no other line"
    if labels is not None and first not in labels:
        return f"its label {first!r} is not a label seen in training {labels}"
    return None


def _indexed_rows(path: str, rows: list[tuple[str, str, int]], labels: list[str],
                  empty_lines: str) -> tuple[list[tuple[int, str]], list[int], int]:
    """``(label index, text)`` of each row with a text, its line number, and the number skipped as empty."""
    index = {name: i for i, name in enumerate(labels)}
    out, numbers, skipped = [], [], 0
    for label, text, number in rows:
        if label not in index:
            raise CorpusError(f"{path} line {number}: label {label!r} was not seen in training; "
                              f"known labels: {labels}")
        if not text:
            if empty_lines == "error":
                raise CorpusError(f"{path} line {number}: empty text (set data.empty_lines: skip to drop such rows)")
            skipped += 1
            continue
        out.append((index[label], text))
        numbers.append(number)
    return out, numbers, skipped


def _is_int(text: str) -> bool:
    try:
        int(text)
        return True
    except ValueError:
        return False


def lm_blocks(n_tokens: int, block_size: int, offset: int = 0, partial: bool = False) -> list[tuple[int, int]]:
    """(start, length) of the blocks a stream of ``n_tokens`` tokens is cut into: contiguous,
    from ``offset`` on, none overlapping another; each block's inputs are tokens
    start … start+length−1 and its targets the same shifted by one, so a block needs
    length + 1 tokens. ``partial`` keeps a shorter last block (validation: every token of the
    tail is predicted once)."""
    blocks, start = [], offset
    while start + block_size + 1 <= n_tokens:
        blocks.append((start, block_size))
        start += block_size
    if partial and n_tokens - start >= 2:
        blocks.append((start, n_tokens - start - 1))
    return blocks


def epoch_offset(seed: int, epoch: int, block_size: int, n_tokens: int | None = None) -> int:
    """Where an epoch's blocks begin: 0 first, then a reproducible shift, so that the model
    does not see the same block boundaries every epoch. Given the stream's ``n_tokens``, the
    shift always leaves at least one block when the stream holds one (block_size + 1 tokens):
    a shift that would leave none is folded back into the room there is (a text of two blocks
    or more keeps every shift it had)."""
    if epoch == 0:
        return 0
    shift = random.Random(seed * 1_000_003 + epoch).randrange(block_size)
    room = None if n_tokens is None else n_tokens - block_size  # the shifts that leave a block: 0 … room − 1
    return shift % room if room is not None and 0 < room <= shift else shift


def mask_tokens(ids: Tensor, maskable: Tensor, mask_id: int, first_regular: int, vocab_size: int,
                probability: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """BERT's masked-LM inputs and targets for ``ids`` (batch, length).

    Each position where ``maskable`` is True (real, non-special tokens) is chosen with
    ``probability``; a chosen token becomes ``<mask>`` (80%), a random regular token (ids from
    ``first_regular`` on, 10%) or stays (10%). Targets hold the original id at chosen positions
    and padding (0) elsewhere, so the loss counts the chosen positions only. A batch where no
    position was chosen gets its first maskable one, so that every batch has a loss; a batch with
    no maskable position at all (a row of no piece) comes back as it was, with no target."""
    draw = torch.rand(ids.shape, generator=generator)
    how = torch.rand(ids.shape, generator=generator)
    chosen = (draw < probability) & maskable
    if not bool(chosen.any()):
        first = maskable.reshape(-1).nonzero()
        if first.numel():
            chosen.view(-1)[int(first[0])] = True
    inputs = ids.clone()
    inputs[chosen & (how < 0.8)] = mask_id
    swap = chosen & (how >= 0.8) & (how < 0.9)
    inputs[swap] = torch.randint(first_regular, vocab_size, (int(swap.sum()),), generator=generator)
    targets = torch.where(chosen, ids, torch.zeros_like(ids))
    return inputs, targets
