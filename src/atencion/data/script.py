"""What the data generators run as scripts share (``python -m atencion.data.listops``, ``.digits``,
``.fsdd``): argparse errors on one line, and one JSON line printed for the files written, or one
error line (exit 2), or "interrupted" (exit 130)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from ..errors import AtencionError


class ScriptParser(argparse.ArgumentParser):
    """argparse with its errors on one line, as the atencion command line has them."""

    def __init__(self, prog: str, description: str | None):
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_writer(prog: str, write: Callable[[], dict]) -> int:
    """Run ``write`` (it writes the files, atomically, and returns a report): print the report as
    one JSON line and return 0, or one error line and 2, or 130 for Ctrl-C."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        report = write()
    except AtencionError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; no file was left half-written", file=sys.stderr)
        return 130
    print(json.dumps(report))
    return 0
