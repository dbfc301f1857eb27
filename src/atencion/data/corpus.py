"""Parallel corpora: two aligned text files (plain or .gz) or one TSV file, checked line by line.

Every mistake a user makes with a corpus gets one line that names the file and the line.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AtencionError, MissingFileError

log = logging.getLogger(__name__)


class CorpusError(AtencionError):
    """A corpus file that cannot be used as it is; the message names the file and line."""


@dataclass
class CorpusReport:
    """What reading a corpus dropped, with the first place where each kind of drop happened."""

    pairs: int = 0
    empty_skipped: int = 0
    first_empty: str | None = None
    too_long_skipped: int = 0
    first_too_long: str | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self, name: str) -> str:
        parts = [f"{name}: {self.pairs} pairs"]
        if self.empty_skipped:
            parts.append(f"{self.empty_skipped} skipped with an empty side (first at {self.first_empty})")
        if self.too_long_skipped:
            parts.append(f"{self.too_long_skipped} skipped as too long (first at {self.first_too_long})")
        return "; ".join(parts)


def read_lines(path, allow_empty: bool = False, errors: str = "strict", name: str | None = None,
               warn=log.warning) -> list[str]:
    """All lines of a UTF-8 text file (gzip if it ends in .gz), or of a binary stream such as
    ``sys.stdin.buffer``, without their line endings. ``errors``: "strict" refuses a line that is
    not UTF-8, naming it; "replace" puts U+FFFD in place of each bad byte and calls ``warn`` once
    with a line naming the first such line (so that one line still comes out per line in; None:
    a logging warning, as the use-side functions pass on a ``warn`` they were not given).
    ``name`` names a stream."""
    raw, name = _read_bytes(path, name)
    if not raw.strip() and not allow_empty:
        raise CorpusError(f"{name}: the file is empty")
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return _decode_lines(lines, name, errors, warn)


def _read_bytes(path, name: str | None) -> tuple[bytes, str]:
    """The raw bytes of a file (gunzipped if it ends in .gz) or of a stream, and the name to report."""
    if hasattr(path, "read"):
        raw = path.read()
        if isinstance(raw, str):  # a text stream: undo Python's surrogateescape of undecodable bytes
            raw = raw.encode("utf-8", errors="surrogateescape")
        return raw, name or "input"
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"{path}: is a directory; expected a text file")
    if not path.is_file():
        raise MissingFileError(f"{path}: file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:  # zlib.error: corrupt compressed data in a .gz file
        raise CorpusError(f"{path}: cannot read the file ({err})") from None
    return raw, name or str(path)


def _decode_lines(lines: list[bytes], name: str, errors: str, warn) -> list[str]:
    """Each line decoded from UTF-8 without a trailing CR, as ``read_lines``'s ``errors`` says."""
    out, bad = [], []
    for number, line in enumerate(lines, start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            where = f"{name} line {number}: not valid UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1})"
            if errors != "replace":
                raise CorpusError(f"{where}; convert the file to UTF-8, e.g. with iconv") from None
            bad.append(where)
            text = line.decode("utf-8", errors="replace")
        out.append(text.rstrip("\r"))
    if bad:
        more = f" (and {len(bad) - 1} more line(s))" if len(bad) > 1 else ""
        (warn or log.warning)(f"{bad[0]}{more}; each bad byte was replaced with U+FFFD")
    return out


def read_parallel(
    src: str | Path,
    tgt: str | Path | None = None,
    empty_lines: str = "skip",
) -> tuple[list[tuple[str, str]], CorpusReport]:
    """Sentence pairs from two aligned files (``src``, ``tgt``) or from one TSV file (``src``
    alone: source TAB target on each line). ``empty_lines`` is "skip" (drop and count) or
    "error"."""
    if empty_lines not in ("skip", "error"):
        raise AtencionError(f"empty_lines must be 'skip' or 'error', got {empty_lines!r}")
    if tgt is None:
        rows = []
        for number, line in enumerate(read_lines(src), start=1):
            fields = line.split("\t")
            if len(fields) != 2:
                raise CorpusError(f"{src} line {number}: expected 2 tab-separated fields "
                                  f"(source, target), found {len(fields)}")
            rows.append((fields[0], fields[1], f"{src} line {number}"))
    else:
        src_lines, tgt_lines = read_lines(src), read_lines(tgt)
        if len(src_lines) != len(tgt_lines):
            raise CorpusError(f"{src} has {len(src_lines)} lines but {tgt} has {len(tgt_lines)}; "
                              f"the two sides must be aligned line by line")
        rows = [(s, t, f"line {i}") for i, (s, t) in enumerate(zip(src_lines, tgt_lines), start=1)]
    report = CorpusReport()
    pairs = []
    for s, t, where in rows:
        s, t = s.strip(), t.strip()
        if not s or not t:
            side = src if not s else (tgt if tgt is not None else src)
            place = where if tgt is None else f"{side} {where}"
            if empty_lines == "error":
                raise CorpusError(f"{place}: empty {'source' if not s else 'target'} sentence "
                                  f"(set data.empty_lines: skip to drop such pairs)")
            report.empty_skipped += 1
            report.first_empty = report.first_empty or place
            continue
        pairs.append((s, t))
    report.pairs = len(pairs)
    if not pairs:
        raise CorpusError(f"{src}: no usable sentence pair")
    return pairs, report
