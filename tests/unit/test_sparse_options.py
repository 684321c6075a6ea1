"""The ``sparsity`` option: its forms in JSON, in the ``.npz`` query, from the client and the CLI; refused
with a message naming the field and the fix for other kinds, several ``wrt`` or a variable; its status
fields (``plan.sparsity``, ``result.format``) kept as given."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from app.errors import InvalidRequest, validation_message
from app.inputs import parse_npz_query
from contracts.jobspec import JobCreate, JobOptions, PatternFrom, PatternUri, QueuedJob, RequestedOptions
from contracts.records import JobPublic
from jacobian.cli_client import sparsity_option
from jacobian.client import JacobianClient, _row_geometry

JOB = "0123456789abcdef0123456789abcdef"


def message(**options) -> str:
    with pytest.raises(ValidationError) as err:
        RequestedOptions(**options)
    return validation_message(err.value.errors())


@pytest.mark.parametrize("value,parsed", [
    (None, None), ("auto", "auto"), ({"pattern_uri": "s3://b/p.npz"}, PatternUri(pattern_uri="s3://b/p.npz")),
    ({"pattern_from": JOB}, PatternFrom(pattern_from=JOB)),
])
def test_accepted_forms_round_trip_through_the_queued_spec(value, parsed):
    options = JobOptions(wrt="x", sparsity=value)
    assert options.sparsity == parsed
    dumped = options.model_dump(mode="json")["sparsity"]
    assert dumped == value
    spec = QueuedJob(id="j", model={"path": "/m"}, inputs_uri="/i.npz", results_url="/r", wrt="x", sparsity=value)
    assert QueuedJob.model_validate(spec.model_dump(mode="json")).sparsity == parsed


@pytest.mark.parametrize("value,expected", [
    ("dense", "sparsity: 'dense' is not a sparsity; use one of null, 'auto', {'pattern_uri'"),
    (5, "sparsity: 5 is not a sparsity"),
    ({"pattern_uri": ""}, "sparsity: {'pattern_uri': ''} is not a sparsity"),
    ({"pattern_uri": "a.npz", "extra": 1}, "sparsity: {'pattern_uri': 'a.npz', 'extra': 1} is not a sparsity"),
    ({"pattern": "a.npz"}, "sparsity: {'pattern': 'a.npz'} is not a sparsity"),
    ({"pattern_from": "not-an-id"}, "sparsity.pattern_from: 'not-an-id' is not a job id; give the 32 hex digits"),
])
def test_other_forms_are_refused_with_the_accepted_ones(value, expected):
    assert message(wrt="x", sparsity=value).startswith(expected)


@pytest.mark.parametrize("options,expected", [
    ({"kind": "hessian_diag"}, "sparsity: only for kind 'jacobian' or 'hessian'"),
    ({"kind": "batch_jacobian"}, "sparsity: only for kind 'jacobian' or 'hessian'"),
    ({"kind": "jvp", "wrt": ["a", "b"]}, "sparsity: only for kind 'jacobian' or 'hessian'"),
    ({"wrt": "variables/d0/kernel"}, "sparsity: works with respect to one signature input, not "
                                     "'variables/d0/kernel'; name one input as wrt"),
])
def test_only_kind_jacobian_wrt_one_input(options, expected):
    text = message(sparsity="auto", **options)
    assert text.startswith(expected) and "remove sparsity" in text, text


def test_extra_fields_are_still_forbidden_and_the_schema_has_each_form():
    with pytest.raises(ValidationError) as err:
        JobOptions(sparsity="auto", sparse=True)
    assert "sparse: unknown field" in validation_message(err.value.errors())
    schema = JobCreate.model_json_schema()
    forms = schema["properties"]["sparsity"]["anyOf"]
    assert {"const": "auto", "type": "string"} in forms and {"type": "null"} in forms
    for name in ("PatternUri", "PatternFrom"):
        assert schema["$defs"][name]["additionalProperties"] is False
    assert schema["$defs"]["PatternFrom"]["properties"]["pattern_from"]["pattern"] == "^[0-9a-f]{32}$"


@pytest.mark.parametrize("query,expected", [
    ("auto", "auto"), (f"pattern_from:{JOB}", {"pattern_from": JOB}),
    ("pattern_uri:s3://bucket/p.npz", {"pattern_uri": "s3://bucket/p.npz"}),
    (json.dumps({"pattern_uri": "/r/p.npz"}), {"pattern_uri": "/r/p.npz"}), ("", None), ("null", None),
])
def test_the_npz_query_takes_short_forms_and_json(query, expected):
    options, _ = parse_npz_query({"model_path": "m", "wrt": "x", "sparsity": query})
    assert options.model_dump(mode="json")["sparsity"] == expected


def test_the_npz_query_names_a_bad_sparsity():
    with pytest.raises(InvalidRequest) as err:
        parse_npz_query({"model_path": "m", "sparsity": "{not json"})
    assert err.value.field == "sparsity" and "sparsity=pattern_from:<job id>" in err.value.message
    with pytest.raises(ValidationError) as verr:
        parse_npz_query({"model_path": "m", "sparsity": "pattern_from:xyz"})
    assert validation_message(verr.value.errors()).startswith("sparsity.pattern_from: 'xyz' is not a job id")


@pytest.mark.parametrize("flag,query", [
    (None, None), ("auto", "auto"), (f"pattern_from:{JOB}", f"pattern_from:{JOB}"),
    ("s3://bucket/p.npz", "pattern_uri:s3://bucket/p.npz"), ("/results/p.npz", "pattern_uri:/results/p.npz"),
])
def test_cli_flag_becomes_the_query_parameter(flag, query):
    assert sparsity_option(flag) == query


def test_client_sends_a_dict_sparsity_as_json_in_the_query():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202, json={"id": JOB, "status": "queued"})

    client = JacobianClient("http://api", transport=httpx.MockTransport(handler))
    client.submit("m", {"x": np.ones(3, np.float32)}, sparsity={"pattern_from": JOB})
    client.submit("m", {"x": np.ones(3, np.float32)}, sparsity="auto")
    first, second = (dict(r.url.params)["sparsity"] for r in seen)
    assert json.loads(first) == {"pattern_from": JOB} and second == "auto"
    options, _ = parse_npz_query(dict(seen[0].url.params))
    assert options.sparsity == PatternFrom(pattern_from=JOB)


def record(**fields) -> JobPublic:
    base = {"id": JOB, "status": "succeeded", "progress": {"rows_done": 5, "rows_total": 5}, "plan": {},
            "result": None, "error": None, "created_at": None, "started_at": None, "finished_at": None,
            "kind": "jacobian", "model": None}
    return JobPublic.model_validate({**base, **fields})


def test_status_keeps_plan_sparsity_and_the_result_format_as_stored():
    sparsity = {"source": "auto", "nnz": 40, "density": 0.01, "colors": 5, "verified": True, "mode": "forward",
                "extra": {"kept": [1, 2]}}
    result = {"uri": "/r/j/result.zarr", "shape": [40], "dtype": "float32", "format": "coo",
              "dense_shape": [100, 40]}
    public = record(plan={"strategy": "vectorized", "sparsity": sparsity}, result=result)
    dumped = public.model_dump(mode="json", exclude_unset=True)
    assert dumped["plan"] == {"strategy": "vectorized", "sparsity": sparsity} and dumped["result"] == result
    dense = record(result={"uri": "/r", "shape": [2, 3], "dtype": "float32"})
    assert dense.model_dump(mode="json", exclude_unset=True)["result"] == {"uri": "/r", "shape": [2, 3],
                                                                            "dtype": "float32"}


def test_client_row_geometry_of_a_sparse_result_is_the_dense_matrix_s():
    sparse = {"uri": "/r", "shape": [40], "dtype": "float32", "format": "coo", "dense_shape": [100, 40]}
    assert _row_geometry(record(result=sparse, progress={"rows_total": 5})) == (100, 160)
    # a sparse job whose record lacks format and dense_shape: unknown (the client asks the API)
    plan = {"sparsity": {"source": "auto", "nnz": 40}}
    assert _row_geometry(record(plan=plan, result={"uri": "/r", "shape": [40], "dtype": "float32"})) == (None, None)
    # the sparse path not taken: a dense result, its progress counts its rows
    fallback = {"sparsity": {"source": "auto", "fallback": "dense: density 0.4"}}
    assert _row_geometry(record(plan=fallback, result={"uri": "/r", "shape": [5, 4], "dtype": "float32"})) == (5, 16)


def test_client_asks_the_api_for_the_geometry_the_record_lacks():
    plan = {"sparsity": {"source": "auto", "nnz": 3}}
    body = record(plan=plan, result={"uri": "/r", "shape": [3], "dtype": "float32"}).model_dump(mode="json")
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/result"):
            spec = request.url.params["rows"]
            asked.append(spec)
            a, b = (int(x) for x in spec.split(":"))
            buf = io.BytesIO()
            np.save(buf, rows[a:b])
            return httpx.Response(200, content=buf.getvalue(), headers={"X-Rows-Total": "6", "X-Row-Shape": "[2]"})
        return httpx.Response(200, json=body)

    client = JacobianClient("http://api", transport=httpx.MockTransport(handler))
    assert client.row_geometry(JOB) == (6, 8)
    pages = list(client.iter_rows(JOB, page_bytes=16))
    assert [p.shape[0] for p in pages] == [2, 2, 2] and asked[-3:] == ["0:2", "2:4", "4:6"]
    np.testing.assert_array_equal(np.concatenate(pages), rows)
