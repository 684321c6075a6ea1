"""Streams for progress tests: a terminal as far as ``isatty()`` tells, a clock to set, and the plain-log check."""

from __future__ import annotations

import io


class FakeTTY(io.StringIO):
    """A terminal as far as ``isatty()`` tells."""

    def isatty(self) -> bool:
        return True


class Clock:
    """A monotonic clock that moves only when told (``clock.t += s``)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def plain_lines(text: str) -> list[str]:
    """The lines of a log: none redrawn (no carriage return) and no ANSI code."""
    assert "\r" not in text and "\x1b" not in text, repr(text)
    assert text.endswith("\n")
    return text.splitlines()
