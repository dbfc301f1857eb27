"""Ctrl-C (SIGINT) that is never lost.

Python's own handler raises KeyboardInterrupt wherever the main thread happens to be. When that
is Python code which a C library called and whose error it then clears, the KeyboardInterrupt
is swallowed and the program goes on as if no key had been pressed. Seen here: while numpy's
typing module is imported (typing's Union, built from C code), in numpy's ctypes check under
safetensors' first save, and in a generator that the garbage collector closes (its error is
only printed); `atencion train` then trained on for good.

Within :func:`remembering_ctrl_c`, SIGINT raises the same KeyboardInterrupt and is also
remembered: :func:`check_ctrl_c` raises it again where a loop can stop cleanly (the training
loop asks before each update), and the block raises it when it ends, at the latest. A block
opened with ``defer=True`` only remembers it, and raises it when it ends: the package's
imports, since a KeyboardInterrupt inside a C extension's initialisation can leave it half
loaded (an aborted process; numpy's "cannot load module more than once"). Only Python's
default handler is replaced, and only in the main thread: an ignored SIGINT (a job started in
the background, nohup) or a handler of the caller's own stays as it is.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_pressed = False  # a Ctrl-C since the outermost block began
_depth = 0        # blocks open (they nest: the package's imports, the command, a training run)
_previous = None  # the handler the outermost block replaced, or None
_deferring = 0    # blocks open with defer=True


def _handle(signum, frame) -> None:
    global _pressed
    _pressed = True
    if not _deferring:
        raise KeyboardInterrupt


@contextmanager
def remembering_ctrl_c(defer: bool = False):
    """A block within which no Ctrl-C is lost (see the module's docstring); ``defer``: raised
    only when the block ends."""
    global _depth, _deferring, _pressed, _previous
    if _depth == 0:
        _pressed = False
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            _previous = signal.signal(signal.SIGINT, _handle)
    _depth += 1
    _deferring += defer
    try:
        yield
    finally:
        _deferring -= defer
        _depth -= 1
        if _depth == 0 and _previous is not None:
            signal.signal(signal.SIGINT, _previous)
            _previous = None
    if defer or _depth == 0:
        check_ctrl_c()  # deferred, or swallowed and not asked for since


def check_ctrl_c() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed within the open block (and swallowed)."""
    if _pressed:
        raise KeyboardInterrupt
