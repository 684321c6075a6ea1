"""Chunk planning: bytes per row from measured peaks, the largest bucket that fits free memory.

Budgets are bytes, not rows. Buckets are powers of two so a handful of compiled shapes serve
every job; the last chunk of a range is padded to its bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contracts.plans import bucket_rows as bucket_rows  # re-exported: the engine's name for it
from worker.engine.errors import MemoryBudgetTooSmall


@dataclass(frozen=True)
class LinearFit:
    """``value(k) = fixed + per_row * k``, fitted through two measurements."""

    fixed: float
    per_row: float

    def __call__(self, k: int) -> float:
        return self.fixed + self.per_row * k


def fit_linear(k1: int, v1: float, k2: int, v2: float) -> LinearFit:
    """Line through ``(k1, v1)`` and ``(k2, v2)``; slope at least ``v2 / k2 / 64`` and fixed >= 0."""
    if k2 == k1:
        raise ValueError("fit_linear needs two different chunk sizes")
    per_row = (v2 - v1) / (k2 - k1)
    per_row = max(per_row, max(v1, v2) / max(k1, k2) / 64.0, 0.0)
    fixed = max(0.0, v2 - per_row * k2)
    return LinearFit(fixed=fixed, per_row=per_row)



def plan_chunk(*, rows_total: int, memory: LinearFit, free_bytes: int, budget_bytes: int | None = None,
               safety: float = 0.8, seconds: LinearFit | None = None, throughput_fraction: float = 0.9,
               min_rows: int = 32, max_rows: int = 4096, preferred_rows: int | None = None,
               whole_fraction: float = 0.1) -> int:
    """Largest power-of-two chunk whose predicted peak fits ``safety * min(free, budget)``.

    When ``seconds`` (time per chunk as a line in rows) is given, the chunk also stops growing
    once it reaches ``throughput_fraction`` of the attainable rows/s: past that, bigger chunks
    cost memory and buy little speed. That cap never goes below ``min_rows`` (a noisy timing fit
    with no fixed cost must not shrink chunks to one row); memory still may. ``preferred_rows``
    (the fastest chunk actually measured, when rows/s stopped growing) replaces that estimate.
    A job whose rows all fit in ``whole_fraction`` of the usable memory runs as one chunk:
    chunking it would only add per-call overhead.
    Raises MemoryBudgetTooSmall when one row does not fit.
    """
    limit = free_bytes if budget_bytes is None else min(free_bytes, budget_bytes)
    usable = safety * limit
    if memory(1) > usable:
        field = "memory_budget_bytes" if budget_bytes is not None and budget_bytes <= free_bytes else None
        need = int(math.ceil(memory(1) / safety))
        where = (f"memory_budget_bytes={budget_bytes}" if field else f"{free_bytes} free bytes")
        raise MemoryBudgetTooSmall(
            f"one Jacobian row needs about {need} bytes but only {where} are available; "
            f"raise memory_budget_bytes to at least {need} or free device memory", field=field or "memory_budget_bytes")
    cap = min(bucket_rows(rows_total), bucket_rows(max_rows))
    if cap == bucket_rows(rows_total) and memory(cap) <= whole_fraction * usable:
        return cap
    if preferred_rows is not None:
        # A measured sweet spot (rows/s no longer grew past it): no extrapolation.
        cap = min(cap, bucket_rows(preferred_rows))
    elif seconds is not None and seconds.per_row > 0:
        # rows/s(k) = k / (fixed + per_row k) reaches fraction f of 1/per_row at k = f/(1-f) * fixed/per_row.
        enough = throughput_fraction / (1 - throughput_fraction) * seconds.fixed / seconds.per_row
        cap = min(cap, max(bucket_rows(min_rows), bucket_rows(max(1, int(math.ceil(enough))))))
    k = 1
    while k * 2 <= cap and memory(k * 2) <= usable:
        k *= 2
    return k
