"""Prometheus series for every kind: the worker's kind label is the registry's closed set, and the kinds whose
progress goes through ``RunContext.counter`` (products, spectra, sparse colours) report their units of work."""

from __future__ import annotations

from types import SimpleNamespace

from contracts.kinds import KINDS
from worker import metrics
from worker.execution.context import RunContext


def test_every_kind_is_its_own_label_and_nothing_else_is():
    assert set(metrics.KINDS) == set(KINDS)
    for kind in KINDS:
        assert metrics.kind_label(kind) == kind
    assert metrics.kind_label("../../etc/passwd") == "other"
    series = {s.labels.get("kind") for m in metrics.REGISTRY.collect() if m.name == "jacobian_jobs_finished"
              for s in m.samples}
    assert set(KINDS) <= series   # every series exists before the first job


def test_progress_through_the_counter_reports_units_to_the_metrics():
    heard: list[tuple[str, int, int]] = []
    ctx = RunContext(job=SimpleNamespace(kind=SimpleNamespace(value="svd")), load_inputs=dict, load_model=dict,
                     on_units=lambda kind, n, nbytes, s: heard.append((kind, n, nbytes)))
    report = ctx.counter(10)
    for done in (3, 3, 7, 10):
        report(done)
    assert heard == [("svd", 3, 0), ("svd", 4, 0), ("svd", 3, 0)]

    before = metrics.ROWS_COMPUTED.labels("hvp")._value.get()
    metrics.observe_chunk("hvp", 5, 0, 0.1)
    assert metrics.ROWS_COMPUTED.labels("hvp")._value.get() == before + 5
