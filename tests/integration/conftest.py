"""The API over a real redis-server (``client``), with or without a worker in this process (``worker_client``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def results(tmp_path) -> Path:
    return tmp_path / "results"


@pytest.fixture
def env(redis_server, redis_conn, model_root, results, monkeypatch):
    """JACOBIAN_* settings for the API: this session's redis-server, ``results``, ``model_root``, no API keys."""
    from contracts.settings import get_settings

    monkeypatch.setenv("JACOBIAN_REDIS_URL", redis_server.url)
    monkeypatch.setenv("JACOBIAN_RESULTS_URL", str(results))
    monkeypatch.setenv("JACOBIAN_MODEL_ROOTS", str(model_root))
    monkeypatch.delenv("JACOBIAN_API_KEYS", raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def client(env):
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app()) as c:
        yield c


@pytest.fixture
def worker_client(worker_env):
    """The API on the settings of a worker run in this process (``worker_env``, blocks of 1 MiB): jobs posted
    through it are computed by ``tests.conftest.finished_job``."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    worker_env(1 << 20)
    with TestClient(create_app()) as c:
        yield c

