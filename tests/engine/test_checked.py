"""``build_problem(checked=...)``: the shards of a job reuse what the planner's checks found and skip
the eager checks (probe gradient, forward-mode test, independence check), for the very same request
only; any other request is checked in full."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.engine.conftest import rand
from worker.engine import RunOptions, build_problem, run_problem
from worker.engine import problem as problem_module


def refuse_eager_checks(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the eager checks ran")

    monkeypatch.setattr(problem_module, "_check_request", refuse)
    monkeypatch.setattr(problem_module, "verify_independence", refuse)


def rows_of(problem) -> np.ndarray:
    rows = []
    run_problem(problem, options=RunOptions(strategy="vectorized", chunk_rows=3),
                on_chunk=lambda start, r: rows.append(np.array(r)))
    return np.concatenate(rows)


def as_travelled(problem) -> dict:
    return json.loads(json.dumps(problem.checked()))  # through Redis, as the shard plan


@pytest.mark.parametrize("kind,batch", [("jacobian", 3), ("batch_jacobian", 5)])
def test_same_request_skips_the_eager_checks_and_computes_the_same(loaded, monkeypatch, kind, batch):
    model = loaded("mlp")
    inputs = {"x": rand((batch, 8))}
    full = build_problem(model, inputs, kind=kind, check_independence=kind == "batch_jacobian")
    checked = as_travelled(full)
    refuse_eager_checks(monkeypatch)
    again = build_problem(model, inputs, kind=kind, check_independence=kind == "batch_jacobian", checked=checked)
    assert (again.mode, again.of_shape, again.wrt_shape, again.layout) == \
        (full.mode, full.of_shape, full.wrt_shape, full.layout)
    monkeypatch.undo()
    np.testing.assert_array_equal(rows_of(again), rows_of(full))


@pytest.mark.parametrize("change", ["input shape", "kind", "explicit other mode", "of"])
def test_checked_of_another_request_is_ignored(loaded, monkeypatch, change):
    model = loaded("mlp")
    inputs = {"x": rand((3, 8))}
    checked = as_travelled(build_problem(model, inputs))
    assert checked["mode"] == "reverse"  # 12 outputs, 24 inputs
    request = {"inputs": inputs, "kind": "jacobian", "mode": "auto"}
    if change == "input shape":
        request["inputs"] = {"x": rand((4, 8))}
    elif change == "kind":
        request["kind"] = "batch_jacobian"
    elif change == "explicit other mode":
        request["mode"] = "forward"
    else:
        checked["of"] = "not-this-output"
    refuse_eager_checks(monkeypatch)
    with pytest.raises(AssertionError, match="the eager checks ran"):
        build_problem(model, request["inputs"], kind=request["kind"], mode=request["mode"], checked=checked)
