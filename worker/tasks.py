"""The rq task ``worker.tasks.run_job``: one queued job from inputs to a committed Zarr result.

A large job may be split into row-range shards, each its own ``run_job`` rq job, finished by
``worker.tasks.finalize_job`` (see ``JobRun``, ``choose_shards`` and README "Scale-out").
Also ``compute_to_storage``, the engine-to-storage pipeline shared with ``jacobian compute``.
TensorFlow and the engine are imported lazily, inside the functions that need them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import redis

from contracts import npz, storage
from contracts.jobspec import JobStatus, QueuedJob, finalizer_job_id, shard_job_id
from contracts.jobstore import JobNotFound, JobRecord, JobStore, merge_shard_progress
from contracts.layout import job_url
from contracts.logs import job_context
from contracts.settings import Settings, get_settings
from worker import metrics
from worker.storage import ResultWriteError, ResultWriter

log = logging.getLogger(__name__)


class InvalidInputs(ValueError):
    """``inputs_uri`` is missing or is not a readable ``.npz``."""


class ModelPathNotAllowed(PermissionError):
    """The model path resolves outside every configured model root."""


class JobTimeout(TimeoutError):
    """The job ran longer than its timeout (``JACOBIAN_JOB_TIMEOUT_S``); more time is not a retry."""


# -- helpers shared with the CLI --------------------------------------------------------------------


def effective_budget(job_bytes: int | None, operator_bytes: int | None) -> int | None:
    """The tighter of the job's ``memory_budget_bytes`` and the operator's cap (None: no cap)."""
    given = [b for b in (job_bytes, operator_bytes) if b]
    return min(given) if given else None


def load_inputs(uri: str, *, field: str = "inputs_uri") -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` at ``uri`` (local path, ``file://`` or ``s3://``), read by
    ``contracts.npz``: headers checked against ``JACOBIAN_MAX_INPUT_BYTES`` and ``_ELEMENTS`` first.

    Raises ``InvalidInputs`` (naming ``field``) when absent, unreadable or over a limit; other
    ``OSError`` when storage fails.
    """
    settings = get_settings()
    try:
        with storage.open_file(uri) as f:
            return npz.load(f, max_bytes=settings.max_input_bytes, max_elements=settings.max_input_elements)
    except (FileNotFoundError, IsADirectoryError) as err:
        raise InvalidInputs(f"{field}: {uri!r} does not exist; give the path or URL of an .npz file") from err
    except npz.NpzDtypeRefused as err:
        raise InvalidInputs(f"{field}: {uri!r}: input {err.name!r}: {err}") from err
    except npz.NpzTooLarge as err:
        raise InvalidInputs(f"{field}: {uri!r}: {err}; send smaller inputs or split the job") from err
    except npz.NpzError as err:
        raise InvalidInputs(f"{field}: {uri!r} is not a readable .npz ({err}); write it with numpy.savez") from err


def check_model_path(path: str, roots: list[str]) -> str:
    """``path`` resolved; raises ``ModelPathNotAllowed`` unless it lies under one of ``roots``."""
    resolved = Path(path).expanduser().resolve()
    for root in roots:
        if resolved.is_relative_to(Path(root).expanduser().resolve()):
            return str(resolved)
    raise ModelPathNotAllowed(f"model.path: {path!r} is outside the allowed model roots; "
                              f"put the model under one of: {', '.join(roots) or '(none configured)'}")


def block_bytes_from_env() -> int | None:
    """Storage block size override (bytes) from ``JACOBIAN_BLOCK_BYTES``; None keeps the layout's."""
    value = os.environ.get("JACOBIAN_BLOCK_BYTES")
    return int(value) if value else None


def progress_dict(rows_done: int, rows_total: int, rows_per_second: float) -> dict[str, Any]:
    """A job's ``progress``: rows done of ``rows_total``, fraction, rate (rows/s) and ETA (s, None: unknown)."""
    left = rows_total - rows_done
    return {"rows_done": rows_done, "rows_total": rows_total,
            "fraction": 1.0 if rows_total == 0 else round(rows_done / rows_total, 6),
            "rows_per_second": round(rows_per_second, 3),
            "eta_seconds": 0.0 if left <= 0 else (round(left / rows_per_second, 3) if rows_per_second > 0 else None)}


def at_least(progress: dict[str, Any], rows_done: int) -> dict[str, Any]:
    """``progress`` with ``rows_done`` raised to ``rows_done`` (what an earlier attempt reported).

    A resumed attempt restarts from the committed blocks, behind the rows the last one reported (handed
    to the writer, not yet committed); progress keeps the larger count until the new attempt passes it.
    """
    if progress["rows_done"] >= rows_done:
        return progress
    return progress_dict(min(rows_done, progress["rows_total"]), progress["rows_total"], progress["rows_per_second"])


@dataclass
class Progress:
    """Rows done out of ``rows_total``; the rate counts only rows computed in this run (rows/s)."""

    rows_total: int
    rows_done: int
    started_s: float = field(default_factory=time.monotonic)
    rows_this_run: int = 0

    def add(self, n: int) -> None:
        self.rows_done += n
        self.rows_this_run += n

    def snapshot(self) -> dict[str, Any]:
        elapsed_s = max(time.monotonic() - self.started_s, 1e-9)
        rate = self.rows_this_run / elapsed_s if self.rows_this_run else 0.0
        return progress_dict(self.rows_done, self.rows_total, rate)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1000):03d}Z"


def compute_to_storage(problem: Any, *, results_url: str, job_id: str, rows: tuple[int, int] | None = None,
                       memory_budget_bytes: int | None = None, chunk_rows: int | None = None,
                       on_plan: Callable[[dict[str, Any]], None] | None = None,
                       on_progress: Callable[[dict[str, Any]], None] | None = None,
                       should_stop: Callable[[], bool] | None = None,
                       manifest_fields: dict[str, Any] | None = None,
                       created_at: float | None = None, strategy: str | None = None,
                       block_bytes: int | None = None, create: bool = True, plan: Any = None,
                       refine: str = "auto", on_learned: Callable[[Any], None] | None = None,
                       probe: Any = None, try_xla: bool = True) -> dict[str, Any]:
    """Compute the pending rows of ``problem`` and stream them to ``{results_url}/{job_id}/``.

    Resumes from committed blocks; writes ``manifest.json`` last (not for a shard, ``rows`` given).
    ``plan`` (``worker.engine.Plan``) is the strategy and what is known of it; ``on_learned`` receives
    it updated by this run, to store. ``strategy`` pins the chunk strategy; ``refine`` is passed to
    ``run_problem``; ``block_bytes`` overrides ``JACOBIAN_BLOCK_BYTES``; ``create=False`` (a shard)
    writes into the existing array and never recreates it. Returns the manifest. Raises
    ``EngineError`` (``Stopped`` on cancel), ``ResultWriteError``.
    """
    from worker.engine import run_problem

    try:
        writer = ResultWriter.for_problem(results_url, job_id, problem, rows=rows, create=create,
                                          block_bytes=block_bytes or block_bytes_from_env())
    except (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError):
        raise
    except OSError as err:
        raise ResultWriteError(f"storage: cannot open the result at {job_url(results_url, job_id)}: {err}") from err
    progress = Progress(rows_total=writer.rows_total, rows_done=writer.rows_committed)
    if on_progress:
        on_progress(progress.snapshot())
    engine_plan = plan
    plan: dict[str, Any] = {}
    kind = str((getattr(problem, "attrs", None) or {}).get("kind") or getattr(problem, "kind", ""))
    chunk_clock = {"t": time.monotonic()}

    def take_plan(new_plan: dict[str, Any]) -> None:
        if progress.rows_this_run == 0:  # the rate counts compute, not loading and calibration
            progress.started_s = time.monotonic()
            chunk_clock["t"] = time.monotonic()
        metrics.observe_plan(new_plan, dict(plan) if plan else None)
        _log_plan(new_plan, changed=bool(plan))
        plan.clear()
        plan.update(new_plan)
        if on_plan:
            on_plan(dict(new_plan))

    def take_chunk(row_start: int, chunk: np.ndarray) -> None:
        seconds = time.monotonic() - chunk_clock["t"]
        writer.write_rows(row_start, chunk)
        progress.add(int(chunk.shape[0]))
        metrics.observe_chunk(kind, int(chunk.shape[0]), int(chunk.size) * writer.dtype.itemsize, seconds)
        if on_progress:
            on_progress(progress.snapshot())
        chunk_clock["t"] = time.monotonic()

    ranges = writer.pending_ranges()
    if chunk_rows is not None:  # a forced chunk larger than the job would compute padding rows
        chunk_rows = max(1, min(int(chunk_rows), writer.layout.rows_total))
    if not ranges and rows is None and storage.exists(writer.manifest_url):
        writer.close()  # finished before (e.g. a crash before the status update): keep that manifest
        return dict(json.loads(storage.read_bytes(writer.manifest_url)))
    try:
        if ranges:
            report = run_problem(problem, ranges=ranges, memory_budget_bytes=memory_budget_bytes,
                                 chunk_rows=chunk_rows, on_plan=take_plan, on_chunk=take_chunk,
                                 should_stop=should_stop, strategy=strategy, plan=engine_plan, refine=refine,
                                 probe=probe, try_xla=try_xla)
            plan.update(getattr(report, "plan", None) or {})
            plan.update({"rows_computed": report.rows_computed, "run_seconds": round(report.seconds, 3)})
            if on_learned is not None:
                on_learned(report.learned)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    attrs = getattr(problem, "attrs", {}) or {}
    fields = {"kind": attrs.get("kind"), "mode": getattr(problem, "mode", attrs.get("mode")),
              "of": attrs.get("of"), "wrt": attrs.get("wrt"),
              "model": {"path": attrs.get("model"), "signature": attrs.get("signature")},
              "plan": plan, "created_at": _iso(created_at or time.time()), "finished_at": _iso(time.time())}
    fields.update({k: v for k, v in (manifest_fields or {}).items() if v is not None})
    manifest = {**writer.manifest_base(), **fields}
    if rows is None:
        writer.write_manifest(fields)
    return manifest


def _log_plan(plan: dict[str, Any], *, changed: bool) -> None:
    """One line per plan: strategy, chunk rows, free bytes and bytes per row, as JSON fields too."""
    fields = {"event": "plan_changed" if changed else "plan_chosen", "strategy": plan.get("strategy"),
              "chunk_rows": plan.get("chunk_rows"), "free_bytes": plan.get("free_bytes_at_start"),
              "bytes_per_row": plan.get("bytes_per_row"), "fixed_bytes": plan.get("fixed_bytes"),
              "mode": plan.get("mode"), "oom_retries": plan.get("oom_retries")}
    log.info("plan %s: strategy %s, %s rows per chunk, %s bytes free, %s bytes per row",
             "changed" if changed else "chosen", fields["strategy"], fields["chunk_rows"], fields["free_bytes"],
             fields["bytes_per_row"], extra=fields)


# -- the rq task ------------------------------------------------------------------------------------


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ResultWriteError, redis.exceptions.ConnectionError,
                                        redis.exceptions.TimeoutError, ConnectionError, TimeoutError]
    try:
        import botocore.exceptions as bx

        types += [bx.ConnectionError, bx.HTTPClientError]
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    return tuple(types)


def _is_rq_timeout(err: BaseException) -> bool:
    from rq.timeouts import JobTimeoutException

    return isinstance(err, JobTimeoutException)


def is_transient(err: BaseException) -> bool:
    """Storage or connection trouble that a later attempt may not meet (or an error marked ``transient``)."""
    return isinstance(err, _transient_types()) or getattr(err, "transient", False) is True


def _error(err: BaseException) -> dict[str, str]:
    return {"type": type(err).__name__, "message": str(err)}


class JobRun:
    """One attempt at one queued job; status, plan and progress go to the ``JobStore``.

    The job itself (``job.shard is None``) validates the request and either computes every row or,
    when it is split (see ``choose_shards``), creates the result array, enqueues one rq job per
    row-range shard and a finalizer that depends on them, and returns with the job ``running``.
    A shard (``job.shard`` set) computes its range into the shared array and never writes the
    manifest or a terminal status, except ``failed`` when it fails for good.
    """

    def __init__(self, job: QueuedJob, store: JobStore, settings: Settings, rq_job: Any = None) -> None:
        self.job, self.store, self.settings, self.rq_job = job, store, settings, rq_job
        self.skipped = False  # True when the job was already terminal: nothing ran, nothing to count
        self.metric_status: str | None = None  # overrides the status counted in metrics (shards)

    @property
    def retries_left(self) -> bool:
        return bool(self.rq_job is not None and getattr(self.rq_job, "retries_left", None))

    def run(self) -> dict[str, Any]:
        """Run the attempt; returns ``{"id", "status", "result" | "error"}``; raises transient errors."""
        from worker.engine import EngineError
        from worker.engine.errors import Stopped

        job, store = self.job, self.store
        if job.shard is not None:
            return self._run_shard()
        record = self._record()
        if record.status.is_terminal:
            log.info("job %s is already %s; nothing to do", job.id, record.status.value)
            self.skipped = True
            return {"id": job.id, "status": record.status.value}
        if record.cancel_requested:
            return self._cancel()
        store.update(job.id, status=JobStatus.running, started_at=time.time(), error=None)
        try:
            return self._compute(record)
        except Stopped:
            return self._cancel()
        except Exception as err:
            if _is_rq_timeout(err):  # rq's death penalty: fail for good, partial result removed, no retry
                timeout = getattr(self.rq_job, "timeout", None) or self.settings.job_timeout_s
                self._fail(JobTimeout(f"the job ran longer than its timeout of {timeout} s "
                                      f"(JACOBIAN_JOB_TIMEOUT_S); raise the timeout or split the job "
                                      f"(\"shards\", fewer inputs)"), delete=True)
                if self.rq_job is not None:
                    self.rq_job.retries_left = None
                raise
            if isinstance(err, (EngineError, InvalidInputs, ModelPathNotAllowed)) and not is_transient(err):
                return self._fail(err, delete=True)
            if is_transient(err):
                if self.retries_left:
                    log.warning("job %s: transient error, rq will retry: %s", job.id, err)
                    store.update(job.id, status=JobStatus.queued, error={**_error(err), "transient": True})
                else:
                    self._fail(err, delete=False)
                raise
            log.exception("job %s: unexpected error", job.id)
            self._fail(err, delete=False)
            if self.rq_job is not None:
                self.rq_job.retries_left = None  # a bug does not heal on retry
            raise

    def _record(self) -> JobRecord:
        try:
            return self.store.get(self.job.id)
        except JobNotFound:
            record = JobRecord(id=self.job.id, status=JobStatus.queued, spec=self.job.model_dump(mode="json"),
                               created_at=time.time())
            self.store.create(record)
            return record

    def _problem(self, plan: Any = None) -> tuple[Any, Any]:
        """The job's problem and plan: ``plan`` given (a shard's, made by its planner) is used as it
        is; otherwise the plan cache's (Redis, then this worker's folder) or a default."""
        from worker.engine.planning import prepare
        from worker.model_cache import get_model

        job = self.job
        model_path = check_model_path(job.model.path, self.settings.model_roots)
        inputs = load_inputs(job.inputs_uri)
        model = get_model(model_path, job.model.signature)
        return prepare(model, inputs, cache=self.plans, device=self.probe.device, of=job.of, wrt=job.wrt,
                       kind=job.kind.value, mode=job.mode.value, reduce=job.reduce,
                       check_independence=job.check_independence, output_dtype=job.output_dtype, plan=plan)

    @property
    def plans(self) -> Any:
        from worker.plan_store import worker_plan_cache

        return worker_plan_cache(self.store.connection, self.settings.cache_dir)

    @property
    def probe(self) -> Any:
        from worker.engine import TFMemoryProbe

        if getattr(self, "_probe", None) is None:
            self._probe = TFMemoryProbe()
        return self._probe

    @property
    def budget(self) -> int | None:
        return effective_budget(self.job.memory_budget_bytes, self.settings.memory_budget_bytes)

    def _compute(self, record: JobRecord) -> dict[str, Any]:
        job, store = self.job, self.store
        stored = store.shard_plan(job.id)
        if stored is not None and int(stored.get("shards") or 1) > 1:  # an earlier attempt split the job
            return self._fan_out(stored)
        problem, plan = self._problem()

        def on_plan(plan: dict[str, Any]) -> None:
            store.update(job.id, plan={**plan, "shards": 1})

        reported = int((record.progress or {}).get("rows_done") or 0)  # by an earlier attempt

        def on_progress(progress: dict[str, Any]) -> None:
            store.update(job.id, progress=at_least(progress, reported))

        def compute(rows: tuple[int, int] | None, refine: str = "auto") -> dict[str, Any]:
            return compute_to_storage(
                problem, results_url=job.results_url, job_id=job.id, rows=rows,
                memory_budget_bytes=self.budget, chunk_rows=job.chunk_rows, strategy=job.strategy,
                on_plan=on_plan, on_progress=on_progress,
                should_stop=lambda: store.is_cancel_requested(job.id),
                manifest_fields={"model": {"path": job.model.path, "signature": job.model.signature}},
                created_at=record.created_at, plan=plan, refine=refine, on_learned=self.plans.put, probe=self.probe,
                try_xla=self.settings.try_xla)

        shards = self._choose_shards(problem, plan)
        blocks = iter(_layout(problem).blocks())
        while shards is None:  # automatic, and no rows/s measured for this request yet: measure on its blocks
            block = next(blocks, None)
            if block is None:
                shards = 1
                break
            compute((block.row_start, block.row_stop), refine="never")
            shards = self._choose_shards(problem, plan)
        if shards > 1:
            return self._split(problem, shards, plan)
        manifest = compute(job.rows)
        result = {"uri": manifest["uri"], "shape": manifest["shape"], "dtype": manifest["dtype"]}
        final_plan = {**(manifest.get("plan") or {}), "shards": 1}
        store.update(job.id, status=JobStatus.succeeded, result=result, error=None, finished_at=time.time(),
                     plan=final_plan)
        log.info("job %s succeeded: %s", job.id, result["uri"])
        return {"id": job.id, "status": JobStatus.succeeded.value, "result": result}

    # -- splitting a job into shards ------------------------------------------------------------

    def _choose_shards(self, problem: Any, plan: Any) -> int | None:
        """How many shards (``choose_shards``); all shards then run ``plan``'s strategy.

        Automatic sharding sizes the job by the plan's measured rows/s: None when there is none yet
        (the caller then computes the first storage block and asks again).
        """
        job = self.job
        blocks = len(_layout(problem).blocks())
        if job.shards == 1 or blocks < 2 or job.rows is not None:
            return 1
        live = None
        if job.shards is None:
            live = live_workers(self.store.connection, self._queue())
            if live < 2:
                return 1
        estimate_s = estimated_seconds(plan, problem.rows_total)
        if job.shards is None and estimate_s is None:
            log.info("job %s: no measured rows/s for this request yet; measuring on the first block", job.id)
            return None
        n = choose_shards(job.shards, blocks=blocks, live_workers=live, estimated_seconds=estimate_s or 0.0,
                          min_shard_seconds=shard_min_seconds())
        log.info("job %s: %d shard(s): %d storage blocks, %s live workers, about %s s of compute",
                 job.id, n, blocks, "-" if live is None else live,
                 "?" if estimate_s is None else f"{estimate_s:.1f}",
                 extra={"event": "shards_chosen", "shards": n, "blocks": blocks, "live_workers": live,
                        "estimated_seconds": None if estimate_s is None else round(estimate_s, 3),
                        "strategy": job.strategy or plan.strategy})
        return n

    def _split(self, problem: Any, shards: int, plan: Any) -> dict[str, Any]:
        """Create the result array once, store the shard plan, enqueue the shards and the finalizer.

        Every shard runs the planner's plan with its strategy pinned, so all rows are computed alike."""
        job = self.job
        layout = _layout(problem)
        strategy = job.strategy or plan.strategy
        split = {"shards": shards, "ranges": [list(r) for r in split_rows(layout.blocks(), shards)],
                 "rows_total": layout.rows_total, "strategy": strategy, "block_bytes": layout.block_bytes,
                 "mode": problem.mode, "engine_plan": plan.to_json()}
        # Before any shard may write: the array (resuming the blocks an earlier attempt committed).
        writer = ResultWriter.for_problem(job.results_url, job.id, problem, block_bytes=layout.block_bytes)
        committed = {b.index for b in writer.blocks} - {b.index for b in writer.pending_blocks()}
        writer.close()
        stored = self.store.set_shard_plan(job.id, split)
        if stored is not None and stored.get("ranges") == split["ranges"]:
            # Rows this planner computed before splitting (measuring the job's rows/s) count for their shard.
            for i, (lo, hi) in enumerate(split["ranges"]):
                rows = sum(b.row_stop - b.row_start for b in writer.blocks
                           if b.index in committed and lo <= b.row_start < hi)
                if rows:
                    self.store.update_shard_progress(job.id, i, {"rows_done": rows, "rows_total": hi - lo},
                                                     computed_rows=rows)
        return self._fan_out(stored)

    def _queue(self) -> Any:
        from rq import Queue
        from rq.serializers import JSONSerializer

        name = getattr(self.rq_job, "origin", None) or self.settings.queue_name
        return Queue(name, connection=self.store.connection, serializer=JSONSerializer)

    def _fan_out(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Enqueue the shards and the finalizer that are not in rq yet (idempotent across attempts)."""
        from rq import Retry
        from rq.job import Dependency, Job

        job, store, settings = self.job, self.store, self.settings
        queue, connection = self._queue(), self.store.connection
        n = int(plan["shards"])
        base = job.model_dump(mode="json")
        timeout = getattr(self.rq_job, "timeout", None) or settings.job_timeout_s
        # Immediate retries: a shard resumes from its committed blocks, and the writer already backs
        # off on storage errors (rq's retry intervals would need a worker started with a scheduler).
        retry = Retry(max=settings.job_retries) if settings.job_retries > 0 else None
        ids = []
        for i, (start, stop) in enumerate(plan["ranges"]):
            rq_id = shard_job_id(job.id, i)
            ids.append(rq_id)
            if Job.exists(rq_id, connection=connection):
                continue
            spec = {**base, "shards": n, "shard": i, "rows": [start, stop], "strategy": plan.get("strategy")}
            queue.enqueue_call(TASK, args=(spec,), job_id=rq_id, timeout=timeout, result_ttl=settings.result_ttl_s,
                               failure_ttl=settings.result_ttl_s, retry=retry,
                               description=f"shard {i + 1}/{n} (rows {start}:{stop}) of {job.kind.value} job {job.id}")
        final_id = finalizer_job_id(job.id)
        if not Job.exists(final_id, connection=connection):
            # allow_failure: the finalizer runs once every shard has finished *or failed for good*, and
            # checks the commit markers itself (a failed dependency would otherwise defer it forever).
            queue.enqueue_call(FINALIZE_TASK, args=({**base, "shards": n},), job_id=final_id,
                               depends_on=Dependency(jobs=ids, allow_failure=True), timeout=timeout,
                               result_ttl=settings.result_ttl_s, failure_ttl=settings.result_ttl_s, retry=retry,
                               description=f"finalizer of {job.kind.value} job {job.id} ({n} shards)")
        store.update(job.id, plan={"shards": n, "strategy": plan.get("strategy"), "mode": plan.get("mode")},
                     progress=merge_shard_progress(plan, {}))
        log.info("job %s split into %d shards: rows %s", job.id, n,
                 ", ".join(f"{a}:{b}" for a, b in plan["ranges"]),
                 extra={"event": "job_split", "shards": n, "ranges": plan["ranges"]})
        return {"id": job.id, "status": JobStatus.running.value, "shards": n}

    # -- one shard ------------------------------------------------------------------------------

    @property
    def shard_label(self) -> str:
        job = self.job
        start, stop = job.rows or (0, 0)
        return f"shard {(job.shard or 0) + 1} of {job.shards} (rows {start}:{stop})"

    def _run_shard(self) -> dict[str, Any]:
        from worker.engine import EngineError
        from worker.engine.errors import Stopped

        job, store = self.job, self.store
        out = {"id": job.id, "shard": job.shard}
        try:
            record = store.get(job.id)
        except JobNotFound:
            log.warning("job %s: %s has no job record (expired?); nothing to do", job.id, self.shard_label)
            self.skipped = True
            return {**out, "status": "skipped"}
        if record.status.is_terminal or record.cancel_requested:
            log.info("job %s is %s; %s stops before computing", job.id,
                     "canceled" if record.cancel_requested else record.status.value, self.shard_label)
            self.metric_status = "stopped"
            return {**out, "status": "stopped"}
        try:
            return self._compute_shard(out)
        except Stopped:
            log.info("job %s: %s stopped (cancel, or the job ended)", job.id, self.shard_label)
            self.metric_status = "stopped"
            return {**out, "status": "stopped"}
        except Exception as err:
            if isinstance(err, (EngineError, InvalidInputs, ModelPathNotAllowed)) and not is_transient(err):
                return {**out, **self._fail_from_shard(err)}
            if is_transient(err):
                if self.retries_left:
                    log.warning("job %s: %s: transient error, rq will retry this shard alone: %s", job.id,
                                self.shard_label, err)
                else:
                    self._fail_from_shard(err)
                raise
            log.exception("job %s: %s: unexpected error", job.id, self.shard_label)
            self._fail_from_shard(err)
            if self.rq_job is not None:
                self.rq_job.retries_left = None  # a bug does not heal on retry
            raise

    def _compute_shard(self, out: dict[str, Any]) -> dict[str, Any]:
        job, store = self.job, self.store
        index = int(job.shard or 0)
        plan = store.shard_plan(job.id) or {}
        from worker.engine import Plan

        engine_plan = Plan.from_json(plan["engine_plan"]) if plan.get("engine_plan") else None
        problem, engine_plan = self._problem(plan=engine_plan)
        last = {"rows_done": None}
        reported = int(store.shard_progress(job.id).get(index, {}).get("rows_done") or 0)  # by an earlier attempt

        def on_plan(plan_now: dict[str, Any]) -> None:
            store.update(job.id, plan={**plan_now, "shards": job.shards})

        def on_progress(progress: dict[str, Any]) -> None:
            # rows computed by this attempt since the last report (the first report is the resume point)
            computed = 0 if last["rows_done"] is None else progress["rows_done"] - last["rows_done"]
            last["rows_done"] = progress["rows_done"]
            store.update_shard_progress(job.id, index, at_least(progress, reported), computed_rows=computed)

        compute_to_storage(
            problem, results_url=job.results_url, job_id=job.id, rows=job.rows, create=False,
            block_bytes=plan.get("block_bytes"), memory_budget_bytes=self.budget, chunk_rows=job.chunk_rows,
            strategy=job.strategy, on_plan=on_plan, on_progress=on_progress,
            should_stop=lambda: store.should_stop(job.id), plan=engine_plan, refine="never", probe=self.probe,
            try_xla=self.settings.try_xla)
        log.info("job %s: %s done", job.id, self.shard_label)
        self.metric_status = "shard_done"
        return {**out, "status": "shard_done"}

    def _fail_from_shard(self, err: BaseException) -> dict[str, Any]:
        """Fail the whole job (unless it already ended); the finalizer removes the partial result."""
        job = self.job
        error = {"type": type(err).__name__, "message": f"{self.shard_label}: {err}"}
        if self.store.should_stop(job.id):
            self.metric_status = "stopped"
            log.info("job %s: %s failed after the job ended: %s", job.id, self.shard_label, err)
        else:
            self.store.update(job.id, status=JobStatus.failed, error=error, finished_at=time.time())
            self.metric_status = JobStatus.failed.value
            log.info("job %s failed: %s: %s", job.id, type(err).__name__, error["message"])
        return {"status": JobStatus.failed.value, "error": error}

    def _cancel(self) -> dict[str, Any]:
        job = self.job
        try:
            storage.delete_prefix(job_url(job.results_url, job.id))
        except OSError as err:
            log.warning("job %s: canceled, but partial data could not be removed: %s", job.id, err)
        self.store.update(job.id, status=JobStatus.canceled, finished_at=time.time())
        log.info("job %s canceled", job.id)
        return {"id": job.id, "status": JobStatus.canceled.value}

    def _fail(self, err: BaseException, *, delete: bool) -> dict[str, Any]:
        job = self.job
        if delete:
            _remove_partial(job)
        self.store.update(job.id, status=JobStatus.failed, error=_error(err), finished_at=time.time())
        log.info("job %s failed: %s: %s", job.id, type(err).__name__, err)
        return {"id": job.id, "status": JobStatus.failed.value, "error": _error(err)}


def _remove_partial(job: QueuedJob) -> None:
    """Remove the array and the commit markers of a failed job (its inputs stay)."""
    base = job_url(job.results_url, job.id)
    try:
        storage.delete_prefix(storage.join(base, "jacobian.zarr"))
        storage.delete_prefix(storage.join(base, "committed"))
    except OSError as cleanup_err:
        log.warning("job %s: partial data could not be removed: %s", job.id, cleanup_err)


# -- shards: the rule, the split, the finalizer ------------------------------------------------------

TASK = "worker.tasks.run_job"
FINALIZE_TASK = "worker.tasks.finalize_job"
DEFAULT_SHARD_MIN_SECONDS = 10.0


def shard_min_seconds() -> float:
    """Least estimated compute per shard for automatic sharding (``JACOBIAN_SHARD_MIN_SECONDS``, default 10)."""
    value = os.environ.get("JACOBIAN_SHARD_MIN_SECONDS")
    return float(value) if value else DEFAULT_SHARD_MIN_SECONDS


def choose_shards(requested: int | None, *, blocks: int, live_workers: int | None, estimated_seconds: float,
                  min_shard_seconds: float) -> int:
    """The number of shards of a job of ``blocks`` storage blocks.

    - never more shards than storage blocks (a shard is a run of whole blocks), never fewer than 1;
    - ``requested`` (the job's ``shards``) is taken as given, capped by the blocks;
    - ``requested`` null (automatic): ``min(live workers on the queue, blocks,
      floor(estimated single-worker compute seconds / min_shard_seconds))``, so a job that one worker
      finishes in less than ``2 * min_shard_seconds`` (10 s by default) or a queue with one worker
      stays in one piece.
    """
    if blocks < 2:
        return 1
    if requested is not None:
        return max(1, min(int(requested), blocks))
    if not live_workers or live_workers < 2:
        return 1
    by_time = blocks if min_shard_seconds <= 0 else int(estimated_seconds // min_shard_seconds)
    return max(1, min(live_workers, blocks, by_time))


def estimated_seconds(plan: Any, rows_total: int) -> float | None:
    """Compute seconds of ``rows_total`` rows at the best rows/s the plan's strategy has measured
    (None when it has measured none)."""
    rate = plan.current.best_rate() if plan is not None else None
    return rows_total / rate if rate else None


def split_rows(blocks: list[Any], shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous row ranges on block boundaries, as equal in rows as the blocks allow."""
    n = max(1, min(shards, len(blocks)))
    total = blocks[-1].row_stop if blocks else 0
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(n):
        if i == n - 1:
            last = len(blocks)
        else:
            target = total * (i + 1) / n
            lo, hi = first + 1, len(blocks) - (n - i - 1)  # each shard >= 1 block, leave 1 per later shard
            last = min(range(lo, hi + 1), key=lambda e: (abs(blocks[e - 1].row_stop - target), e))
        out.append((blocks[first].row_start, blocks[last - 1].row_stop))
        first = last
    return out


def live_workers(connection: Any, queue: Any, *, recent_s: float | None = None) -> int:
    """rq workers of ``queue`` whose last heartbeat is at most ``recent_s`` old (default: twice the longest
    gap between a live worker's heartbeats, ``JACOBIAN_WORKER_HEARTBEAT_S`` while busy and
    ``JACOBIAN_WORKER_MAINTENANCE_S`` while idle). A killed worker's key outlives it by a minute or more;
    its ``last_heartbeat`` stops. Heartbeats carry the worker's clock: keep the machines' clocks in sync."""
    from datetime import datetime, timezone

    from rq import worker_registration
    from rq.utils import utcparse

    if recent_s is None:
        settings = get_settings()
        recent_s = 2.0 * max(settings.worker_heartbeat_s, settings.worker_maintenance_s)
    keys = worker_registration.get_keys(queue=queue, connection=connection)
    if not keys:
        return 0
    with connection.pipeline() as pipe:
        for key in keys:
            pipe.hget(key, "last_heartbeat")
        beats = pipe.execute()
    now = datetime.now(timezone.utc)
    alive = 0
    for beat in beats:
        try:
            alive += bool(beat) and (now - utcparse(beat.decode())).total_seconds() <= recent_s
        except ValueError:  # not rq's timestamp format: not a worker we can judge
            continue
    return alive


def _layout(problem: Any) -> Any:
    """The problem's layout with this worker's storage block size."""
    from dataclasses import replace

    block_bytes = block_bytes_from_env()
    return replace(problem.layout, block_bytes=block_bytes) if block_bytes else problem.layout


class Finalizer:
    """The last rq job of a sharded job: once every shard has finished or failed, it writes the
    manifest and marks the job succeeded if every storage block is committed; otherwise it marks the
    job failed (naming the shard) and removes the partial result. It needs no model or TensorFlow."""

    def __init__(self, job: QueuedJob, store: JobStore, settings: Settings, rq_job: Any = None) -> None:
        self.job, self.store, self.settings, self.rq_job = job, store, settings, rq_job
        self.metric_status: str | None = None
        self.skipped = False

    @property
    def retries_left(self) -> bool:
        return bool(self.rq_job is not None and getattr(self.rq_job, "retries_left", None))

    def run(self) -> dict[str, Any]:
        job, store = self.job, self.store
        try:
            record = store.get(job.id)
        except JobNotFound:
            self.skipped = True
            return {"id": job.id, "status": "skipped"}
        plan = store.shard_plan(job.id) or {}
        if record.status == JobStatus.failed:
            _remove_partial(job)  # a shard failed the job (and counted it)
            self.metric_status = "cleanup"
            return {"id": job.id, "status": JobStatus.failed.value, "error": record.error}
        if record.status.is_terminal:
            self.skipped = True
            return {"id": job.id, "status": record.status.value}
        if record.cancel_requested:
            try:
                storage.delete_prefix(job_url(job.results_url, job.id))
            except OSError as err:
                log.warning("job %s: canceled, but partial data could not be removed: %s", job.id, err)
            store.update(job.id, status=JobStatus.canceled, finished_at=time.time())
            log.info("job %s canceled (all %s shards stopped)", job.id, plan.get("shards"))
            return {"id": job.id, "status": JobStatus.canceled.value}
        try:
            writer = ResultWriter.open_existing(job.results_url, job.id)
            missing = writer.missing_blocks()
            if missing:
                writer.abort()
                return self._fail(self._incomplete(plan, missing, len(writer.blocks)))
            fields = self._manifest_fields(record, writer)
            writer.write_manifest(fields)
        except FileNotFoundError as err:
            return self._fail({"type": "ResultMissing", "message": f"result: {err}; resubmit the job"})
        except Exception as err:
            if is_transient(err) and self.retries_left:
                log.warning("job %s: finalizer: transient error, rq will retry: %s", job.id, err)
                raise
            self._fail(_error(err))
            raise
        manifest = {**writer.manifest_base(), **fields}
        result = {"uri": manifest["uri"], "shape": manifest["shape"], "dtype": manifest["dtype"]}
        now = time.time()
        rows_total = int(plan.get("rows_total") or writer.layout.rows_total)
        computed = sum(p.get("rows_computed", 0) for p in store.shard_progress(job.id).values())
        wall_s = max(now - (record.started_at or now), 1e-9)
        progress = {"rows_done": rows_total, "rows_total": rows_total, "fraction": 1.0,
                    "rows_per_second": round(computed / wall_s, 3), "eta_seconds": 0.0}
        store.update(job.id, status=JobStatus.succeeded, result=result, error=None, finished_at=now,
                     progress=progress)
        log.info("job %s succeeded (%s shards): %s", job.id, plan.get("shards"), result["uri"])
        return {"id": job.id, "status": JobStatus.succeeded.value, "result": result}

    def _manifest_fields(self, record: JobRecord, writer: ResultWriter) -> dict[str, Any]:
        job, attrs = self.job, writer.attrs
        return {"kind": attrs.get("kind"), "mode": attrs.get("mode"), "of": attrs.get("of"), "wrt": attrs.get("wrt"),
                "model": {"path": job.model.path, "signature": job.model.signature},
                "plan": record.plan, "created_at": _iso(record.created_at or time.time()),
                "finished_at": _iso(time.time())}

    def _incomplete(self, plan: dict[str, Any], missing: list[Any], blocks: int) -> dict[str, str]:
        """The error of a job whose shards left blocks uncommitted, naming those shards and why."""
        from rq.job import Job

        parts = []
        for i, (start, stop) in enumerate(plan.get("ranges") or []):
            lost = [b for b in missing if start <= b.row_start < stop]
            if not lost:
                continue
            why = "unknown"
            try:
                rq_job = Job.fetch(shard_job_id(self.job.id, i), connection=self.store.connection,
                                   serializer=getattr(self.rq_job, "serializer", None) or _json_serializer())
                status = rq_job.get_status(refresh=True)
                why = getattr(status, "value", None) or str(status or "unknown")
                result = rq_job.latest_result()
                if result is not None and result.exc_string:
                    why = f"{why}: {result.exc_string.strip().splitlines()[-1]}"
            except Exception as err:  # noqa: BLE001 - the shard's rq job may have expired
                why = f"its rq job is gone ({type(err).__name__})"
            parts.append(f"shard {i + 1} of {plan.get('shards')} (rows {start}:{stop}) did not finish "
                         f"({len(lost)} blocks missing; rq: {why})")
        message = "; ".join(parts) or f"{len(missing)} of {blocks} storage blocks are not committed"
        return {"type": "ShardFailed", "message": f"{message}; the result is incomplete, resubmit the job"}

    def _fail(self, error: dict[str, str]) -> dict[str, Any]:
        _remove_partial(self.job)
        self.store.update(self.job.id, status=JobStatus.failed, error=error, finished_at=time.time())
        log.info("job %s failed: %s: %s", self.job.id, error["type"], error["message"])
        return {"id": self.job.id, "status": JobStatus.failed.value, "error": error}


def _json_serializer() -> Any:
    from rq.serializers import JSONSerializer

    return JSONSerializer


def _rq_context() -> tuple[Settings, Any, JobStore]:
    from rq import get_current_job

    settings = get_settings()
    rq_job = get_current_job()
    connection = rq_job.connection if rq_job is not None else redis.Redis.from_url(settings.redis_url)
    return settings, rq_job, JobStore(connection, ttl_s=settings.result_ttl_s)


def _invalid_spec(spec: Any, err: Exception, store: JobStore) -> dict[str, Any]:
    job_id = spec.get("id") if isinstance(spec, dict) else None
    message = f"spec: not a valid queued job: {err}"
    with job_context(str(job_id) if job_id else None):
        if job_id and store.exists(str(job_id)):
            store.update(str(job_id), status=JobStatus.failed, finished_at=time.time(),
                         error={"type": "InvalidJobSpec", "message": message})
        log.error("job %s failed: %s", job_id, message, extra={"event": "job_finished", "status": "failed"})
        metrics.observe_job_end("other", JobStatus.failed.value, 0.0)
    return {"id": job_id, "status": JobStatus.failed.value, "error": {"type": "InvalidJobSpec", "message": message}}


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """rq entry point (``"worker.tasks.run_job"``, JSON serializer): validate ``spec`` as a ``QueuedJob`` and run it.

    The job itself, or one of its shards (``spec["shard"]`` set). Engine errors end the job ``failed``
    without raising (rq must not retry them); transient storage or connection errors are re-raised
    so rq's ``Retry`` applies (to the failing shard alone, for a sharded job).
    """
    return _validated_run(spec, JobRun)


def finalize_job(spec: dict[str, Any]) -> dict[str, Any]:
    """rq entry point (``"worker.tasks.finalize_job"``) of a sharded job's finalizer: see ``Finalizer``."""
    return _validated_run(spec, Finalizer, part="finalizer")


def _validated_run(spec: dict[str, Any], run_class: type[JobRun] | type[Finalizer],
                   part: str | None = None) -> dict[str, Any]:
    """``spec`` validated as a ``QueuedJob`` (else the job fails as ``InvalidJobSpec``), then run."""
    from pydantic import ValidationError

    settings, rq_job, store = _rq_context()
    try:
        job = QueuedJob.model_validate(spec)
    except ValidationError as err:
        return _invalid_spec(spec, err, store)
    with job_context(job.id):
        return _run_observed(run_class(job, store, settings, rq_job), part=part)


def _run_observed(run: JobRun | Finalizer, part: str | None = None) -> dict[str, Any]:
    """``run.run()`` with its start and end logged and counted: queue wait, duration, finished by status.

    A shard or a finalizer counts as a finished job only when it sets the job's terminal status.
    """
    kind = run.job.kind.value
    if part is None and run.job.shard is not None:
        part = f"shard {run.job.shard + 1}/{run.job.shards}"
    what = f"job {run.job.id}" + (f" {part}" if part else "")
    wait_s = metrics.queue_wait_seconds(run.rq_job)
    if wait_s is not None:
        metrics.QUEUE_WAIT.observe(wait_s)
    log.info("%s started: %s of %s, queue wait %s s", what, kind, run.job.model.path,
             "?" if wait_s is None else f"{wait_s:.3f}",
             extra={"event": "job_started", "kind": kind, "queue_wait_s": wait_s, "part": part,
                    "attempt_retries_left": getattr(run.rq_job, "retries_left", None)})
    start = time.monotonic()
    status = "interrupted"
    try:
        with metrics.JOBS_RUNNING.track_inprogress():
            result = run.run()
        status = "skipped" if run.skipped else (run.metric_status or str(result.get("status")))
        return result
    except Exception:
        status = "retrying" if run.retries_left else (run.metric_status or JobStatus.failed.value)
        raise
    finally:
        seconds = time.monotonic() - start
        metrics.observe_job_end(kind, status, seconds)
        finished = status in metrics.FINISHED_STATUSES
        log.log(logging.WARNING if status in ("failed", "retrying") else logging.INFO,
                "%s %s %s after %.3f s", what, "ended" if finished else "attempt ended", status, seconds,
                extra={"event": "job_finished" if finished else "job_attempt_ended", "kind": kind, "status": status,
                       "duration_s": round(seconds, 6), "part": part})
