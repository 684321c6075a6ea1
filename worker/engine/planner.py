"""Chunk planning: a memory bound from measured peaks, the largest bucket that fits free memory, and
never more than twice the largest chunk size ever timed.

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
    """``value(k) = fixed + per_row * k``."""

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


def fit_bound(points: dict[int, float], *, floor_per_row: float = 0.0) -> LinearFit:
    """A line at or above every measured ``{rows: peak bytes}``: a bound, not an average.

    The slope is the steepest marginal bytes per row between consecutive measured sizes (one size
    alone: its peak over its rows, as if nothing were fixed), at least ``floor_per_row`` and the
    largest peak over its rows / 64; the intercept is the least that puts every point under the line.
    ``fit_bound({8: 100, 16: 300, 32: 400}).per_row == 25``: it predicts 200, 400 and 800 there.
    """
    sizes = sorted(k for k in points if k > 0)
    if not sizes:
        return LinearFit(0.0, max(floor_per_row, 0.0))
    if len(sizes) == 1:
        k = sizes[0]
        return LinearFit(0.0, max(points[k] / k, floor_per_row, 0.0))
    slopes = [(points[b] - points[a]) / (b - a) for a, b in zip(sizes, sizes[1:])]
    per_row = max(max(slopes), floor_per_row, max(points[k] for k in sizes) / sizes[-1] / 64.0, 0.0)
    fixed = max(0.0, max(points[k] - per_row * k for k in sizes))
    return LinearFit(fixed=fixed, per_row=per_row)



# Why a row is the smallest unit, and what asks for less: rematerialisation (recomputing activations instead of
# keeping them, ``tf.recompute_grad``) checkpoints between Python-level blocks of a model, and a SavedModel's
# signature is one traced graph with no such blocks, so one row's backward pass keeps the whole forward pass.
LESS_THAN_A_ROW = ("one row cannot be split further (its backward pass keeps the model's activations; a "
                   "SavedModel signature is one graph that TensorFlow cannot rematerialise by blocks), so ask for "
                   "less than whole rows: kind 'vjp' with the rows you need as seeds, 'svd' or 'jvp', sparsity "
                   "'auto', or batch_jacobian for a model whose examples are independent")


def check_one_row_fits(memory: LinearFit, *, free_bytes: int, budget_bytes: int | None, safety: float) -> float:
    """The usable bytes, ``safety * min(free, budget)``; raises MemoryBudgetTooSmall when one row does not fit."""
    limit = free_bytes if budget_bytes is None else min(free_bytes, budget_bytes)
    usable = safety * limit
    if memory(1) > usable:
        field = "memory_budget_bytes" if budget_bytes is not None and budget_bytes <= free_bytes else None
        need = int(math.ceil(memory(1) / safety))
        where = (f"memory_budget_bytes={budget_bytes}" if field else f"{free_bytes} free bytes")
        raise MemoryBudgetTooSmall(
            f"one Jacobian row needs about {need} bytes but only {where} are available; "
            f"raise memory_budget_bytes to at least {need} or free device memory; {LESS_THAN_A_ROW}",
            field=field or "memory_budget_bytes")
    return usable


def plan_chunk(*, rows_total: int, memory: LinearFit, free_bytes: int, budget_bytes: int | None = None,
               largest_timed_rows: int, safety: float = 0.8, seconds: LinearFit | None = None,
               throughput_fraction: float = 0.9, min_rows: int = 32, max_rows: int = 4096,
               preferred_rows: int | None = None, peaks: dict[int, int] | None = None) -> int:
    """Largest power-of-two chunk whose predicted peak fits ``safety * min(free, budget)``, and at most
    twice ``largest_timed_rows`` (the largest chunk size timed: a memory line is not extrapolated
    further than one doubling past what was measured, however much memory is free).

    ``preferred_rows`` (the chunk a calibration kept: the last doubling that bought rows/s) caps it
    too. Without it, ``seconds`` (time per chunk as a line in rows) stops the chunk at
    ``throughput_fraction`` of the attainable rows/s (never below ``min_rows``; memory still may).
    ``peaks`` (the largest peak measured per size) stand for the line at the sizes they were measured
    at: the bound through all of them lies above some of them, a measurement is what that size needs.
    Raises MemoryBudgetTooSmall when one row does not fit.
    """
    usable = check_one_row_fits(memory, free_bytes=free_bytes, budget_bytes=budget_bytes, safety=safety)
    cap = min(bucket_rows(rows_total), bucket_rows(max_rows), max(1, 2 * largest_timed_rows))
    if preferred_rows is not None:
        cap = min(cap, bucket_rows(preferred_rows))
    elif seconds is not None and seconds.per_row > 0:
        # rows/s(k) = k / (fixed + per_row k) reaches fraction f of 1/per_row at k = f/(1-f) * fixed/per_row.
        enough = throughput_fraction / (1 - throughput_fraction) * seconds.fixed / seconds.per_row
        cap = min(cap, max(bucket_rows(min_rows), bucket_rows(max(1, int(math.ceil(enough))))))
    peaks = peaks or {}
    k = 1
    while k * 2 <= cap and peaks.get(k * 2, memory(k * 2)) <= usable:
        k *= 2
    return k
