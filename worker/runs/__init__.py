"""One attempt at one rq job of a Jacobian job: the job itself (``JobRun``), one of its shards
(``ShardRun``) or the finalizer of a sharded job (``Finalizer``), sharing one error classification."""

from worker.runs.attempt import Attempt, JobTimeout, Outcome, classify, is_transient
from worker.runs.finalizer import Finalizer
from worker.runs.job import JobRun
from worker.runs.shard import ShardRun

__all__ = ["Attempt", "Finalizer", "JobRun", "JobTimeout", "Outcome", "ShardRun", "classify", "is_transient"]
