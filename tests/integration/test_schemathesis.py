"""Property-based tests of the HTTP API from its own OpenAPI schema (schemathesis), against the app
in-process (ASGI) on a real redis-server: no 5xx, and every answer conforms to the schema
(status code documented, content type and body as declared). Deterministic: a fixed number of
generated cases per operation, derandomized."""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis import checks
from hypothesis import HealthCheck, settings

from contracts.settings import get_settings

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 30
# No 5xx, and answers as the schema declares them. Left out: positive_data_acceptance, since the API
# rightly answers 4xx to schema-valid requests naming a model that does not exist, a job id that is
# unknown or inputs that do not match the model's signature.
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance]


@pytest.fixture
def api_schema(redis_server, redis_conn, model_root, tmp_path, monkeypatch):
    from app.main import create_app

    monkeypatch.setenv("JACOBIAN_REDIS_URL", redis_server.url)
    monkeypatch.setenv("JACOBIAN_RESULTS_URL", str(tmp_path / "results"))
    monkeypatch.setenv("JACOBIAN_MODEL_ROOTS", str(model_root))
    monkeypatch.setenv("JACOBIAN_QUEUE_NAME", "jacobian-schemathesis")  # no worker: jobs stay queued
    get_settings.cache_clear()
    yield schemathesis.openapi.from_asgi("/openapi.json", create_app())
    get_settings.cache_clear()


def test_api_conforms_to_its_schema(api_schema):
    """Every operation: MAX_EXAMPLES generated cases, each answer checked by all of schemathesis' checks.

    (Operations are looped over here rather than through schemathesis' pytest plugin, which does
    not support pytest 9 yet.)"""
    from hypothesis import given

    failures: dict[str, str] = {}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            case.call_and_validate(checks=CHECKS)

        try:
            check()
        except (Exception, BaseExceptionGroup) as err:  # noqa: BLE001 - collect every operation's failure, then report
            failures[operation.label] = f"{type(err).__name__}: {err}"[:3000]
    assert not failures, "\n\n".join(f"{label}:\n{msg}" for label, msg in failures.items())
