"""``contracts.records``: ``Progress.of``'s rounding rules, and the public record keeping today's keys."""

from __future__ import annotations

import pytest

from contracts.jobspec import JobStatus
from contracts.jobstore import CorruptRecord, JobRecord, merge_shard_progress
from contracts.records import ErrorInfo, JobPublic, PlanInfo, Progress, dump

PUBLIC_KEYS = {"id", "status", "progress", "plan", "result", "error", "created_at", "started_at", "finished_at",
               "kind", "model"}  # DESIGN.md, "HTTP contract (v1)": these names do not change


@pytest.mark.parametrize("args,expected", [
    ((1, 4, 0.5), (0.25, 0.5, 6.0)),
    ((1, 3, 0.0), (0.333333, 0.0, None)),  # no rate measured yet: ETA unknown
    ((2, 3, 1.23456), (0.666667, 1.235, 0.81)),  # 1 / 1.23456 = 0.81000...
    ((0, 0, 0.0), (1.0, 0.0, 0.0)),  # nothing to do is done
    ((3, 3, 7.0), (1.0, 7.0, 0.0)),
    ((5, 3, 2.0), (1.666667, 2.0, 0.0)),  # more reported than rows: nothing left
    ((1, 7, 3.0), (0.142857, 3.0, 2.0)),
])
def test_progress_of(args, expected):
    p = Progress.of(*args)
    assert (p.rows_done, p.rows_total) == args[:2]
    assert (p.fraction, p.rows_per_second, p.eta_seconds) == expected


def test_a_job_not_started_has_every_progress_key():
    assert JobRecord(id="a" * 32, status=JobStatus.queued, spec={}, created_at=0.0).progress == {
        "rows_done": 0, "rows_total": None, "fraction": 0.0, "rows_per_second": None, "eta_seconds": None}


def test_merged_shard_progress_is_progress_of_the_sums():
    plan = {"shards": 3, "ranges": [[0, 4], [4, 8], [8, 12]], "rows_total": 12}
    snaps = {0: {"rows_done": 4, "rows_total": 4, "rows_per_second": 9.0},  # finished: its rate no longer counts
             1: {"rows_done": 3, "rows_total": 4, "rows_per_second": 2.5}}
    assert merge_shard_progress(plan, snaps) == Progress.of(7, 12, 2.5).model_dump() == {
        "rows_done": 7, "rows_total": 12, "fraction": 0.583333, "rows_per_second": 2.5, "eta_seconds": 2.0}
    assert merge_shard_progress(plan, {})["eta_seconds"] is None


def record(**fields) -> JobRecord:
    spec = {"kind": "batch_jacobian", "model": {"path": "/models/mlp", "signature": "serving_default"}}
    return JobRecord(**{"id": "b" * 32, "status": JobStatus.running, "spec": spec, "created_at": 1_700_000_000.25,
                        "started_at": 1_700_000_001.5, **fields})


def test_the_public_record_is_the_stored_one_with_the_same_keys():
    engine_plan = {"chunk_rows": 16, "strategy": "tiled+xla", "mode": "reverse", "free_bytes_at_start": 2 ** 33,
                   "bytes_per_row": 4096, "fixed_bytes": None, "oom_retries": 0, "xla": True, "source": "trial",
                   "plan_key": "abc", "trial": {"label": "vectorized", "rows": 8}, "rows_per_second": {"16": 210.5},
                   "shards": 1}
    progress = Progress.of(16, 64, 200.0).model_dump()
    public = record(plan=engine_plan, progress=progress).to_public()
    assert set(public) == PUBLIC_KEYS
    assert public == {"id": "b" * 32, "status": "running", "progress": progress, "plan": engine_plan,
                      "result": None, "error": None, "created_at": "2023-11-14T22:13:20.250Z",
                      "started_at": "2023-11-14T22:13:21.500Z", "finished_at": None, "kind": "batch_jacobian",
                      "model": {"path": "/models/mlp", "signature": "serving_default"}}


def test_a_record_not_planned_yet_keeps_its_empty_plan_and_progress():
    """The UI reads ``"plan": {}`` as "not chosen yet": defaults are not filled in."""
    public = record(status=JobStatus.queued, started_at=None, plan={}, progress={}).to_public()
    assert public["plan"] == {} and public["progress"] == {}


def test_errors_keep_their_keys():
    assert dump(ErrorInfo(type="Canceled", message="canceled before it started")) == {
        "type": "Canceled", "message": "canceled before it started"}
    public = record(status=JobStatus.queued, error={"type": "ResultWriteError", "message": "s3", "transient": True})
    assert public.to_public()["error"] == {"type": "ResultWriteError", "message": "s3", "transient": True}


def test_a_record_that_does_not_fit_is_corrupt_not_a_bad_request():
    with pytest.raises(CorruptRecord, match="b" * 32):
        record(result={"uri": "/r"}).public()


def test_the_published_schema_names_the_contract_fields():
    schema = JobPublic.model_json_schema(mode="serialization")
    assert set(schema["required"]) == PUBLIC_KEYS
    assert {"chunk_rows", "strategy", "mode", "free_bytes_at_start", "bytes_per_row", "oom_retries",
            "shards"} <= set(PlanInfo.model_json_schema()["properties"])
    assert set(Progress.model_json_schema()["properties"]) == {"rows_done", "rows_total", "fraction",
                                                               "rows_per_second", "eta_seconds"}
