"""The project's own error types: a fault in what the user gave (a file, a line, a key, an
argument) or in what a run met (divergence, a full disk). The command line prints their message
as one line and exits with status 2; any other exception is a bug and keeps its traceback."""

from __future__ import annotations


class AtencionError(ValueError):
    """Bad input or a known fault; the message names the file, line, argument or key."""


class MissingFileError(AtencionError, FileNotFoundError):
    """A file or directory that should be there is not."""


class Diverged(AtencionError):
    """Training met a non-finite loss or gradient norm at ``step``; nothing was updated after it."""

    def __init__(self, step: int, what: str, value: float, message: str | None = None):
        super().__init__(message or f"training diverged: the {what} is {value} at step {step}")
        self.step, self.what, self.value = step, what, value


class Interrupted(AtencionError):
    """Stopped by Ctrl-C (SIGINT); the message says where, and how to go on. Exit status 130."""
