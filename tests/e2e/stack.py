"""A live stack for the client, CLI and browser tests: ``jacobian serve`` (one or more) and
``jacobian worker`` as subprocesses on the session's redis-server, each API with its own queue or
sharing one. Reuses the subprocess helpers of ``test_http_cycle`` (``Proc``, ``base_env``, ...).
"""

from __future__ import annotations

import math
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import free_port
from tests.e2e.test_http_cycle import REPO, Proc, base_env, jacobian_exe, print_logs

__all__ = ["Api", "Worker", "Stack", "as_rows", "print_logs"]


class Api:
    """One ``jacobian serve`` on a free port."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.proc = Proc(name, jacobian_exe() + ["serve", "--host", "127.0.0.1", "--port", str(self.port)], env,
                         log_dir / f"{name}.log")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        with httpx.Client(base_url=self.url, timeout=10.0) as client:
            while time.monotonic() < deadline and self.proc.proc.poll() is None:
                try:
                    r = client.get("/readyz")
                    if r.status_code == 200:
                        return
                    last = f"{r.status_code} {r.text[:300]}"
                except httpx.TransportError as err:
                    last = repr(err)
                time.sleep(0.1)
        pytest.fail(f"API not ready at {self.url}/readyz: {last}\n{self.proc.report()}")


class Worker:
    """One ``jacobian worker`` on a queue."""

    def __init__(self, env: dict[str, str], log_dir: Path, name: str = "worker") -> None:
        self.proc = Proc(name, jacobian_exe() + ["worker"], env, log_dir / f"{name}.log")


class Stack:
    """APIs and workers on one redis-server; ``api(...)`` adds an API, ``start_worker()`` a worker.

    Results go to a local folder unless an API is given ``results_url`` (e.g. ``s3://...``); the
    AWS_* variables in ``aws`` reach every process.
    """

    def __init__(self, redis_url: str, models_root: Path, workdir: Path, *, aws: dict[str, str] | None = None) -> None:
        self.redis_url, self.models_root, self.workdir = redis_url, models_root, workdir
        self.aws = dict(aws or {})
        self.results_url = str(workdir / "results")
        Path(self.results_url).mkdir(parents=True, exist_ok=True)
        self.queue_name = f"jacobian-e2e-{uuid.uuid4().hex[:8]}"
        self.apis: list[Api] = []
        self.workers: list[Worker] = []

    def env(self, *, queue_name: str | None = None, results_url: str | None = None) -> dict[str, str]:
        return base_env(JACOBIAN_REDIS_URL=self.redis_url, JACOBIAN_RESULTS_URL=results_url or self.results_url,
                        JACOBIAN_MODEL_ROOTS=str(self.models_root), JACOBIAN_QUEUE_NAME=queue_name or self.queue_name,
                        JACOBIAN_LOG_FORMAT="text", **self.aws)

    def api(self, name: str = "api", *, queue_name: str | None = None, results_url: str | None = None) -> Api:
        api = Api(name, self.env(queue_name=queue_name, results_url=results_url), self.workdir)
        self.apis.append(api)
        api.wait_ready()
        return api

    def start_worker(self, name: str = "worker") -> Worker:
        worker = Worker(self.env(), self.workdir, name)
        self.workers.append(worker)
        return worker

    def procs(self) -> list[Proc]:
        return [a.proc for a in self.apis] + [w.proc for w in self.workers]

    def logs(self) -> str:
        return "\n".join(p.report() for p in self.procs())

    def check_alive(self) -> None:
        for proc in self.procs():
            if proc.proc.poll() is not None:
                pytest.fail(f"{proc.name} exited with {proc.proc.returncode}\n{self.logs()}")

    def cli(self, *args: str, api: Api | None = None, timeout_s: float = 180.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``jacobian ARGS`` with ``JACOBIAN_API_URL`` of ``api`` (default the first); output as text, as
        written (stderr is a pipe here: progress comes as plain lines, not a bar redrawn with ``\\r``)."""
        target = api or self.apis[0]
        run_env = {**self.env(), "JACOBIAN_API_URL": target.url, **(env or {})}
        done = subprocess.run(jacobian_exe() + list(args), env=run_env, cwd=REPO, capture_output=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
        return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                           done.stderr.decode(errors="replace"))

    def stop(self) -> None:
        for proc in reversed(self.procs()):
            proc.stop()


def as_rows(array: np.ndarray, iter_start: int, iter_stop: int) -> np.ndarray:
    """``array`` as ``(rows,) + row_shape``: the iterated axes first, flattened in C order."""
    iterated = list(range(iter_start, iter_stop))
    rest = [a for a in range(array.ndim) if a not in iterated]
    moved = np.transpose(array, iterated + rest)
    return moved.reshape((math.prod(array.shape[iter_start:iter_stop]),) + tuple(array.shape[a] for a in rest))


def result_rows(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The stored result (plain zarr, no project code) and the same as rows."""
    import zarr

    options = {"storage_options": storage_options} if storage_options else {}
    z = zarr.open_array(uri + "/jacobian", mode="r", **options)
    full = z[...]
    attrs = dict(z.attrs)
    return full, as_rows(full, int(attrs["iter_start"]), int(attrs["iter_stop"]))


def aws_env(endpoint: str) -> dict[str, str]:
    """The AWS_* variables of the moto server (what ``s3_env`` sets)."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint}
