"""One execution interface for every kind: ``executor_for(job)`` picks the family's executor (from the registry,
``contracts.kinds``), and a job, a shard, a finalizer and ``jacobian compute`` run it with a ``RunContext``.

| family / route | executor | resume, shards |
| --- | --- | --- |
| dense, one ``wrt`` | ``dense.DenseExecutor`` (chunk planner, strategies) | storage blocks of rows |
| dense, several ``wrt`` or ``variables/*`` | ``stacked.StackedExecutor`` (one-hot products) | storage blocks of rows |
| dense with ``sparsity`` | ``sparse.SparseExecutor`` (colouring; dense fallback) | storage blocks of colours (1) |
| products | ``matrix_free.ProductsExecutor`` | storage blocks of seeds |
| spectral | ``matrix_free.SpectralExecutor`` | starts over; one piece |

(1) of the compressed products (the array ``compressed``); the finalizer verifies and writes the COO entries. A
pattern that does not pay is computed, resumed and sharded as the dense route's rows.
"""

from __future__ import annotations

from typing import Any

from contracts.kinds import Family, kind_spec, several_wrt
from worker.execution.base import Executor, ShardHost
from worker.execution.context import RunContext

__all__ = ["Executor", "RunContext", "ShardHost", "executor_for", "several_wrt"]


def executor_for(job: Any) -> Executor:
    """The executor of ``job`` (a ``QueuedJob`` or anything with ``kind``, ``wrt`` and ``sparsity``)."""
    spec = kind_spec(job.kind)
    if spec.family is Family.dense:
        if getattr(job, "sparsity", None) is not None:
            from worker.execution.sparse import SparseExecutor

            return SparseExecutor()
        if several_wrt(job.wrt):
            from worker.execution.stacked import StackedExecutor

            return StackedExecutor()
        from worker.execution.dense import DenseExecutor

        return DenseExecutor()
    from worker.execution.matrix_free import ProductsExecutor, SpectralExecutor

    return ProductsExecutor() if spec.family is Family.products else SpectralExecutor()
