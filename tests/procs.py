"""Subprocess helpers shared by the end-to-end tests and the benchmarks (no pytest import): free
ports, the ``jacobian`` executable, a clean environment and a logged subprocess."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 6000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jacobian_exe() -> list[str]:
    """The ``jacobian`` console script beside this Python, else ``python -m jacobian.cli``."""
    exe = shutil.which("jacobian", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "jacobian.cli"]


def base_env(**extra: str) -> dict[str, str]:
    """This process's environment without any JACOBIAN_* or AWS_* variable, plus ``extra``.

    ``JACOBIAN_CACHE_DIR`` is kept (tests/conftest.py points it at a folder of the test session), so
    that no test process reads or writes plans in the user's ``~/.cache/jacobian``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JACOBIAN_", "AWS_"))}
    if os.environ.get("JACOBIAN_CACHE_DIR"):
        env["JACOBIAN_CACHE_DIR"] = os.environ["JACOBIAN_CACHE_DIR"]
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def stop_all(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """SIGTERM to every process still running, then wait for each; SIGKILL after ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


class Proc:
    """A subprocess whose stdout and stderr go to a log file; ``stop()`` is SIGTERM, then SIGKILL."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as err:
            return f"(no log: {err})"
        return text[-chars:]

    def report(self) -> str:
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return f"----- {self.name} ({state}), log {self.log_path} -----\n{self.tail()}"

    def stop(self) -> None:
        stop_all([self.proc], timeout_s=15)
        self._log.close()


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, *, poll_s: float = 0.1,
             report: Callable[[], str] | None = None) -> None:
    """Until ``check()`` is true (an exception counts as not yet); else ``TimeoutError`` naming ``what``
    (with ``report()``, e.g. the processes' log tails, appended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not ready after {timeout_s:g} s" + (f"\n{report()}" if report else ""))
