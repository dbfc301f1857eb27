"""Text as tokens come: what a stream may show after each new token, and where stop strings end it.

A token is not always text of its own: a byte-level BPE (GPT-2, Llama 3, SmolLM) splits a
character of several UTF-8 bytes over several tokens, and a SentencePiece model's leading space
depends on what follows. So the text of the new tokens is decoded whole each time (``render``), and
what is shown is what was not shown yet, held back while it ends in an incomplete character
(U+FFFD, the replacement a decoder puts for bytes that are not yet a character) or in the start of
a stop string (which, if it completes, is cut with what follows it, as OpenAI's ``stop`` does).
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of a sequence's new tokens, shown piece by piece: ``push(token)`` returns the text
    that may be shown now ('' while held back); ``stopped`` turns True when the text reaches one
    of ``stops`` (the text is cut before it, and ``push`` shows nothing more); ``close()`` returns
    what was held back at the end (an incomplete character stays as U+FFFD, as decoding gives it)."""

    def __init__(self, render: Callable[[list[int]], str], stops: list[str] | tuple[str, ...] = ()):
        self.render, self.stops = render, [s for s in stops if s]
        self.ids: list[int] = []
        self.shown = 0          # characters of ``text`` shown so far
        self.text = ""          # the text of ``ids``, cut at a stop string when one came
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        self.text = self.render(self.ids)
        cut = self._stop_at()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._show(len(self.text))
        safe = len(self.text) - self._held_back()
        return self._show(safe)

    def close(self) -> str:
        """What is left to show once no token comes."""
        return self._show(len(self.text))

    def _show(self, end: int) -> str:
        if end <= self.shown:
            return ""
        piece, self.shown = self.text[self.shown:end], end
        return piece

    def _stop_at(self) -> int | None:
        """Where the first stop string begins in the text not yet shown, or None."""
        found = [i for i in (self.text.find(s, max(self.shown - len(s) + 1, 0)) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """How many characters at the end of the text wait: an incomplete character, or the longest
        end that begins a stop string."""
        text = self.text
        held = 0
        if text.endswith(REPLACEMENT):
            held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held
