"""Dense kinds over several ``wrt`` (a list, or ``"variables/*"``): J, a batch Jacobian or H over one concatenated
``wrt`` axis (``wrt_slices`` says where each source lies), row blocks by products of one-hot seeds.

Rows, by kind and mode (each row one product of the matrix-free ``Operator``):
- ``jacobian`` reverse: a row per element of ``of``, ``e_i^T J`` (VJP), shape ``of.shape + (n_wrt,)``;
  forward: a column per element of the axis, ``J e_j`` (JVP), same shape, rows along the last axis;
- ``batch_jacobian``: a row per feature of ``of`` (all examples at once: the one-hot cotangent on that feature of
  every example), ``(B,) + of.shape[1:] + (n,)`` with ``n`` the sources' per-example sizes summed;
- ``hessian``: a row per element of the axis, ``H e_j`` (HVP), shape ``(n_wrt, n_wrt)``.
Rows stream into the ``jacobian`` array through the ``ResultWriter``: committed storage blocks are the unit of
resume and of shards, as for one ``wrt``. Never more than the rows of one run of blocks are held.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from contracts.layout import ResultLayout
from worker.execution.base import Executor, ShardHost
from worker.execution.matrix_free import one_hot_rows, operator
from worker.pipeline import ProgressMeter, manifest_fields_for
from worker.sharding import ShardPlan, choose_shards, split_rows
from worker.storage import ResultWriter

if TYPE_CHECKING:
    from worker.execution.context import RunContext

HELD_BYTES = 256 << 20   # products held at once: runs of whole storage blocks up to this (at least one)


class Stacked:
    """One request's rows: the product kind, the layout, and how a run of rows becomes seeds and rows."""

    def __init__(self, ctx: RunContext, block_bytes: int | None) -> None:
        job = ctx.job
        kind = job.kind.value
        self.kind = kind
        self.batch = ctx.spec.batch_axis
        self.product = "hvp" if ctx.spec.scalar_of else "vjp"
        op, _ = operator(ctx, kind=self.product)
        self.op = op
        if not self.batch and not ctx.spec.scalar_of:
            forward = job.mode.value == "forward" or (job.mode.value == "auto" and op.n_of > op.n_wrt)
            self.product = "jvp" if forward else "vjp"
        self.mode = "forward" if self.product == "jvp" else "reverse"
        self.dtype = np.dtype(op.dtype)
        of_shape, n = tuple(op.of_shape), op.n_wrt
        if self.batch:
            b = of_shape[0] if of_shape else 0
            self._check_batch(b)
            self.per_example = n // max(1, b)
            shape, it = (b,) + of_shape[1:] + (self.per_example,), (1, len(of_shape))
            names = ["batch"] + [f"of_{i}" for i in range(1, len(of_shape))] + ["wrt"]
        elif self.product == "hvp":
            shape, it, names = (n, n), (0, 1), ["wrt", "wrt2"]
        elif self.product == "jvp":
            shape, it = of_shape + (n,), (len(of_shape), len(of_shape) + 1)
            names = [f"of_{i}" for i in range(len(of_shape))] + ["wrt"]
        else:
            shape, it = of_shape + (n,), (0, len(of_shape))
            names = [f"of_{i}" for i in range(len(of_shape))] + ["wrt"]
        self.layout = ResultLayout(shape, it[0], it[1], self.dtype.itemsize,
                                   block_bytes=block_bytes or ResultLayout(shape, 0, 0).block_bytes)
        self.attrs = {**op.attrs(), "kind": kind, "mode": self.mode, "shape": list(shape),
                      "wrt_shape": [self.per_example if self.batch else n], "rows_total": self.layout.rows_total,
                      "iter_start": it[0], "iter_stop": it[1], "dimension_names": names,
                      "labels": op.labels}

    def _check_batch(self, batch: int) -> None:
        from worker.engine.errors import InvalidRequest

        for name, s in self.op.axis.slices.items():
            if not s["shape"] or s["shape"][0] != batch:
                raise InvalidRequest(f"wrt: batch_jacobian needs a batch axis of {batch} (of's axis 0) on every "
                                     f"source, and {name!r} has shape {s['shape']}; use kind 'jacobian'",
                                     field="wrt")

    def seeds(self, start: int, stop: int) -> np.ndarray:
        """The one-hot seeds of rows ``start:stop``: ``(k,) + of.shape`` (VJP) or ``(k, n_wrt)``."""
        op = self.op
        if self.product != "vjp":
            return one_hot_rows(start, stop, op.n_wrt, op.compute_dtype)
        if not self.batch:
            return one_hot_rows(start, stop, op.n_of, op.compute_dtype).reshape((stop - start,) + tuple(op.of_shape))
        b, features = op.of_shape[0], math.prod(op.of_shape[1:])
        one = one_hot_rows(start, stop, features, op.compute_dtype)          # (k, features)
        return np.broadcast_to(one[:, None, :], (stop - start, b, features)).reshape(
            (stop - start,) + tuple(op.of_shape))

    def rows(self, products: np.ndarray) -> np.ndarray:
        """Products ``(k, ...)`` as rows ``(k,) + layout.row_shape``: per example for a batch Jacobian."""
        k = len(products)
        if not self.batch:
            return np.asarray(products, self.dtype).reshape((k,) + self.layout.row_shape)
        b = self.op.of_shape[0]
        flat = np.asarray(products).reshape(k, -1)
        parts = [flat[:, s["start"]:s["stop"]].reshape(k, b, -1) for s in self.op.axis.slices.values()]
        return np.concatenate(parts, axis=2).astype(self.dtype)

    def runs(self, writer: ResultWriter) -> list[tuple[int, int]]:
        """The pending rows as runs of adjacent whole blocks of at most ``HELD_BYTES`` each."""
        row_bytes = max(1, self.layout.row_bytes)
        out: list[tuple[int, int]] = []
        for b in writer.pending_blocks():
            if out and out[-1][1] == b.row_start and (b.row_stop - out[-1][0]) * row_bytes <= HELD_BYTES:
                out[-1] = (out[-1][0], b.row_stop)
            else:
                out.append((b.row_start, b.row_stop))
        return out

    def writer(self, ctx: RunContext, *, rows: tuple[int, int] | None = None, create: bool = True) -> ResultWriter:
        return ResultWriter(ctx.results_url, ctx.job_id, layout=self.layout, dtype=self.dtype, attrs=self.attrs,
                            rows=rows, create=create)

    def compute(self, ctx: RunContext, writer: ResultWriter) -> dict[str, Any]:
        """Every pending row into ``writer`` (closed on success, aborted on failure); returns the plan."""
        op, started = self.op, time.monotonic()
        meter = ProgressMeter(rows_total=writer.rows_total, rows_done=writer.rows_committed)
        ctx.on_progress(meter.snapshot())
        plan = {"strategy": f"stacked/{self.product}", "mode": self.mode, "sources": len(op.axis.names)}
        ctx.on_plan(plan)
        try:
            for start, stop in self.runs(writer):
                last = [time.monotonic()]

                def keep(offset: int, products: np.ndarray, start: int = start, last: list[float] = last) -> None:
                    rows = self.rows(products)
                    writer.write_rows(start + offset, rows)
                    meter.add(len(products))
                    ctx.units_done(len(products), int(rows.nbytes), time.monotonic() - last[0])
                    last[0] = time.monotonic()
                    ctx.on_progress(meter.snapshot())

                op.apply(self.product, op._seeds(self.product, self.seeds(start, stop)), chunk_rows=ctx.chunk_rows,
                         should_stop=ctx.should_stop, on_chunk=keep, keep=False)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        return {**plan, "labels": dict(op.labels), "oom_retries": op.oom_retries, "products": dict(op.counts),
                "rows_computed": meter.rows_this_run, "run_seconds": round(time.monotonic() - started, 3)}


class StackedExecutor(Executor):
    """A dense kind over a concatenated ``wrt`` axis (see the module docstring); shards by storage blocks."""

    array = "jacobian"

    def run(self, ctx: RunContext) -> dict[str, Any]:
        rows = Stacked(ctx, ctx.block_bytes)
        writer = rows.writer(ctx)
        plan = {**rows.compute(ctx, writer), "shards": 1}
        return self._manifest(ctx, writer, plan)

    def split(self, ctx: RunContext, host: ShardHost) -> ShardPlan | None:
        job = ctx.job
        if (job.shards or 1) <= 1 or job.rows is not None:
            return None
        rows = Stacked(ctx, ctx.block_bytes)
        writer = rows.writer(ctx)
        writer.close()
        shards = choose_shards(job.shards, blocks=len(writer.blocks), live_workers=None, estimated_seconds=0.0,
                               min_shard_seconds=host.min_shard_seconds)
        if shards < 2:
            return None
        return host.store_split(ShardPlan(shards=shards, ranges=[list(r) for r in split_rows(writer.blocks, shards)],
                                          rows_total=writer.rows_total, strategy=f"stacked/{rows.product}",
                                          block_bytes=writer.layout.block_bytes, mode=rows.mode))

    def run_shard(self, ctx: RunContext, split: ShardPlan) -> None:
        rows = Stacked(ctx, split.block_bytes)
        ctx.on_plan(rows.compute(ctx, rows.writer(ctx, rows=ctx.rows, create=False)))

    def finish(self, ctx: RunContext, writer: ResultWriter, plan: dict[str, Any]) -> dict[str, Any]:
        return self._manifest(ctx, writer, plan)

    @staticmethod
    def _manifest(ctx: RunContext, writer: ResultWriter, plan: dict[str, Any]) -> dict[str, Any]:
        fields = manifest_fields_for(writer.attrs, plan=plan, created_at=ctx.created_at, model=ctx.model_ref())
        fields["wrt_slices"] = writer.attrs.get("wrt_slices")
        writer.write_manifest(fields)
        return {**writer.manifest_base(), **fields}
