"""Token files: a corpus tokenized once (`atencion tokenize`) and read memory-mapped by ``task: lm``
(``data.train_tokens``), so that a corpus of billions of tokens need not fit in memory.

A token file is a header of ``HEADER_BYTES`` bytes — JSON, padded with spaces, ending in a line
break, readable with ``head -c 4096`` — and then the token ids, little-endian, ``uint16`` when the
vocabulary fits (below 65,536 ids) and ``uint32`` otherwise. The header says:

    {"format": "atencion tokens", "version": 1, "dtype": "uint16", "count": 1003854,
     "vocab_size": 8000, "tokenizer_sha256": "…", "sources": ["input.txt"]}

``tokenizer_sha256`` is :func:`tokenizer_checksum` of the tokenizer that wrote the ids; training
refuses a file written by another tokenizer. Several files read as one stream (``TokenStream``),
in the order given, as the lines of several text files do.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import AtencionError, MissingFileError
from .tokenizer import Tokenizer

HEADER_BYTES = 4096
FORMAT = "atencion tokens"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def tokenizer_checksum(tokenizer: Tokenizer) -> str:
    """SHA-256 of the files ``tokenizer`` saves (names and bytes, in name order): the same for the
    same tokenizer wherever it is loaded from."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        for path in sorted(Path(tmp).iterdir()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def write_tokens(path: str | Path, streams: Iterable[list[int]], tokenizer: Tokenizer,
                 sources: list[str]) -> dict:
    """Write the ids of ``streams`` (one list per piece of text, in order) into the token file
    ``path``, which must not exist (nothing is overwritten); the file appears whole or not at all.
    Returns its header."""
    path = Path(path)
    if path.exists():
        raise AtencionError(f"--out {path}: exists; choose a new file (nothing was overwritten)")
    vocab_size = tokenizer.src_vocab_size
    name = "uint16" if vocab_size <= 1 << 16 else "uint32"
    dtype = DTYPES[name]
    header = {"format": FORMAT, "version": 1, "dtype": name, "count": 0, "vocab_size": vocab_size,
              "tokenizer_sha256": tokenizer_checksum(tokenizer), "sources": sources}

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # put in place when whole
    try:
        with open(tmp, "wb") as f:
            f.write(b" " * HEADER_BYTES)
            for ids in streams:
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                header["count"] += len(ids)
            f.seek(0)
            f.write(_header_bytes(header))
        os.replace(tmp, path)
    except OSError as err:
        raise AtencionError(f"--out {path}: cannot write ({err.strerror or err})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return header


def _header_bytes(header: dict) -> bytes:
    text = json.dumps(header).encode()
    if len(text) + 1 > HEADER_BYTES:
        raise AtencionError(f"token file header: {len(text)} bytes, more than {HEADER_BYTES - 1} (too many sources?)")
    return text + b" " * (HEADER_BYTES - 1 - len(text)) + b"\n"


def read_header(path: str | Path, what: str) -> dict:
    """The header of token file ``path``, checked; ``what`` names it in messages (a config key)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{what} {path}: not found")
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise AtencionError(f"{what} {path}: not a token file (write one with `atencion tokenize`)")
    if header.get("dtype") not in DTYPES or not isinstance(header.get("count"), int):
        raise AtencionError(f"{what} {path}: its header's dtype or count is damaged")
    expected = HEADER_BYTES + header["count"] * DTYPES[header["dtype"]].itemsize
    if path.stat().st_size != expected:
        raise AtencionError(f"{what} {path}: {path.stat().st_size} bytes, but its header says {header['count']} "
                            f"{header['dtype']} tokens ({expected} bytes): the file is cut short or damaged")
    return header


class TokenStream:
    """Token files read as one stream of ids, memory-mapped: ``stream[a:b]`` is a torch.long tensor
    of tokens a … b−1, across file boundaries; only the tokens asked for are read from disk."""

    def __init__(self, paths: str | Path | list[str | Path], what: str, tokenizer: Tokenizer | None = None):
        self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        if not self.paths:
            raise AtencionError(f"{what}: expected a token file or a list of them, got an empty list")
        self.headers = [read_header(p, what) for p in self.paths]
        if tokenizer is not None:
            checksum = tokenizer_checksum(tokenizer)
            for path, header in zip(self.paths, self.headers):
                if header.get("tokenizer_sha256") != checksum:
                    raise AtencionError(f"{what} {path}: written by another tokenizer than this run's (its "
                                        f"tokenizer_sha256 differs); tokenize the text again with this run's "
                                        f"tokenizer")
        self.arrays = [np.memmap(p, dtype=DTYPES[h["dtype"]], mode="r", offset=HEADER_BYTES, shape=(h["count"],))
                       if h["count"] else np.zeros(0, dtype=DTYPES[h["dtype"]])
                       for p, h in zip(self.paths, self.headers)]
        self.starts = np.cumsum([0] + [h["count"] for h in self.headers])

    def numel(self) -> int:
        return int(self.starts[-1])

    def __len__(self) -> int:
        return self.numel()

    def __getitem__(self, index: slice) -> Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a TokenStream is read by slices: stream[a:b]")
        start, stop, _ = index.indices(self.numel())
        parts = []
        for array, first in zip(self.arrays, self.starts[:-1]):
            lo, hi = max(start - first, 0), min(stop - first, len(array))
            if lo < hi:
                parts.append(np.asarray(array[lo:hi], dtype=np.int64))
        return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)

    def tail(self, fraction: float) -> tuple[TokenSlice, TokenSlice]:
        """The stream without its last ``fraction`` of tokens, and those tokens (views)."""
        cut = self.numel() - int(self.numel() * fraction)
        return TokenSlice(self, 0, cut), TokenSlice(self, cut, self.numel())


class TokenSlice:
    """Tokens ``start`` … ``stop``−1 of a TokenStream, read as the stream is."""

    def __init__(self, stream: TokenStream, start: int, stop: int):
        self.stream, self.start, self.stop = stream, start, stop

    def numel(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> Tensor:
        start, stop, _ = index.indices(self.numel())
        return self.stream[self.start + start: self.start + stop]
