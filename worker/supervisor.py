"""A worker's parent: runs it as a child, restarts it when it dies, and notes in Redis how it died.

A worker runs jobs in its own process (TensorFlow is not fork-safe), so when the OOM killer's SIGKILL or a
SIGSEGV ends it, only its parent can read how (``waitpid``). ``supervise`` is that parent: it keeps
``"SIGKILL (exit -9)"`` under ``jacobian:worker-exit:<host>.<pid>`` for an hour, where the worker that finds
the dead one's abandoned job reads it (``exit_cause_of``). No TensorFlow here.

Run: ``jacobian worker --supervise`` or ``python -m worker.supervisor COMMAND...``.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

EXIT_KEY_TEMPLATE = "jacobian:worker-exit:{host_pid}"
EXIT_TTL_S = 3600
_NAME_SUFFIX = re.compile(r"\.(gpu[^.]*|r\d+)$")


def describe_exit(returncode: int) -> str:
    """``-9`` -> ``"SIGKILL (exit -9)"``; ``3`` -> ``"exit status 3"``."""
    if returncode < 0:
        try:
            return f"{signal.Signals(-returncode).name} (exit {returncode})"
        except ValueError:
            return f"signal {-returncode} (exit {returncode})"
    return f"exit status {returncode}"


def host_pid(worker_name: str) -> str:
    """``<host>.<pid>`` of a worker name (``worker.main.worker_name``: ``.gpuN`` and ``.rN`` suffixes dropped)."""
    name = worker_name
    while True:
        shorter = _NAME_SUFFIX.sub("", name)
        if shorter == name:
            return name
        name = shorter


def exit_cause_of(connection: Any, worker_name: str | None) -> str | None:
    """How the worker ``worker_name`` ended, as its supervisor noted it; None when unknown (no supervisor, or
    not noted yet). Raises ``redis.RedisError``."""
    if not worker_name:
        return None
    raw = connection.get(EXIT_KEY_TEMPLATE.format(host_pid=host_pid(worker_name)))
    return raw.decode() if isinstance(raw, bytes) else raw


def supervise(command: list[str], *, connection: Any, restart_delay_s: float = 1.0) -> int:
    """Run ``command`` (a worker) until it exits by itself with status 0 or this process gets SIGTERM/SIGINT
    (passed on to the child); every other end is noted (``EXIT_KEY_TEMPLATE``) and the child started again
    after ``restart_delay_s``, doubled after each child that lived less than a minute (up to 30 s: a worker
    that cannot start is not restarted in a tight loop). Returns the last child's exit status."""
    stop = threading.Event()
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: Any) -> None:
        stop.set()
        if children and children[-1].poll() is None:
            children[-1].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(command, connection, stop, restart_delay_s, lambda c: children.append(c))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run(command: list[str], connection: Any, stop: threading.Event, restart_delay_s: float,
         started_child: Any) -> int:
    delay_s = restart_delay_s
    while True:
        started = time.monotonic()
        child = subprocess.Popen(command)
        started_child(child)
        returncode = child.wait()
        if stop.is_set() or returncode == 0:
            return returncode
        cause = describe_exit(returncode)
        key = EXIT_KEY_TEMPLATE.format(host_pid=f"{socket.gethostname()}.{child.pid}")
        try:
            connection.set(key, cause, ex=EXIT_TTL_S)
        except Exception as err:  # noqa: BLE001 - a lost note must not stop the restart
            log.warning("supervisor: could not note how worker %s ended (%s): %s", child.pid, cause, err)
        delay_s = restart_delay_s if time.monotonic() - started > 60 else delay_s
        log.warning("supervisor: worker %s ended: %s; starting another in %.1f s", child.pid, cause, delay_s)
        if stop.wait(delay_s):
            return returncode
        delay_s = min(delay_s * 2, 30.0)


def main(argv: list[str] | None = None) -> int:
    from contracts.settings import get_settings
    from worker.main import redis_connection

    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m worker.supervisor COMMAND [ARG...]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return supervise(command, connection=redis_connection(get_settings().redis_url))


if __name__ == "__main__":
    sys.exit(main())
