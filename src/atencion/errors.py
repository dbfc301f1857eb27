"""The project's own error types: a fault in what the user gave (a file, a line, a key, an
argument) or in what a run met (divergence, a full disk). The command line prints their message
as one line and exits with status 2; any other exception is a bug and keeps its traceback."""

from __future__ import annotations


class AtencionError(ValueError):
    """Bad input or a known fault; the message names the file, line, argument or key."""


class MissingFileError(AtencionError, FileNotFoundError):
    """A file or directory that should be there is not."""
