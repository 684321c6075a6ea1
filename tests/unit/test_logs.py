"""JSON log lines and the job id carried by ``contracts.logs`` (no services)."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from contracts.logs import (
    JobContextFilter,
    JsonFormatter,
    configure_logging,
    current_job_id,
    job_context,
    start_thread_in_context,
)


@pytest.fixture
def capture():
    """A logger whose lines go through the project's formatter and filter into a buffer."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter(static={"service": "test"}))
    handler.addFilter(JobContextFilter())
    logger = logging.getLogger("tests.unit.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    def lines() -> list[dict]:
        return [json.loads(line) for line in buf.getvalue().splitlines()]

    yield logger, lines
    logger.removeHandler(handler)


def test_line_is_one_json_object_with_base_fields(capture):
    logger, lines = capture
    logger.info("hello %s", "world")
    (line,) = lines()
    assert line["message"] == "hello world" and line["level"] == "info"
    assert line["logger"] == "tests.unit.test_logs" and line["service"] == "test"
    assert line["ts"].endswith("Z") and "T" in line["ts"]
    assert "job_id" not in line  # outside a job


def test_job_id_on_every_line_inside_the_context_and_restored_after(capture):
    logger, lines = capture
    with job_context("job-a"):
        assert current_job_id() == "job-a"
        logger.info("one")
        with job_context("job-b"):
            logging.getLogger("tests.unit.test_logs.child").warning("nested")  # a child logger too
        logger.info("two")
    logger.info("after")
    assert current_job_id() is None
    got = [(line["message"], line.get("job_id")) for line in lines()]
    assert got == [("one", "job-a"), ("nested", "job-b"), ("two", "job-a"), ("after", None)]


def test_extra_fields_become_json_fields_and_explicit_job_id_wins(capture):
    import numpy as np

    logger, lines = capture
    with job_context("ctx"):
        logger.info("plan chosen", extra={"event": "plan_chosen", "chunk_rows": np.int64(8),
                                          "free_bytes": 1 << 30, "strategy": "vmap+xla", "shape": (3, 4)})
        logger.info("other job", extra={"job_id": "explicit"})
    first, second = lines()
    assert first["event"] == "plan_chosen" and first["chunk_rows"] == 8 and first["free_bytes"] == 1 << 30
    assert first["strategy"] == "vmap+xla" and first["shape"] == [3, 4] and first["job_id"] == "ctx"
    assert second["job_id"] == "explicit"


def test_exceptions_are_one_line_with_the_traceback(capture):
    logger, lines = capture
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    (line,) = lines()
    assert line["level"] == "error" and "ValueError: boom" in line["exc_info"] and "Traceback" in line["exc_info"]


def test_ansi_colours_from_rq_are_stripped(capture):
    logger, lines = capture
    logger.info("Worker w: %s (%s)", "\x1b[32mJob OK\x1b[39;49;00m", "abc")
    assert lines()[0]["message"] == "Worker w: Job OK (abc)"


def test_threads_started_in_context_and_writer_threads_carry_the_job_id(capture):
    logger, lines = capture
    with job_context("job-t"):
        start_thread_in_context(logger.info, "from heartbeat", name="beat").join()
        plain = threading.Thread(target=logger.info, args=("plain thread",))
        plain.start()
        plain.join()
    writer = threading.Thread(target=logger.info, args=("block written",), name="result-writer-job-w")
    writer.start()
    writer.join()
    got = {line["message"]: line.get("job_id") for line in lines()}
    assert got == {"from heartbeat": "job-t", "plain thread": None, "block written": "job-w"}


def test_uvicorn_access_lines_get_request_fields(capture):
    _, lines = capture
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", "/v1/jobs/abc", "1.1", 200), None)
    line = json.loads(JsonFormatter().format(record))
    assert line["method"] == "GET" and line["path"] == "/v1/jobs/abc" and line["status_code"] == 200
    assert line["message"] == '127.0.0.1:5000 - "GET /v1/jobs/abc HTTP/1.1" 200'


def test_configure_logging_is_idempotent_and_replaces_basic_config(monkeypatch):
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    buf = io.StringIO()
    try:
        logging.basicConfig(level=logging.INFO, force=True)  # what `jacobian worker` did before
        configure_logging("worker", fmt="json", stream=buf)
        configure_logging("worker", fmt="json", stream=buf)
        ours = [h for h in root.handlers if getattr(h, "_jacobian_handler", False)]
        assert len(ours) == 1 and not [h for h in root.handlers if type(h) is logging.StreamHandler and h not in ours]
        with job_context("j1"):
            logging.getLogger("worker.tasks").info("job %s started", "j1")
        (line,) = [json.loads(s) for s in buf.getvalue().splitlines()]
        assert line == {**line, "job_id": "j1", "service": "worker", "message": "job j1 started"}

        assert configure_logging("worker", fmt="none") is None  # leaves logging alone
        text = io.StringIO()
        configure_logging(fmt="text", stream=text)
        with job_context("j2"):
            logging.getLogger("x").warning("plain")
        assert text.getvalue().rstrip().endswith("x: plain [job j2]")
        with pytest.raises(ValueError, match="JACOBIAN_LOG_FORMAT"):
            configure_logging(fmt="xml")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved_handlers:
            root.addHandler(h)
        root.setLevel(saved_level)
