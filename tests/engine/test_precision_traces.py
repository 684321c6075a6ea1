"""What the precision guard's float64 side costs a later process (issue 25): the float64 copy's graph without a second
copy of the weights, and the probes' traced functions kept in the job's cache folder for the next process."""

from __future__ import annotations

import numpy as np
import pytest

from tests import precision_models
from tests.engine.conftest import rand

X = rand((2, 6), seed=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(precision_models.cancelling(tmp_path_factory.mktemp("traces") / "cancelling"))


def test_the_float64_copy_holds_no_second_copy_of_the_weights(model_path):
    """The frozen weights the copy feeds with its float64 variables are placeholders in its graph, not constants."""
    from tensorflow.core.framework import types_pb2

    from worker.engine import load_model
    from worker.engine.float64 import float64_model

    model = load_model(model_path)
    m64 = float64_model(model)
    assert m64.fn.call is None   # the graph is built on the first call
    y64 = m64.fn(x=X.astype(np.float64))["y"].numpy()
    weights = sum(int(np.prod(v.shape)) * 8 for v in m64.variables.values() if v.dtype.name == "float64")
    graph = m64.fn.call.wrapped.graph.as_graph_def()
    constants = sum(len(n.attr["value"].tensor.tensor_content) for n in graph.node
                    if n.op == "Const" and n.attr["value"].tensor.dtype == types_pb2.DT_DOUBLE)
    fed = [n for n in graph.node if n.op == "Placeholder" and n.attr["dtype"].type == types_pb2.DT_DOUBLE]
    assert weights > 0 and constants < weights / 2
    assert len(fed) >= len([v for v in model.variables.values() if v.dtype.is_floating])
    y32 = model.fn(x=X)["y"].numpy()
    assert y64.dtype == np.float64 and np.linalg.norm(y64 - y32) < 1e-3 * np.linalg.norm(y64)


def _job(model_path, tmp_path, job_id, cache_dir, inputs=None, **options):
    """A fresh load of the model (as a new process has) and one guarded job (``of="y"`` unless ``options`` say):
    its manifest."""
    from worker.engine import TFMemoryProbe, load_model
    from worker.execution import executor_for
    from worker.execution.local import local_context
    from worker.execution.precision import run_guarded

    ctx = local_context(load_model(model_path), inputs or {"x": X}, results_url=str(tmp_path), job_id=job_id,
                        probe=TFMemoryProbe(), cache_dir=cache_dir, **{"of": "y", **options})
    return run_guarded(executor_for(ctx.job), ctx, keep_copy=False)


@pytest.fixture
def float64_loads(monkeypatch):
    """Whether each load of a kept float64 trace (``trace_cache.load`` of the float64 copy) found one."""
    from worker.engine import trace_cache

    loads = []
    load = trace_cache.load

    def watched(cache_dir, key, variables):
        found = load(cache_dir, key, variables)
        if key and str(key[2]).endswith("-float64"):
            loads.append(found is not None)
        return found

    monkeypatch.setattr(trace_cache, "load", watched)
    return loads


@pytest.fixture
def float64_builds(monkeypatch):
    """How many times the float64 copy's graph was built (``float64._convert``)."""
    from worker.engine import float64

    builds = []
    convert = float64._convert

    def counted(*args, **kwargs):
        builds.append(1)
        return convert(*args, **kwargs)

    monkeypatch.setattr(float64, "_convert", counted)
    return builds


@pytest.fixture
def float64_copies(monkeypatch):
    """How many float64 copies of a model were made (``float64._deferred``: its float64 variables)."""
    from worker.engine import float64

    copies = []
    deferred = float64._deferred

    def counted(model):
        copies.append(1)
        return deferred(model)

    monkeypatch.setattr(float64, "_deferred", counted)
    return copies


def test_the_float64_probes_are_kept_in_the_cache_folder_and_the_next_process_loads_them(model_path, tmp_path,
                                                                                          float64_loads,
                                                                                          float64_builds,
                                                                                          float64_copies):
    """The next process on other inputs loads the kept probes, bound to the copy's variables, and never builds the
    copy's graph; one on the same model, request and inputs reads the float64 rows themselves (``reference_rows``)
    and makes no copy at all."""
    x2 = rand((2, 6), seed=2)
    loads, cache = float64_loads, tmp_path / "cache"
    first = _job(model_path, tmp_path, "first", str(cache))
    assert loads == [False] and len(float64_builds) == 1   # traced here (through the copy's graph), then kept
    second = _job(model_path, tmp_path, "second", str(cache), {"x": x2})
    assert loads == [False, True] and len(float64_builds) == 1 and len(float64_copies) == 2
    again = _job(model_path, tmp_path, "again", str(cache))
    assert loads == [False, True] and len(float64_builds) == 1   # the first job's float64 rows, read
    assert len(float64_copies) == 2   # and not even the copy's float64 variables made
    assert first["precision_probes"] == second["precision_probes"] == again["precision_probes"] == 3
    assert first["precision_error"] > 1e-6   # the cancelling model's error, found the same way twice
    assert again["precision_error"] == pytest.approx(first["precision_error"], rel=1e-12)
    loads.clear()
    for job_id, inputs, job in (("nocache1", {"x": X}, first), ("nocache2", {"x": x2}, second)):
        none = _job(model_path, tmp_path, job_id, None, inputs)   # no cache folder: eager, nothing kept or loaded
        assert loads == [] and none["precision_error"] == pytest.approx(job["precision_error"], rel=1e-9)
    assert len(float64_builds) == 3


@pytest.mark.parametrize("kind,of,seeded,options", [("vjp", "y", True, {}), ("hvp", "loss", True, {}),
                                                    ("hessian_trace", "loss", False, {}),
                                                    ("hessian_eig", "loss", False, {"rank": 2})])
def test_every_family_keeps_its_float64_probes(model_path, tmp_path, float64_loads, kind, of, seeded, options):
    """Products and the spectral kinds' applied products too: kept by the first process, loaded by the next, and
    the estimate what the eager probes of a job without a cache folder give (the float32 side of a spectral
    estimate may run another route in each job: 1 % there)."""
    inputs = {"x": X, **({"__seeds__": rand((4, 2, 6), seed=5)} if seeded else {})}
    cache = str(tmp_path / "cache")
    jobs = [_job(model_path, tmp_path, f"{kind}{i}", cache_dir, inputs, kind=kind, of=of, wrt="x", **options)
            for i, cache_dir in enumerate((cache, cache, None))]
    assert float64_loads == [False, True]
    errors = [job["precision_error"] for job in jobs]
    assert errors[0] > 1e-6 and errors == [pytest.approx(errors[2], rel=1e-9 if seeded else 1e-2)] * 3


class _Op:
    """An operator whose compiled (``reverse/loop``) products fail, or all products fail."""

    def __init__(self, labels, *, eager_fails=False):
        self.labels, self.eager_fails, self.calls = dict(labels), eager_fails, []

    def apply(self, kind, seeds):
        self.calls.append(self.labels[kind])
        if self.labels[kind].endswith("/loop") or self.eager_fails:
            raise RuntimeError(f"{self.labels[kind]} cannot run")
        return seeds * 2


def test_a_compiled_probe_that_fails_is_computed_eager_and_an_eager_failure_is_raised():
    from worker.execution.precision import EAGER, KEPT, _apply64

    op = _Op(KEPT)
    assert np.array_equal(_apply64(op, "vjp", np.ones(3)), np.full(3, 2.0))
    assert op.calls == ["reverse/loop", "reverse/eager"] and op.labels == {**KEPT, **EAGER}
    op = _Op(EAGER, eager_fails=True)
    with pytest.raises(RuntimeError, match="reverse/eager cannot run"):
        _apply64(op, "vjp", np.ones(3))
    assert op.calls == ["reverse/eager"]
