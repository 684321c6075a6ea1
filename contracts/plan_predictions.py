"""What a persisted plan predicts of a job (``contracts.quote``'s figures from a plan): the chunk size, its peak
and the bound, the steady seconds and the first calls a fresh worker process would make, the strategy a fresh
process would start with, and the strategies a later job may still try. Pure: the plan as its JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from contracts.plans import bucket_rows

if TYPE_CHECKING:
    from contracts.jobspec import QueuedJob

MAX_CHUNK_ROWS = 4096   # the planner's largest chunk (worker.engine.planner.plan_chunk)
SAFETY = 0.8            # the planner's share of a memory budget a chunk may use
RECHECK_CHUNKS = 16     # a plan's kept size is checked against half of it with this many chunks to run
                        # (worker.engine.tuning.RECHECK_CHUNKS)


def _line(value: Any, scale: float = 1.0) -> tuple[float, float] | None:
    return None if not value else (float(value[0]) * scale, float(value[1]) * scale)


class PlanPrediction(NamedTuple):
    peak: int               # bytes: the latest job's peak at ``chunk_rows`` where it ran, else the memory line
    bound: int              # bytes: the largest peak any job measured there, else the memory line
    seconds: float | None   # steady seconds of the rows (no first calls)
    chunk_rows: int
    strategy: str


def from_plan(plan: Mapping[str, Any], rows: int, *, batch: int | None, chunk_rows: int | None,
               budget: int | None) -> PlanPrediction:
    """Peak bytes (predicted, bound), seconds and chunk rows the plan's strategy predicts for ``rows``. When the
    plan ran that chunk size at this batch: the latest job's peak there, and the largest any job measured (a
    bound); else its memory line, a bound, for both. Raises KeyError/ValueError when the plan has no memory line.
    The largest peak alone overstates the next job where peaks are a few MiB of RSS growth: a transformer was
    quoted 3.0 MiB (the cold job's) against the warm job's 2.2."""
    label = str(plan["strategy"])
    record = plan["strategies"][label]
    measured_at = record.get("batch")
    scale = batch / measured_at if batch and measured_at and batch > measured_at else 1.0
    memory = _line(record.get("memory"), scale)
    if memory is None:
        raise ValueError("no memory line")
    seconds = _line(record.get("seconds"))
    if chunk_rows is not None:
        k = min(chunk_rows, rows)
    else:
        cap = min(bucket_rows(rows), MAX_CHUNK_ROWS)
        if record.get("preferred_rows"):
            cap = min(cap, bucket_rows(int(record["preferred_rows"])))
        k = 1
        while k * 2 <= cap and (budget is None or memory[0] + memory[1] * k * 2 <= SAFETY * budget):
            k *= 2
    peak = bound = int(memory[0] + memory[1] * k)   # the bound through every peak measured
    measured = (record.get("peaks") or {}).get(str(k))
    if measured and scale == 1.0:   # this size was run at this batch: the latest job's peak, and the largest
        bound = int(measured)
        peak = int((record.get("last_peaks") or {}).get(str(k)) or measured)
    chunks = math.ceil(rows / k)
    if seconds is not None:
        secs: float | None = chunks * (seconds[0] + seconds[1] * k)
    else:
        rates = record.get("rates") or {}
        secs = rows / max(map(float, rates.values())) if rates else None
    return PlanPrediction(peak, bound, secs, k, label)


def first_call_sizes(label: str, rows: int, k: int, *, timed: Any = (), forced: bool = False) -> list[int]:
    """The chunk sizes a fresh worker process would call first when it runs ``rows`` rows at ``k`` under ``label``
    (``worker.engine.chunk_run``; XLA pads a call to a power of two): ``k``; the tail's size where fewer rows
    are left than ``k`` and more than ``k`` would pad (a call pads only up to the bucket of the rows left);
    half of ``k`` where the plan timed it and the job has ``RECHECK_CHUNKS`` chunks (its kept size is checked
    again). ``forced``: the request's ``chunk_rows`` (no padding, no check)."""
    def size(n: int) -> int:
        return bucket_rows(n) if label.endswith("+xla") else n

    if rows <= k:
        return [size(rows)]
    sizes = {size(k)}
    tail = rows % k
    if tail and (forced or not tail <= k <= bucket_rows(tail)):
        sizes.add(size(tail))
    if not forced and k // 2 in {int(t) for t in timed} and rows >= RECHECK_CHUNKS * k:
        sizes.add(size(k // 2))
    return sorted(sizes)


def first_call_s(record: Mapping[str, Any]) -> float | None:
    """A strategy's first call in a fresh process: from its kept trace where the plan timed one (``kept_compile_s``,
    ``worker.engine.trace_cache``), else traced (``compile_s``); None when neither was measured."""
    kept, traced = record.get("kept_compile_s"), record.get("compile_s")
    return float(kept) if kept is not None else None if traced is None else float(traced)


def new_size_cost(label: str, *, compile_s: float | None, resize_s: float | None) -> float | None:
    """What a new chunk size's first call costs ``label`` beyond a steady call (None: not measured): the engine's
    doubling (``ChunkRun.repays_first_call``) and a quote's first calls (``first_calls``) alike. An XLA function
    compiles each shape (``compile_s``); any other takes the chunk's size as a tensor, so its trace is paid once per
    process whatever the size, and a new size costs only its own first call (``resize_s``: 2-135 ms on the CPU,
    against a trace of 0.2-2.7 s, small models to MobileNetV3Small)."""
    return compile_s if label.endswith("+xla") else resize_s


def first_calls(plan: Mapping[str, Any], label: str, rows: int, k: int, *, forced: bool) -> tuple[float, int] | None:
    """Seconds of the first calls a fresh process would make at the chunk sizes it would call (``first_call_sizes``)
    and how many; None when the plan has not measured the first one. The first is the trace (``first_call_s``), each
    further size its ``new_size_cost``."""
    record = plan["strategies"][label]
    compile_s = first_call_s(record)
    if compile_s is None:
        return None
    sizes = first_call_sizes(label, rows, k, timed=record.get("rates") or {}, forced=forced)
    later = new_size_cost(label, compile_s=record.get("compile_s"), resize_s=record.get("resize_s"))
    return float(compile_s) + float(later or 0.0) * max(len(sizes) - 1, 0), len(sizes)


def untried_strategies(plan: Mapping[str, Any], spec: QueuedJob) -> list[str]:
    """The plan's strategies no job has tried (``status`` untried), in the plan's order; none where the job pins its
    chunk size or strategy, since such a job runs no trial (``worker.engine.trial.maybe_trial``). A quote from a
    plan of one job cannot foresee the trial the next job runs: EfficientNetB0 was quoted 279 MiB at 8 rows of
    ``tiled`` and ran 111 MiB after its trial switched to ``vectorized``."""
    if spec.chunk_rows is not None or spec.strategy is not None:
        return []
    return [label for label, record in (plan.get("strategies") or {}).items() if record.get("status") == "untried"]


def seconds_quoted(plan: Mapping[str, Any], label: str, rows: int, k: int, steady: float | None, *,
             forced: bool) -> dict[str, Any]:
    """``predicted_seconds`` (a fresh worker process: ``steady`` plus the first calls, ``first_calls``) and
    ``predicted_steady_seconds``, and what the basis says of them."""
    if steady is None:
        return {"predicted_seconds": None, "predicted_steady_seconds": None}
    first = first_calls(plan, label, rows, k, forced=forced)
    if first is None:
        return {"predicted_seconds": round(steady, 4), "predicted_steady_seconds": round(steady, 4),
                "basis": "; first calls not measured yet: the seconds are the steady chunks only"}
    seconds, sizes = first
    out = {"predicted_seconds": round(steady + seconds, 4), "predicted_steady_seconds": round(steady, 4),
           "basis": f"; seconds on a fresh worker process: {round(steady, 4)} s of steady chunks and "
                    f"{round(seconds, 4)} s of first calls ({sizes} chunk size{'s' if sizes > 1 else ''})"}
    rent = cheaper_to_start(plan, label, rows, steady + seconds) if not forced else None
    if rent is not None:   # a fresh process runs what finishes the job first (worker.engine.trial.strategy_for_job)
        other, total = rent
        out["predicted_seconds"] = round(total, 4)
        out["basis"] = (f"; seconds on a fresh worker process: {round(total, 4)} s with {other}, which compiles "
                        f"faster than {label} and finishes this job first (its compile and best rows/s)")
    return out


def cheaper_to_start(plan: Mapping[str, Any], label: str, rows: int, total: float) -> tuple[str, float] | None:
    """Another verified strategy of the plan whose compile plus ``rows`` at its best rows/s beats ``total`` (the
    plan's strategy on a fresh process), as a fresh process chooses (``strategy_for_job``); None if none."""
    best: tuple[str, float] | None = None
    for other, record in (plan.get("strategies") or {}).items():
        rates = record.get("rates") or {}
        first = first_call_s(record)
        if other == label or record.get("status") != "ok" or not record.get("verified") or not rates or first is None:
            continue
        seconds = first + rows / max(map(float, rates.values()))
        if seconds < total and (best is None or seconds < best[1]):
            best = (other, seconds)
    return best
