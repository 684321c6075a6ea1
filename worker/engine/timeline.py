"""Where a run's seconds went: every strategy call by strategy, rows and whether the size was new to the process
(the first call of a strategy traces it, and XLA compiles each new size); the eager reference
rows that check new chunk sizes; handing the rows on (``on_chunk``: the result writer); the rest of the run's
wall time is the planner's own. In a run's status (and a job's manifest) as ``time``: a job whose compute took
twice what its chunks add up to says here where the difference went."""

from __future__ import annotations

import time
from typing import Any


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.calls: dict[tuple[str, int, bool], list[float]] = {}   # (label, rows, new size) -> [calls, s, max s]
        self.failed: dict[tuple[str, int, bool], list[float]] = {}  # calls that raised (out of memory, ...)
        self.reference_s = 0.0
        self.deliver_s = 0.0

    def call(self, label: str, rows: int, new: bool, seconds: float, *, failed: bool = False) -> None:
        entry = (self.failed if failed else self.calls).setdefault((label, rows, new), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] = max(entry[2], seconds)

    def to_json(self) -> dict[str, Any]:
        """``calls``: ``[strategy, rows, new size, calls, seconds, slowest]`` in the order first seen (and
        ``failed_calls`` alike, where any raised); the seconds of each part (``calls_s``: both) and ``wall_s``
        since the run began, ``other_s`` what no part accounts for."""
        wall = time.perf_counter() - self.t0
        calls_s = sum(s for (_, s, _) in [*self.calls.values(), *self.failed.values()])
        out: dict[str, Any] = {"calls": _rows(self.calls)}
        if self.failed:
            out["failed_calls"] = _rows(self.failed)
        return out | {"calls_s": round(calls_s, 3), "reference_s": round(self.reference_s, 3),
                      "deliver_s": round(self.deliver_s, 3), "wall_s": round(wall, 3),
                      "other_s": round(wall - calls_s - self.reference_s - self.deliver_s, 3)}


def _rows(table: dict[tuple[str, int, bool], list[float]]) -> list[list[Any]]:
    return [[label, k, new, int(n), round(s, 3), round(top, 3)] for (label, k, new), (n, s, top) in table.items()]
