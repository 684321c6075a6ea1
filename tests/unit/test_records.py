"""``contracts.records``: ``Progress.of``'s rounding rules, and the public record keeping today's keys;
``JobRecord``'s typed fields read from and written to the hash as the previous code wrote it."""

from __future__ import annotations

import json

import pytest

from contracts.jobspec import JobStatus
from contracts.jobstore import CorruptRecord, JobRecord, JobStore, _encode_fields, merge_shard_progress
from contracts.records import ErrorInfo, JobPublic, PlanInfo, Progress, ResultInfo, dump

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
    new = JobRecord(id="a" * 32, status=JobStatus.queued, spec={}, created_at=0.0)
    every = {"rows_done": 0, "rows_total": None, "fraction": 0.0, "rows_per_second": None, "eta_seconds": None}
    assert dump(new.progress) == new.to_public()["progress"] == every
    assert json.loads(JobStore._encode(new)["progress"]) == every


def test_merged_shard_progress_is_progress_of_the_sums():
    plan = {"shards": 3, "ranges": [[0, 4], [4, 8], [8, 12]], "rows_total": 12}
    snaps = {0: {"rows_done": 4, "rows_total": 4, "rows_per_second": 9.0},  # finished: its rate no longer counts
             1: {"rows_done": 3, "rows_total": 4, "rows_per_second": 2.5}}
    assert merge_shard_progress(plan, snaps) == Progress.of(7, 12, 2.5)
    assert dump(merge_shard_progress(plan, snaps)) == {
        "rows_done": 7, "rows_total": 12, "fraction": 0.583333, "rows_per_second": 2.5, "eta_seconds": 2.0}
    assert merge_shard_progress(plan, {}).eta_seconds is None


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
        record(spec={"kind": "no_such_kind"}).public()


def test_the_published_schema_names_the_contract_fields():
    schema = JobPublic.model_json_schema(mode="serialization")
    assert set(schema["required"]) == PUBLIC_KEYS
    assert {"chunk_rows", "strategy", "mode", "free_bytes_at_start", "bytes_per_row", "oom_retries",
            "shards"} <= set(PlanInfo.model_json_schema()["properties"])
    assert set(Progress.model_json_schema()["properties"]) == {"rows_done", "rows_total", "fraction",
                                                               "rows_per_second", "eta_seconds"}


# -- the hash as the previous code wrote it (dict fields, JSON dumped as given) -----------------------------

SPEC = {"kind": "jacobian", "model": {"path": "/models/mlp", "signature": "serving_default"}, "of": "y", "wrt": "x",
        "results_url": "/tmp/results"}
PREVIOUS = {  # created, then moved to running, then its plan and a progress tick: the engine's plan in its own order
    "running": {
        "status": "running", "spec": json.dumps(SPEC), "created_at": "1700000000.25", "started_at": "1700000001.5",
        "finished_at": "",
        "progress": '{"rows_done": 8, "rows_total": 64, "fraction": 0.125, "rows_per_second": 200.0, '
                    '"eta_seconds": 0.28}',
        "plan": '{"shards": 1, "chunk_rows": 16, "strategy": "vectorized", "mode": "reverse", "free_bytes_at_start": '
                '8589934592, "bytes_per_row": 4096, "fixed_bytes": null, "oom_retries": 0, "xla": false, "source": '
                '"default", "rows_per_second": {"16": 210.5}}',
        "result": "null", "error": "null", "cancel_requested": "0", "deaths": "[]"},
    "sparse_succeeded": {
        "status": "succeeded", "spec": json.dumps(SPEC), "created_at": "1700000000.25", "started_at": "1700000001.5",
        "finished_at": "1700000009.125",
        "progress": '{"rows_done": 64, "rows_total": 64, "fraction": 1.0, "rows_per_second": 80.5, "eta_seconds": 0.0}',
        "plan": '{"kind": "jacobian", "strategy": "sparse", "mode": "forward", "shards": 1, "oom_retries": 0, '
                '"sparsity": {"source": "auto", "nnz": 120, "density": 0.05, "colors": 3, "verified": true}}',
        "result": '{"uri": "/tmp/results/c/result.zarr", "shape": [120], "dtype": "float32", "format": "coo", '
                  '"dense_shape": [64, 40]}',
        "error": "null", "cancel_requested": "0", "deaths": '["SIGKILL (exit -9)"]'},
    "retried": {
        "status": "queued", "spec": json.dumps(SPEC), "created_at": "1700000000.25", "started_at": "1700000001.5",
        "finished_at": "", "progress": "{}", "plan": "{}", "result": "null",
        "error": '{"type": "ResultWriteError", "message": "s3: down", "transient": true}',
        "cancel_requested": "1", "deaths": "[]"},
    "older_than_deaths": {  # no cancel_requested, deaths or finished_at: fields added later read as their defaults
        "status": "failed", "spec": json.dumps(SPEC), "created_at": "1700000000.25", "started_at": "",
        "progress": '{"rows_done": 0, "rows_total": null, "fraction": 0.0, "rows_per_second": null, '
                    '"eta_seconds": null}',
        "plan": "{}", "result": "null", "error": '{"type": "Canceled", "message": "canceled before it started"}'},
}


def as_stored(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def previously_served(fields: dict[str, str]) -> dict:
    """What the previous ``to_public`` answered: the stored JSON validated as ``JobPublic`` in one go."""
    body = {name: json.loads(fields[name]) for name in ("progress", "plan", "result", "error")}
    return dump(JobPublic.model_validate({
        "id": "c" * 32, "status": fields["status"], **body, "created_at": "2023-11-14T22:13:20.250Z",
        "started_at": "2023-11-14T22:13:21.500Z" if fields.get("started_at") else None,
        "finished_at": "2023-11-14T22:13:29.125Z" if fields.get("finished_at") else None,
        "kind": SPEC["kind"], "model": SPEC["model"]}))


@pytest.mark.parametrize("name", list(PREVIOUS))
def test_a_record_the_previous_code_wrote_reads_typed_and_serves_the_same(name):
    fields = PREVIOUS[name]
    rec = JobStore._decode("c" * 32, as_stored(fields))
    assert isinstance(rec.progress, Progress) and isinstance(rec.plan, PlanInfo)
    assert rec.result is None or isinstance(rec.result, ResultInfo)
    assert rec.error is None or isinstance(rec.error, ErrorInfo)
    assert rec.to_public() == previously_served(fields)
    for field in ("progress", "plan", "result", "error"):  # the keys each record was written with, no more
        assert dump(getattr(rec, field)) == json.loads(fields[field])


def test_previous_records_read_as_attributes():
    running = JobStore._decode("c" * 32, as_stored(PREVIOUS["running"]))
    assert (running.progress.rows_done, running.progress.rows_total, running.plan.chunk_rows) == (8, 64, 16)
    assert running.plan.model_extra == {"fixed_bytes": None, "xla": False, "source": "default",
                                        "rows_per_second": {"16": 210.5}}
    assert running.status == JobStatus.running and running.spec == SPEC and running.deaths == []
    done = JobStore._decode("c" * 32, as_stored(PREVIOUS["sparse_succeeded"]))
    assert (done.result.format, done.result.dense_shape, done.result.uri) == ("coo", [64, 40],
                                                                              "/tmp/results/c/result.zarr")
    assert done.plan.sparsity["nnz"] == 120 and done.deaths == ["SIGKILL (exit -9)"]
    assert done.finished_at == 1700000009.125
    retried = JobStore._decode("c" * 32, as_stored(PREVIOUS["retried"]))
    assert retried.error == ErrorInfo(type="ResultWriteError", message="s3: down", transient=True)
    assert retried.cancel_requested and dump(retried.plan) == {} and dump(retried.progress) == {}
    old = JobStore._decode("c" * 32, as_stored(PREVIOUS["older_than_deaths"]))
    assert (old.cancel_requested, old.deaths, old.started_at, old.finished_at) == (False, [], None, None)
    assert old.error.message == "canceled before it started" and old.progress.rows_total is None


@pytest.mark.parametrize("name", ["sparse_succeeded", "retried"])
def test_a_previous_record_is_written_back_byte_for_byte(name):
    """Records written as models before (progress, result, error) come back as the same bytes."""
    fields = PREVIOUS[name]
    written = JobStore._encode(JobStore._decode("c" * 32, as_stored(fields)))
    assert {k: v for k, v in written.items() if k != "plan"} == {k: v for k, v in fields.items() if k != "plan"}
    assert json.loads(written["plan"]) == json.loads(fields["plan"])  # declared keys first, then the engine's


def test_an_engine_plan_written_now_reads_back_with_its_keys_and_values():
    engine = json.loads(PREVIOUS["running"]["plan"])
    stored = _encode_fields({"plan": PlanInfo.model_validate(engine)})["plan"]
    assert json.loads(stored) == engine
    assert JobStore._decode("c" * 32, as_stored({**PREVIOUS["running"], "plan": stored})).plan == \
        JobStore._decode("c" * 32, as_stored(PREVIOUS["running"])).plan


@pytest.mark.parametrize("field,value", [
    ("progress", '{"rows_done": "many"}'), ("plan", '{"chunk_rows": "big"}'), ("result", '{"uri": "/r"}'),
    ("error", '{"message": "no type"}'), ("plan", "not json"), ("status", "lost"), ("progress", "null"),
])
def test_a_stored_field_that_does_not_fit_its_model_is_a_corrupt_record(field, value):
    with pytest.raises(CorruptRecord, match=f"(?s)job {'c' * 32}: .*{field}"):
        JobStore._decode("c" * 32, as_stored({**PREVIOUS["running"], field: value}))


@pytest.mark.parametrize("field,value", [
    ("plan", {"chunk_rows": 4}), ("progress", {"rows_done": 1}), ("result", {"uri": "/r", "shape": [1], "dtype": "f"}),
    ("error", {"type": "X", "message": "y"}), ("progress", None), ("plan", None),
])
def test_a_record_field_is_written_only_as_its_model(field, value):
    with pytest.raises(TypeError, match=f"^{field}: give a contracts.records"):
        _encode_fields({field: value})
    assert _encode_fields({"result": None, "error": None}) == {"result": "null", "error": "null"}
