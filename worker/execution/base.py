"""The execution interface: what every family's executor does, and what a job offers it to split itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from worker.execution.context import RunContext
    from worker.sharding import ShardPlan
    from worker.storage import ResultWriter


class ShardHost(Protocol):
    """What the job offers an executor that splits itself: the live workers, and the one stored split."""

    min_shard_seconds: float

    def live_workers(self) -> int: ...

    def store_split(self, split: ShardPlan) -> ShardPlan:
        """Store ``split`` unless an earlier attempt stored one; returns the stored one (the first wins)."""
        ...


class Executor:
    """How one family runs a kind, the same small set of calls for every family (optax's
    ``GradientTransformation`` is the model): ``run`` a whole job, ``split`` it into shards, ``run_shard`` one
    of them, ``finish`` the sharded result. ``array``: the result array shards write into.

    ``run`` returns the manifest (written last, by the executor); ``split`` returns None when the job runs in one
    piece; ``finish`` gets the job's model and inputs from the finalizer's context, loaded when first asked for.
    Errors are ``EngineError``s (``Stopped`` on cancel) or storage errors, classified by the caller
    (``worker.runs.attempt.classify``).
    """

    array = "jacobian"

    def array_for(self, split: ShardPlan | None) -> str:
        """The array the shards of ``split`` write into (the finalizer checks its commit markers)."""
        return self.array

    def run(self, ctx: RunContext) -> dict[str, Any]:
        raise NotImplementedError

    def split(self, ctx: RunContext, host: ShardHost) -> ShardPlan | None:
        """No shards unless the family has them."""
        return None

    def run_shard(self, ctx: RunContext, split: ShardPlan) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs no shards")

    def finish(self, ctx: RunContext, writer: ResultWriter, plan: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} has no shards to finish")
