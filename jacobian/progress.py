"""Progress of a job's rows on stderr, drawn by tqdm: a live bar on a terminal, plain lines elsewhere.

On a terminal (``stream.isatty()``) a tqdm bar is redrawn in place::

     50.0%|█████     | rows 8/16 [00:01<00:01,  7.52 rows/s, running, strategy vectorized]

Anywhere else (CI, a log file, a pipe) nothing is redrawn: one plain line every ``every_s`` seconds
(``PLAIN_EVERY_S``), one more when the state changes or the last row is done, and a last one on
``close()`` if that state was not printed yet; no carriage return, no ANSI code::

    rows 8/16 (50.0%), 7.52 rows/s, eta 00:01, elapsed 00:01, running, strategy vectorized

The rate is the one reported (by the engine, or the API's record) when given, else measured here
from the rows seen since the first update. The TTY bar takes tqdm's ``TQDM_*`` variables
(e.g. ``TQDM_NCOLS``, ``TQDM_MININTERVAL``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["PLAIN_EVERY_S", "RowProgress", "is_terminal"]

PLAIN_EVERY_S = 10.0
BAR_FORMAT = "{percentage:5.1f}%|{bar}| rows {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"


class _Bar(tqdm):
    """A tqdm bar that draws the rate it is told (the engine's or the API's) rather than its own guess."""

    monitor_interval = 0  # updates are explicit; no refresh thread

    def __init__(self, *args: Any, reported_rate: float | None = None, **kwargs: Any) -> None:
        self.reported_rate = reported_rate
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        values = dict(super().format_dict)
        if self.reported_rate:
            values["rate"] = self.reported_rate
        return values


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class RowProgress:
    """Rows done of a total on ``stream`` (default stderr): a tqdm bar on a terminal, else plain lines.

    ``update(done, total, rate=, eta=)`` after each chunk or poll; ``set_state`` names the job's
    state or strategy shown after the rate; ``note(text)`` prints a line of its own without breaking
    the bar; ``close()`` ends it (also as a context manager). ``enabled=False``: nothing at all.
    ``terminal`` overrides the ``isatty()`` test; ``every_s`` and ``clock`` pace the plain lines.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, terminal: bool | None = None,
                 every_s: float = PLAIN_EVERY_S, state: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.terminal = is_terminal(self.stream) if terminal is None else terminal
        self.every_s = every_s
        self.state = state
        self.clock = clock
        self._bar: _Bar | None = None
        self._bar_state = ""
        self._last: tuple[int, int | None, float | None, float | None] | None = None  # done, total, rate, eta
        self._first: tuple[float, int] | None = None  # (time, rows done) of the first update
        self._printed_at: float | None = None
        self._printed_key: tuple[int, int | None, str] | None = None
        self._closed = False

    def __enter__(self) -> RowProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what callers use ----------------------------------------------------------------------

    def set_state(self, state: str) -> None:
        """The state or strategy shown after the rate (from the next update on)."""
        self.state = state

    def update(self, done: int, total: int | None, *, rate: float | None = None, eta: float | None = None,
               state: str | None = None) -> None:
        """``done`` rows of ``total`` (None: not known yet); ``rate`` rows/s and ``eta`` seconds as reported."""
        if not self.enabled or self._closed:
            return
        if state is not None:
            self.state = state
        now = self.clock()
        done = int(done)
        if self._first is None:
            self._first = (now, done)
        self._last = (done, total, _number(rate), _number(eta))
        if self.terminal:
            self._draw(done, total, self._last[2])
        else:
            self._plain(now, force=False)

    def note(self, text: str) -> None:
        """A line of its own (a plan change, say) above the bar, which is redrawn under it."""
        if not self.enabled:
            return
        if self._bar is not None and not self._closed:
            _Bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar on its own line (a terminal), or print the last state if it was not printed yet."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif not self.terminal and self._last is not None:
            self._plain(self.clock(), force=True)

    # -- terminal ------------------------------------------------------------------------------

    def _draw(self, done: int, total: int | None, rate: float | None) -> None:
        if self._bar is None:
            self._bar = _Bar(total=total, initial=done, file=self.stream, bar_format=BAR_FORMAT, unit=" rows",
                             dynamic_ncols=True, miniters=1, leave=True, postfix=self.state or None,
                             reported_rate=rate)  # drawn at once
            self._bar_state = self.state
            return
        bar = self._bar
        changed = total != bar.total or self.state != self._bar_state
        bar.total, bar.reported_rate = total, rate
        if changed:
            bar.set_postfix_str(self.state, refresh=False)
            self._bar_state = self.state
        shown = bool(bar.update(done - bar.n)) if done != bar.n else False  # tqdm paces its redraws
        if not shown and (changed or (total is not None and done >= total)):
            bar.refresh()

    # -- plain lines ---------------------------------------------------------------------------

    def _plain(self, now: float, *, force: bool) -> None:
        assert self._last is not None
        done, total, _rate, _eta = self._last
        key = (done, total, self.state)
        periodic = self._printed_at is None or now - self._printed_at >= self.every_s
        if key == self._printed_key:  # nothing new: printed again only by the period
            due = periodic and not force
        else:  # the period, the first line, a new total or state, the last row, or close()
            due = (periodic or force or self._printed_key is None or key[1:] != self._printed_key[1:]
                   or (total is not None and done >= total))
        if due:
            print(self.line(now), file=self.stream, flush=True)
            self._printed_at, self._printed_key = now, key

    def line(self, now: float | None = None) -> str:
        """The plain line for the last update, e.g. ``rows 8/16 (50.0%), 7.52 rows/s, eta 00:01, elapsed 00:01``."""
        if self._last is None or self._first is None:
            return "rows 0/?"
        now = self.clock() if now is None else now
        done, total, rate, eta = self._last
        elapsed = max(0.0, now - self._first[0])
        if not rate and elapsed > 0 and done > self._first[1]:
            rate = (done - self._first[1]) / elapsed
        if total is not None and done >= total:
            eta = 0.0
        elif eta is None and rate and total is not None:
            eta = (total - done) / rate
        percent = f" ({100.0 * done / total:.1f}%)" if total else (" (100.0%)" if total == 0 else "")
        parts = [f"rows {done}/{'?' if total is None else total}{percent}",
                 f"{rate:.2f} rows/s" if rate else "? rows/s",
                 f"eta {tqdm.format_interval(eta)}" if eta is not None else "eta ?",
                 f"elapsed {tqdm.format_interval(elapsed)}"]
        return ", ".join(parts + ([self.state] if self.state else []))
