"""The matrix-free families: ``products`` (``jvp``, ``vjp``, ``hvp``, ``ggn_vp``, ``fisher_vp`` of given seeds,
streamed into ``products`` block by block, resumed and sharded by storage blocks of seeds) and ``spectral`` (``svd``,
``hessian_eig``, ``hessian_trace``, ``ggn_eig``, ``ggn_trace``, ``hessian_diag``, ``spectral_density``, ``logdet``,
and the solves of ``ihvp``: computed whole). A
``loss`` gives the operator its curvature products (``worker.engine.curvature``), ``labels`` taken from the inputs.
Both run on one memory-planned ``Operator``, kept per worker for the next job on the same request
(``worker.execution.operators``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from worker.execution.base import Executor, ShardHost
from worker.sharding import ShardPlan, choose_shards, split_rows

if TYPE_CHECKING:
    from worker.execution.context import RunContext
    from worker.storage import ResultWriter


def operator(ctx: RunContext, kind: str | None = None) -> tuple[Any, Any]:
    """The request's ``worker.engine.matfree.Operator`` (memory planned; reused from this worker's cache when the
    same request ran before) and its seeds (None when it takes none)."""
    from worker.execution.operators import cached_operator

    job = ctx.job
    inputs, seeds = ctx.inputs_and_seeds()
    model = ctx.load_model()
    labels = _labels(job, inputs, model)
    op = cached_operator(model, inputs, cache_dir=ctx.cache_dir, of=job.of, wrt=job.wrt,
                         kind=kind or job.kind.value, reduce=job.reduce, output_dtype=job.output_dtype)
    if job.loss is not None:   # the curvature products (ggn_vp, fisher_vp) of the loss, for whichever kind asks
        from worker.engine.curvature import loss_curvature, middles

        op.middles = middles(loss_curvature(op, job.loss, labels))
    op.plan_memory(ctx.probe, ctx.budget_bytes)
    return op, seeds


def _labels(job: Any, inputs: dict[str, Any], model: Any) -> Any:
    """The request's ``labels`` tensor (None without the field), taken out of ``inputs`` unless the signature
    takes it too."""
    if job.labels is None:
        return None
    if job.labels not in inputs:
        from worker.engine.errors import InvalidRequest

        raise InvalidRequest(f"labels: no input {job.labels!r} in this request; add the labels to inputs under "
                             "that name", field="labels")
    return inputs[job.labels] if job.labels in model.input_specs else inputs.pop(job.labels)


def _manifest_fields(ctx: RunContext) -> dict[str, Any]:
    return {"model": ctx.model_ref(), **ctx.manifest_fields}


class ProductsExecutor(Executor):
    """Products of the seeds, one commit marker per storage block of seeds: a retried job computes only the
    blocks not committed; ``shards`` > 1 splits the seeds on block boundaries."""

    array = "products"

    def run(self, ctx: RunContext) -> dict[str, Any]:
        op, seeds = operator(ctx)
        return _run_whole(ctx, op, seeds=seeds)

    def split(self, ctx: RunContext, host: ShardHost) -> ShardPlan | None:
        from worker.matfree_job import products_writer

        job = ctx.job
        if (job.shards or 1) <= 1 or job.rows is not None:
            return None
        op, seeds = operator(ctx)
        k = len(op._seeds(job.kind.value, seeds)) if seeds is not None else 0  # checked: InvalidRequest names seeds
        writer = products_writer(op, job.kind.value, k, job.results_url, job.id, block_bytes=ctx.block_bytes)
        writer.close()
        shards = choose_shards(job.shards, blocks=len(writer.blocks), live_workers=None, estimated_seconds=0.0,
                               min_shard_seconds=host.min_shard_seconds)
        if shards < 2:
            return None
        split = ShardPlan(shards=shards, ranges=[list(r) for r in split_rows(writer.blocks, shards)], rows_total=k,
                          strategy="matrix-free", block_bytes=writer.layout.block_bytes, mode=job.kind.value)
        return host.store_split(split)

    def run_shard(self, ctx: RunContext, split: ShardPlan) -> None:
        from worker.matfree_job import compute_products_shard

        job = ctx.job
        op, seeds = operator(ctx)
        start, stop = job.rows or (0, 0)
        spent = compute_products_shard(op, job.kind.value, seeds, results_url=job.results_url, job_id=job.id,
                                       rows=(start, stop), block_bytes=split.block_bytes, chunk_rows=job.chunk_rows,
                                       on_progress=ctx.counter(), should_stop=ctx.should_stop)
        ctx.on_plan({"strategy": "matrix-free", "labels": dict(op.labels), "products": spent,
                     "oom_retries": op.oom_retries})

    def finish(self, ctx: RunContext, writer: ResultWriter, plan: dict[str, Any]) -> dict[str, Any]:
        from worker.matfree_job import finish_products

        return finish_products(writer, plan=plan, created_at=ctx.created_at, manifest_fields=_manifest_fields(ctx))


class SpectralExecutor(Executor):
    """A few values (and vectors) of J or H, computed whole: a retried job starts over; no shards."""

    array = ""

    def run(self, ctx: RunContext) -> dict[str, Any]:
        op, seeds = operator(ctx)
        fields = {name: getattr(ctx.job, name) for name in ctx.spec.fields}   # rank, tol, samples, damping, ...
        return _run_whole(ctx, op, seeds=seeds, **fields)


def _run_whole(ctx: RunContext, op: Any, **kind_args: Any) -> dict[str, Any]:
    """The whole job of a matrix-free kind in one piece (``worker.matfree_job``): its manifest."""
    from worker.matfree_job import compute_matfree_to_storage

    job = ctx.job
    ctx.on_plan({"kind": job.kind.value, "strategy": "matrix-free", "shards": 1})
    manifest = compute_matfree_to_storage(
        op, job.kind.value, results_url=job.results_url, job_id=job.id, chunk_rows=job.chunk_rows,
        on_progress=ctx.counter(), should_stop=ctx.should_stop, created_at=ctx.created_at,
        block_bytes=ctx.block_bytes, manifest_fields=_manifest_fields(ctx), **kind_args)
    manifest["plan"] = {**manifest["plan"], "strategy": "matrix-free", "shards": 1}
    return manifest


def one_hot_rows(start: int, stop: int, size: int, dtype: Any) -> np.ndarray:
    """Rows ``start:stop`` of the identity of order ``size``: ``(stop - start, size)``."""
    out = np.zeros((stop - start, size), dtype)
    out[np.arange(stop - start), np.arange(start, stop)] = 1
    return out
