"""A job's quote before the work (``POST /v1/jobs?dry_run=true``, ``jacobian compute --dry-run``).

``quote`` is pure (no TensorFlow, no I/O): from the validated spec, the shapes of the inputs and the
signature, the settings and the persisted plan of this request when one exists (``contracts.plans``), it
says what the job would store (bytes per result array), how many passes it takes (rows, products,
colours), and its predicted peak memory and time, saying whether those are measured (a plan) or guessed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from contracts import estimators, rules
from contracts.jobspec import SEEDS_MEMBER, QueuedJob
from contracts.kinds import Family, KindSpec, kind_spec, multiplies
from contracts.plan_predictions import MAX_CHUNK_ROWS, from_plan, seconds_quoted, untried_strategies
from contracts.plans import bucket_rows
from contracts.savedmodel import VARIABLE_PREFIX, Signature, TensorSpec

Shapes = Mapping[str, tuple[tuple[int, ...], str]]   # input name -> (shape, numpy dtype name)


class ArrayQuote(BaseModel):
    name: str
    shape: list[int] | None = Field(description="null when only the worker can know it")
    dtype: str
    bytes: int | None


class Passes(BaseModel):
    unit: Literal["rows", "products", "colours"]
    count: int | None = Field(description="null when unknown before the work (a sparsity pattern's colours)")
    estimate: bool = Field(description="true when the count depends on convergence or on the worker's checks")
    note: str = ""


class Quote(BaseModel):
    """The answer of a dry run: nothing is queued or written."""

    kind: str
    family: str
    of: str
    wrt: str | list[str]
    mode: str = Field(description="the mode the rows would run in (auto resolved as far as known)")
    arrays: list[ArrayQuote]
    result_bytes: int | None = Field(description="bytes of all result arrays; null when only the worker can know")
    passes: Passes
    predicted_peak_bytes: int | None = Field(
        description="the peak memory of a chunk: from a plan, the latest job's measured peak at the predicted "
                    "chunk size (else the plan's memory line there); else an estimate from the result size")
    peak_bound_bytes: int | None = Field(
        None, description="from a plan: the largest peak any of its jobs measured at the predicted chunk size, else "
                          "its memory line there (above every measured peak): what the worker plans against")
    peak_measure: Literal["allocator", "process_rss", "estimate"] | None = Field(
        None, description="what predicted_peak_bytes counts: TensorFlow's allocator bytes of a chunk; "
                          "process_rss: the growth of the worker process's resident set over a chunk (VmHWM), "
                          "measured on a host job where the allocator's statistics miss the memory (the loop "
                          "strategy, XLA on the CPU); estimate: a guess from the result size")
    predicted_seconds: float | None = Field(
        description="seconds of compute of the whole job on a fresh worker process: the steady chunks "
                    "(predicted_steady_seconds) plus the plan's measured first call (trace, compile; from the "
                    "kept trace where the plan has timed one) of each chunk size the job would run; a worker "
                    "process that has already run this request pays only the steady part. Not counted: loading "
                    "the model, the queue, writing the result. Null without a plan's timing")
    predicted_steady_seconds: float | None = Field(
        None, description="the steady part of predicted_seconds: the chunks at the plan's measured time per chunk, "
                          "no first calls (a worker process that has traced this request)")
    predicted_chunk_rows: int | None = None
    strategy: str | None = None
    untried_strategies: list[str] = Field(
        default_factory=list, description="from a plan: strategies this request could run that no job of the plan "
                                          "has tried. A later job tries one where its compile would pay for itself "
                                          "(a trial) and may switch to it: its peak and time are not in this quote. "
                                          "Empty with a pinned chunk_rows or strategy (no trial runs)")
    guess: bool = Field(description="false: predicted from a persisted plan of this request; true: a guess")
    basis: str
    fits: Literal[True] = True


def concrete_of_shape(sig: Signature, of: str, shapes: Shapes) -> tuple[int, ...] | None:
    """``of``'s shape with its unknown leading dim taken as the inputs' common batch size; None if unknown."""
    spec = sig.outputs[of].shape
    if spec is None or any(d is None for d in spec[1:]):
        return None
    batch = {shapes[n][0][0] for n, s in sig.inputs.items() if s.shape and s.shape[0] is None and n in shapes}
    if spec and spec[0] is None:
        if len(batch) != 1:
            return None
        return (next(iter(batch)),) + tuple(int(d) for d in spec[1:] if d is not None)
    return tuple(int(d) for d in spec if d is not None)


def sources(spec: QueuedJob, variables: Mapping[str, TensorSpec],
            shapes: Shapes) -> list[tuple[str, tuple | None, str]]:
    """``wrt`` as (name, shape, dtype) for each source (``variables/*``: every trainable variable)."""
    wrt = spec.wrt
    names = [VARIABLE_PREFIX + n for n, v in variables.items() if v.trainable is not False] \
        if wrt == "variables/*" else ([wrt] if isinstance(wrt, str) else list(wrt or []))
    out = []
    for name in names:
        if name.startswith(VARIABLE_PREFIX):
            var = variables[name[len(VARIABLE_PREFIX):]]
            shape = None if var.shape is None or any(d is None for d in var.shape) else tuple(var.shape)
            out.append((name, shape, var.dtype))
        else:
            out.append((name, tuple(shapes[name][0]), shapes[name][1]))
    return out


def _elements(shape: tuple[int, ...] | None) -> int | None:
    return None if shape is None else math.prod(shape)


COUNTS = {"iterations": "int64", "residuals": "float64"}   # arrays of counts and residuals (ihvp), not of values


def _arrays(kind: KindSpec, spec: QueuedJob, of_shape: tuple | None, wrt_shape: tuple | None, dtype: str,
            shapes: Shapes) -> list[ArrayQuote]:
    """The result arrays with their shapes (from the registry's ``dims``) and bytes."""
    seeds = shapes.get(SEEDS_MEMBER)
    k = seeds[0][0] if seeds and seeds[0] else (spec.rank if kind.family is Family.spectral else None)
    words: dict[str, tuple[int, ...] | None] = {
        "of": (of_shape[1:] if kind.batch_axis else of_shape) if of_shape is not None else None,
        "wrt": (wrt_shape[1:] if kind.batch_axis else wrt_shape) if wrt_shape is not None else None,
        "batch": wrt_shape[:1] if wrt_shape else None, "seed": None if k is None else (k,),
        "k": None if k is None else (k,)}
    words["wrt2"] = words["wrt"]
    words |= estimators.shape_words(kind.fields, spec.probes, spec.steps, _elements(words["wrt"]))
    out = []
    for name, dims in zip(kind.arrays, kind.dims, strict=True):
        parts = [words.get(d) for d in dims]
        shape = None if any(p is None for p in parts) else [int(n) for p in parts for n in p]  # type: ignore[union-attr]
        own = COUNTS.get(name, dtype)
        size = None if shape is None else math.prod(shape) * np.dtype(own).itemsize
        out.append(ArrayQuote(name=name, shape=shape, dtype=own, bytes=size))
    return out


def resolved_mode(kind: KindSpec, mode: str, of_shape: tuple | None, wrt_shape: tuple | None) -> str:
    """``auto`` as the worker resolves it from the shapes (before its forward-mode check)."""
    if mode != "auto" or kind.family is not Family.dense:
        return mode
    if kind.scalar_of or of_shape is None or wrt_shape is None:
        return "reverse"
    cut = 1 if kind.batch_axis else 0
    return "reverse" if math.prod(of_shape[cut:]) <= math.prod(wrt_shape[cut:]) else "forward"


def _passes(kind: KindSpec, spec: QueuedJob, mode: str, of_shape: tuple | None, wrt_shape: tuple | None,
            shapes: Shapes) -> Passes:
    n_wrt = _elements(wrt_shape)
    per = 2 if multiplies(kind, spec.curvature).curvature else 1   # a curvature product: a JVP and a VJP
    what = "Hessian-vector products" if per == 1 else "curvature products (a JVP and a VJP each)"
    if kind.family is Family.products:
        seeds = shapes.get(SEEDS_MEMBER)
        count = seeds[0][0] * per if seeds and seeds[0] else None
        return Passes(unit="products", count=count, estimate=False,
                      note="one product a seed" if per == 1 else "a JVP and a VJP a seed")
    if kind.family is Family.spectral:
        if "probes" in kind.fields:
            count, note = estimators.products(kind.fields, spec.probes, spec.steps, n_wrt)
            return Passes(unit="products", count=count, estimate=estimators.is_quadrature(kind.fields), note=note)
        algorithm = kind.spectrum.algorithm if kind.spectrum else ""
        if algorithm == "trace_estimate":
            samples = spec.samples or 100
            count = min(samples, n_wrt) if n_wrt else samples
            return Passes(unit="products", count=count * per, estimate=False,
                          note=f"{what} (the exact trace when samples >= the wrt size)")
        if algorithm == "conjugate_gradients":
            seeds = shapes.get(SEEDS_MEMBER)
            k = seeds[0][0] if seeds and seeds[0] else 1
            steps = min(n_wrt or 1000, spec.max_iterations or 1000, 100)
            diagonal, more = 0, ""
            if spec.precondition == "diagonal":   # the Jacobi preconditioner's diagonal, exact or estimated
                diagonal = n_wrt if n_wrt and n_wrt <= estimators.EXACT_DIAGONAL_MAX else estimators.DIAGONAL_PROBES
                more = f", and {diagonal} for the preconditioner's diagonal"
            return Passes(unit="products", count=(k * steps + diagonal) * per, estimate=True,
                          note=f"{what}, one a seed per conjugate-gradient iteration until tol (guessed {steps})"
                          + more)
        rank = spec.rank or 1
        if algorithm == "lanczos":
            count = min(n_wrt, 2 * rank + 10) if n_wrt else 2 * rank + 10
            return Passes(unit="products", count=count * per, estimate=True,
                          note=f"Lanczos steps, one of the {what} each, until the eigenpairs converge")
        width = rank + max(5, rank)
        return Passes(unit="products", count=2 * width, estimate=True,
                      note=f"per subspace iteration (J v and vᵀ J for a block of {width}); iterations until tol")
    if spec.sparsity is not None:
        bound = _elements(wrt_shape if mode == "forward" or kind.scalar_of else of_shape)
        what = "colours (one HVP each)" if kind.scalar_of else "colours"
        return Passes(unit="colours", count=None, estimate=True,
                      note=f"the pattern's {what}, unknown before it is found (at most {bound}, the dense rows)")
    if of_shape is None or wrt_shape is None:
        return Passes(unit="rows", count=None, estimate=True, note="the shapes are known only when the model runs")
    if kind.scalar_of:
        rows = math.prod(wrt_shape)
    else:
        cut = 1 if kind.batch_axis else 0
        rows = math.prod(of_shape[cut:]) if mode == "reverse" else math.prod(wrt_shape[cut:])
    return Passes(unit="rows", count=rows, estimate=spec.mode.value == "auto" and mode == "forward",
                  note="forward mode, unless the worker's check falls back to reverse"
                  if spec.mode.value == "auto" and mode == "forward" else "")


def quote(spec: QueuedJob, sig: Signature, variables: Mapping[str, TensorSpec], shapes: Shapes, *,
          memory_budget_bytes: int | None = None, plan: Mapping[str, Any] | None = None,
          plan_name: str = "") -> Quote:
    """The quote of a validated job (``spec``: ``of`` and ``wrt`` resolved; ``shapes``: every input's shape
    and dtype, the seeds as ``__seeds__``); ``plan``: the persisted plan of this request (JSON), if any,
    named ``plan_name`` in the basis."""
    kind = kind_spec(spec.kind)
    of = spec.of or ""
    of_shape = concrete_of_shape(sig, of, shapes)
    srcs = sources(spec, variables, shapes)
    if any(s[1] is None for s in srcs):
        wrt_shape = None
    elif len(srcs) == 1:
        wrt_shape = srcs[0][1]
    else:   # several sources, concatenated into one wrt axis (with the batch axis kept for batch_jacobian)
        per = [s[1][1:] if kind.batch_axis else s[1] for s in srcs]  # type: ignore[index]
        flat = (sum(math.prod(p) for p in per),)
        wrt_shape = (srcs[0][1][0],) + flat if kind.batch_axis else flat  # type: ignore[index]
    wrt_dtype = srcs[0][2] if srcs else "float32"
    for s in srcs[1:]:
        wrt_dtype = rules.result_dtype(wrt_dtype, s[2])
    dtype = rules.result_dtype(sig.outputs[of].dtype, wrt_dtype, spec.output_dtype)
    mode = resolved_mode(kind, spec.mode.value, of_shape, wrt_shape)
    if plan is not None and (plan.get("checked") or {}).get("mode"):
        mode = str(plan["checked"]["mode"])
    arrays = _arrays(kind, spec, of_shape, wrt_shape, dtype, shapes)
    passes = _passes(kind, spec, mode, of_shape, wrt_shape, shapes)
    sparse = spec.sparsity is not None
    total = None if sparse or any(a.bytes is None for a in arrays) else sum(a.bytes or 0 for a in arrays)
    if sparse:
        arrays = [ArrayQuote(name=n, shape=None, dtype="int64" if n != "values" else dtype, bytes=None)
                  for n in ("rows", "cols", "values")]
    input_bytes = sum(math.prod(s) * np.dtype(d).itemsize for s, d in shapes.values())
    budget = spec.memory_budget_bytes or memory_budget_bytes
    fields: dict[str, Any] = {}
    if plan is not None and passes.unit == "rows" and passes.count:
        try:
            batch = wrt_shape[0] if kind.batch_axis and wrt_shape else None
            peak, bound, secs, k, label = from_plan(plan, passes.count, batch=batch, chunk_rows=spec.chunk_rows,
                                                     budget=budget)
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(plan.get("updated_at") or 0)))
            rss = plan["strategies"][label].get("peak_measure") == "process_rss"
            fields = {"predicted_peak_bytes": peak, "peak_bound_bytes": bound, "predicted_chunk_rows": k,
                      "strategy": label, "guess": False,
                      "basis": f"persisted plan {plan_name} from {when} ({label}; jobs: {plan.get('jobs', 0)}; on "
                               f"{(plan.get('key') or {}).get('device', 'a device')})"
                               + ("; peak: the process's resident-set growth over a chunk, not allocator bytes"
                                  if rss else ""),
                      "peak_measure": "process_rss" if rss else "allocator"}
            timing = seconds_quoted(plan, label, passes.count, k, secs, forced=spec.chunk_rows is not None)
            fields |= {**timing, "basis": fields["basis"] + timing.get("basis", "")}
            untried = untried_strategies(plan, spec)
            if untried:
                fields |= {"untried_strategies": untried,
                           "basis": fields["basis"] + f"; not tried yet: {', '.join(untried)} (a job that tries one "
                                                      "and switches to it has another peak and time)"}
        except (KeyError, ValueError, TypeError, ZeroDivisionError):
            fields = {}
    if not fields:
        fields = _guess(passes, total, input_bytes, spec, plan is not None)
        rates = ((plan or {}).get("strategies") or {}).get(str((plan or {}).get("strategy")), {}).get("rates")
        if rates and passes.unit == "rows" and passes.count:   # timed, but its memory not yet measured
            label = str(plan["strategy"])  # type: ignore[index]
            k = min(bucket_rows(passes.count), MAX_CHUNK_ROWS, max(int(r) for r in rates))
            timing = seconds_quoted(plan, label, passes.count, k,  # type: ignore[arg-type]
                              passes.count / max(map(float, rates.values())), forced=False)
            fields |= {"strategy": label, "predicted_seconds": timing["predicted_seconds"],
                       "predicted_steady_seconds": timing["predicted_steady_seconds"],
                       "basis": f"time from persisted plan {plan_name} ({label}'s best rows/s)"
                                f"{timing.get('basis', '')}; peak memory not measured yet, {fields['basis']}"}
    return Quote(kind=kind.name, family=kind.family.value, of=of,
                 wrt=spec.wrt if spec.wrt is not None else "", mode=mode, arrays=arrays,
                 result_bytes=total, passes=passes, **fields)


def _guess(passes: Passes, total: int | None, input_bytes: int, spec: QueuedJob, had_plan: bool) -> dict[str, Any]:
    """Without a usable plan: the inputs, one chunk of result rows and the same again for the gradients."""
    why = "a guess" if had_plan else "no plan for this model yet"
    if passes.unit == "rows" and passes.count and total is not None:
        k = min(spec.chunk_rows or MAX_CHUNK_ROWS, bucket_rows(passes.count))
        chunk = total // passes.count * min(k, passes.count)
        return {"predicted_peak_bytes": input_bytes + 2 * chunk, "predicted_seconds": None,
                "peak_measure": "estimate",
                "predicted_chunk_rows": min(k, passes.count), "guess": True,
                "basis": f"{why}: from result size only (inputs + 2 x one chunk of {min(k, passes.count)} rows)"
                         + ("" if had_plan else "; the time is known after a first job")}
    peak = None if total is None else input_bytes + 2 * total
    return {"predicted_peak_bytes": peak, "predicted_seconds": None, "guess": True,
            "peak_measure": None if peak is None else "estimate",
            "basis": f"{why}: from result size only (inputs + 2 x the result); the time is known after a first job"}
