"""Property-based tests of the HTTP API from its own OpenAPI schema (schemathesis), against the app
in-process (ASGI) on a real redis-server: no 5xx, and every answer conforms to the schema
(status code documented, content type and body as declared). Each operation gets requests that fit
the schema (positive) and requests that break it (negative: these must be refused with a 4xx).
Deterministic: a fixed number of generated cases per operation and mode, derandomized; at least
MIN_CASES in all."""

from __future__ import annotations

import itertools

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.generation import GenerationMode

from contracts.settings import get_settings

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 120
API_KEY = "schemathesis-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MIN_CASES = 1000  # over all operations (those without parameters have only a few distinct cases)
# No 5xx, and answers as the schema declares them. Left out: positive_data_acceptance, since the API
# rightly answers 4xx to schema-valid requests naming a model that does not exist, a job id that is
# unknown or inputs that do not match the model's signature.
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance]
# Requests that break the schema (wrong types, missing required values) must be refused with a 4xx.
NEGATIVE_CHECKS = [*CHECKS, checks.negative_data_rejection]


def has_inputs(operation) -> bool:
    """Whether the operation takes anything a request could get wrong (else there are no negative cases); the
    ``Authorization`` header is not one: every case carries the key (``AUTH``)."""
    headers = [h for h in operation.headers if h.name.lower() != "authorization"]
    sets = (operation.path_parameters, operation.query, headers)
    return bool(operation.body) or any(len(list(params)) for params in sets)


@pytest.fixture
def api_schema(redis_server, redis_conn, model_root, tmp_path, monkeypatch):
    from app.main import create_app

    monkeypatch.setenv("JACOBIAN_REDIS_URL", redis_server.url)
    monkeypatch.setenv("JACOBIAN_RESULTS_URL", str(tmp_path / "results"))
    monkeypatch.setenv("JACOBIAN_MODEL_ROOTS", str(model_root))
    monkeypatch.setenv("JACOBIAN_QUEUE_NAME", "jacobian-schemathesis")  # no worker: jobs stay queued
    monkeypatch.setenv("JACOBIAN_API_KEYS", API_KEY)  # the schema declares the bearer scheme: make it hold
    get_settings.cache_clear()
    yield schemathesis.openapi.from_asgi("/openapi.json", create_app())
    get_settings.cache_clear()


def test_api_conforms_to_its_schema(api_schema):
    """Every operation and mode: MAX_EXAMPLES generated cases, each answer checked by schemathesis' checks.

    (Operations are looped over here rather than through schemathesis' pytest plugin, which does
    not support pytest 9 yet.)"""
    from hypothesis import given

    failures: dict[str, str] = {}
    cases: dict[str, int] = {}
    statuses: dict[int, int] = {}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation, mode in itertools.product(operations, GenerationMode):
        if mode == GenerationMode.NEGATIVE and not has_inputs(operation):
            continue
        label = f"{operation.label} ({mode.value})"

        @given(case=operation.as_strategy(generation_mode=mode, headers=AUTH))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:  # runs at once, in this iteration: label and mode are this iteration's
            cases[label] = cases.get(label, 0) + 1  # noqa: B023
            response = case.call_and_validate(  # noqa: B023
                checks=CHECKS if mode == GenerationMode.POSITIVE else NEGATIVE_CHECKS)  # noqa: B023
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        try:
            check()
        except (Exception, BaseExceptionGroup) as err:  # noqa: BLE001 - collect every operation's failure, then report
            failures[label] = f"{type(err).__name__}: {err}"[:3000]
    print(f"\n[schemathesis] {sum(cases.values())} cases: " + ", ".join(f"{k} {v}" for k, v in cases.items())
          + f"; answers by status: {dict(sorted(statuses.items()))}")
    assert not failures, "\n\n".join(f"{label}:\n{msg}" for label, msg in failures.items())
    assert sum(cases.values()) >= MIN_CASES, cases
    assert 401 not in statuses, statuses  # every case carried the key: the API's checks were reached
