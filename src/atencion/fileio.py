"""Writing files so that nothing the user has is ever half-overwritten."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from .errors import AtencionError, MissingFileError


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary name in the same directory, then rename it to ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_directory(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Fill a temporary directory, then put it in place of ``path`` (replacing an older one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def read_json(path: str | os.PathLike, what: str):
    """The JSON value in ``path``; FileNotFoundError or ValueError naming the file and ``what`` it is."""
    import json

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AtencionError(f"{path}: not a valid JSON {what} ({err})") from None
