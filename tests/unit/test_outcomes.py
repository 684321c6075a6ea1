"""The one classification of an attempt's errors (``worker.runs.attempt.classify``): pure logic."""

from __future__ import annotations

import pytest
import redis
from rq.timeouts import JobTimeoutException

from worker.engine.errors import InvalidRequest, MemoryBudgetTooSmall, Stopped
from worker.inputs import InvalidInputs, ModelPathNotAllowed
from worker.runs.attempt import JobTimeout, Outcome, classify, is_transient
from worker.storage import ResultWriteError


class Marked(Exception):
    transient = True


@pytest.mark.parametrize(("err", "with_retries", "without_retries"), [
    (Stopped("canceled"), Outcome.STOPPED, Outcome.STOPPED),
    (InvalidRequest("wrt: no input 'z'"), Outcome.INVALID, Outcome.INVALID),
    (MemoryBudgetTooSmall("memory_budget_bytes: too small"), Outcome.INVALID, Outcome.INVALID),
    (InvalidInputs("inputs_uri: missing"), Outcome.INVALID, Outcome.INVALID),
    (ModelPathNotAllowed("model.path: outside"), Outcome.INVALID, Outcome.INVALID),
    (JobTimeoutException("rq's death penalty"), Outcome.TIMEOUT, Outcome.TIMEOUT),
    (JobTimeout("over the timeout"), Outcome.TIMEOUT, Outcome.TIMEOUT),
    (ResultWriteError("storage: 5 attempts"), Outcome.RETRY, Outcome.EXHAUSTED),
    (redis.exceptions.ConnectionError("gone"), Outcome.RETRY, Outcome.EXHAUSTED),
    (ConnectionResetError("reset"), Outcome.RETRY, Outcome.EXHAUSTED),
    (TimeoutError("socket timed out"), Outcome.RETRY, Outcome.EXHAUSTED),
    (Marked("marked transient"), Outcome.RETRY, Outcome.EXHAUSTED),
    (KeyError("a bug"), Outcome.BUG, Outcome.BUG),
    (ZeroDivisionError(), Outcome.BUG, Outcome.BUG),
])
def test_every_error_has_one_outcome(err, with_retries, without_retries):
    assert classify(err, retries_left=True) is with_retries
    assert classify(err, retries_left=False) is without_retries


def test_job_timeout_is_not_transient():
    """More time is not a retry: ``JobTimeout`` is no ``TimeoutError`` (which connection troubles are)."""
    assert not isinstance(JobTimeout("x"), TimeoutError)
    assert not is_transient(JobTimeout("x"))
    assert is_transient(TimeoutError("connection"))


def test_a_transient_engine_error_is_retried():
    err = InvalidRequest("flaky")
    err.transient = True  # type: ignore[misc]
    assert classify(err, retries_left=True) is Outcome.RETRY


def _attempt(timeout_s=None, rq_timeout=None, job_timeout_s=600):
    from types import SimpleNamespace

    from contracts.jobspec import ModelRef, QueuedJob
    from contracts.settings import Settings
    from worker.runs.attempt import Attempt

    job = QueuedJob(id="j", model=ModelRef(path="/m"), inputs_uri="/r/j/inputs.npz", results_url="/r",
                    timeout_s=timeout_s)
    rq_job = None if rq_timeout is None else SimpleNamespace(timeout=rq_timeout, retries_left=None)
    return Attempt(job, store=None, settings=Settings(job_timeout_s=job_timeout_s), rq_job=rq_job)


@pytest.mark.parametrize("timeout_s,rq_timeout,limit,source", [
    (5, 65, 5, "the request's timeout_s"),            # the request's limit; rq's backstop lies 60 s later
    (None, 660, 600, "JACOBIAN_JOB_TIMEOUT_S"),      # the default (rq's backstop: default + 60 s)
    (None, 2, 2, "JACOBIAN_JOB_TIMEOUT_S"),          # queued with a shorter rq timeout than the default
    (None, None, 600, "JACOBIAN_JOB_TIMEOUT_S"),
])
def test_the_limit_is_the_requests_timeout_s_else_the_default(timeout_s, rq_timeout, limit, source):
    attempt = _attempt(timeout_s, rq_timeout)
    assert attempt.limit_s == limit
    attempt.check_time()  # just started: within the limit
    attempt.started_s -= limit + 0.5
    with pytest.raises(JobTimeout) as caught:
        attempt.check_time()
    message = str(caught.value)
    assert message.startswith("timeout_s: the job ran ") and f"its limit of {limit} s" in message
    assert source in message and "JACOBIAN_MAX_JOB_TIMEOUT_S" in message


def test_a_supervisors_note_names_the_signal_in_the_death():
    from worker.main import death_cause
    from worker.supervisor import describe_exit, host_pid

    assert describe_exit(-9) == "SIGKILL (exit -9)" and describe_exit(-11) == "SIGSEGV (exit -11)"
    assert describe_exit(3) == "exit status 3"
    assert host_pid("vm.example.org.4242.gpu0.r2") == "vm.example.org.4242" == host_pid("vm.example.org.4242")
    assert death_cause("vm.42", "SIGKILL (exit -9)") == "worker vm.42 killed: SIGKILL (exit -9)"
    assert "signal unknown" in death_cause("vm.42", None)


def test_the_supervisor_notes_a_killed_child_restarts_it_and_stops_when_it_exits_cleanly(tmp_path):
    """A real child process: killed by SIGKILL at its first run (noted under its host.pid), exits 0 at its second."""
    import socket
    import sys

    from worker.supervisor import EXIT_KEY_TEMPLATE, supervise

    class Notes(dict):
        def set(self, key, value, ex=None):  # noqa: ANN001 - the one Redis call supervise makes
            self[key] = (value, ex)

    marker = tmp_path / "ran-once"
    script = (f"import os, pathlib, signal; m = pathlib.Path({str(marker)!r}); print(os.getpid(), flush=True)\n"
              "if not m.exists():\n    m.write_text(str(os.getpid())); os.kill(os.getpid(), signal.SIGKILL)\n")
    import signal

    notes, before = Notes(), signal.getsignal(signal.SIGINT)
    assert supervise([sys.executable, "-c", script], connection=notes, restart_delay_s=0.01) == 0
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handlers are put back
    first_pid = marker.read_text()
    assert notes == {EXIT_KEY_TEMPLATE.format(host_pid=f"{socket.gethostname()}.{first_pid}"):
                     ("SIGKILL (exit -9)", 3600)}
