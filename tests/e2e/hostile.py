"""Helpers of ``test_hostile_requests``: the API process under test, hostile bodies (.npz bombs,
JSON that parses into trouble) and requests as ``httpx.request`` keyword arguments."""

from __future__ import annotations

import base64
import functools
import io
import json
import socket
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.procs import Proc, base_env, free_port, jacobian_exe

MIB = 1 << 20
GIB = 1 << 30
REDIS_DB = 7
JSON = {"Content-Type": "application/json"}
NPZ = {"Content-Type": "application/x-npz"}


# -- the stack ----------------------------------------------------------------------------------------


class Stack:
    """One ``jacobian serve`` on a free port, its results folder, its Redis database and its queue."""

    def __init__(self, redis_url: str, model_root: Path, workdir: Path, *, body_read_timeout_s: float) -> None:
        self.results = workdir / "results"
        self.uploads = self.results / "uploads"
        self.uploads.mkdir(parents=True)
        redis_url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"  # a database of its own: state() sees only it
        self.redis = redis.Redis.from_url(redis_url)
        self.redis.flushdb()
        self.queue = f"jacobian-hostile-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = base_env(JACOBIAN_REDIS_URL=redis_url, JACOBIAN_RESULTS_URL=str(self.results),
                       JACOBIAN_MODEL_ROOTS=str(model_root), JACOBIAN_QUEUE_NAME=self.queue,
                       JACOBIAN_LOG_FORMAT="text", JACOBIAN_BODY_READ_TIMEOUT_S=str(body_read_timeout_s))
        self.log_path = workdir / "api.log"
        self.api = Proc("api", jacobian_exe() + ["serve", "--host", "127.0.0.1", "--port", str(self.port)], env,
                        self.log_path)
        self.http = httpx.Client(base_url=self.url, timeout=60.0, limits=httpx.Limits(max_keepalive_connections=0))

    @property
    def pid(self) -> int:
        return self.api.proc.pid

    def peak_rss_bytes(self) -> int:
        """``VmHWM``: the API process's peak resident memory so far."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc/<pid>/status")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.api.proc.poll() is None:
            try:
                if self.http.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"API not ready at {self.url}\n{self.api.report()}")

    def state(self) -> tuple[Any, ...]:
        """What a request must not change: files under the results, job records, rq jobs, the queue."""
        files = sorted(str(p.relative_to(self.results)) for p in self.results.rglob("*")
                       if p.is_file() and p.name != ".readyz")
        records = {key: self.redis.dump(key) for key in sorted(self.redis.keys("jacobian:*"))}
        return files, records, sorted(self.redis.keys("rq:*")), self.redis.llen(f"rq:queue:{self.queue}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, request: dict[str, Any]) -> httpx.Response:
        """A request given as ``httpx.request`` keyword arguments (``method`` and ``url`` included)."""
        kwargs = dict(request)
        return self.http.request(kwargs.pop("method"), kwargs.pop("url"), **kwargs)


# -- hostile bodies ------------------------------------------------------------------------------------


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


@functools.cache
def bomb(descr: str, shape: tuple[int, ...], zeros_bytes: int, name: str = "x") -> bytes:
    """An .npz whose one member is a header and ``zeros_bytes`` of deflated zeros (1 GiB is about 1 MB)."""
    zeros = bytes(16 * MIB)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
            f.write(npy_header(descr, shape))
            for start in range(0, zeros_bytes, len(zeros)):
                f.write(zeros[:min(len(zeros), zeros_bytes - start)])
    return buf.getvalue()


# The attacks: 1-2 MB bodies that inflate to 1 GiB and 512 MiB, with huge-itemsize dtypes.
VOID_BOMB = ("|V1073741824", (1,), GIB)
UNICODE_BOMB = ("<U134217728", (1,), 512 * MIB)
# Numeric, but far over the element limit as declared (16 Gi float32 elements), 256 MiB of zeros behind.
HUGE_SHAPE_BOMB = ("<f4", (1 << 34,), 256 * MIB)
# Within every limit (56 Mi elements, 224 MiB), but not the model's shape: refused from the header alone.
WRONG_SHAPE_BOMB = ("<f4", (8 << 20, 7), 224 * MIB)
# The model's shape within the limits, but a Jacobian of (8 Mi x 4) x (8 Mi x 8) float32: over the result limit.
HUGE_RESULT_BOMB = ("<f4", (8 << 20, 8), 256 * MIB)
BOMBS = {"void": VOID_BOMB, "unicode": UNICODE_BOMB, "huge shape": HUGE_SHAPE_BOMB, "wrong shape": WRONG_SHAPE_BOMB,
         "huge result": HUGE_RESULT_BOMB}


def npz_post(body: bytes, **params: str) -> dict[str, Any]:
    return {"method": "POST", "url": "/v1/jobs", "content": body, "params": {"model_path": "mlp", **params},
            "headers": NPZ}


def json_post(body: dict[str, Any] | bytes) -> dict[str, Any]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return {"method": "POST", "url": "/v1/jobs", "content": content, "headers": JSON}


def get(url: str, **params: str) -> dict[str, Any]:
    return {"method": "GET", "url": url, "params": params}


def post(url: str) -> dict[str, Any]:
    return {"method": "POST", "url": url}


def mlp(**extra: Any) -> dict[str, Any]:
    return {"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": [0.5] * 16}}, **extra}


def token(raw: dict[str, Any]) -> str:
    """A page token built by hand (the server's are base64 of JSON)."""
    return base64.urlsafe_b64encode(json.dumps(raw).encode()).decode().rstrip("=")


def json_data(item: bytes, item_bytes: int, rows: int | None = None) -> bytes:
    """A JSON body whose data for x is ``item`` repeated ``rows`` times (default: to just under 4 MiB)."""
    head, tail = b'{"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": [', b"]}}}"
    n = (4 * MIB - len(head) - len(tail)) // item_bytes if rows is None else rows
    return head + item * (n - 1) + item.rstrip(b",") + tail


def deep_data(levels: int) -> bytes:
    return (b'{"model": {"path": "mlp"}, "inputs": {"x": {"shape": [1], "data": ' + b"[" * levels + b"0"
            + b"]" * levels + b"}}}")


def uri_post(s: Stack, name: str) -> dict[str, Any]:
    return json_post({"model": {"path": "mlp"}, "inputs_uri": str(s.uploads / name)})


def many_members(n: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i in range(n):
            zf.writestr(f"a{i}.npy", npy_header("<f4", (0,)))
    return buf.getvalue()



def raw_upload(s: Stack, declared_bytes: int, sent: bytes) -> socket.socket:
    """A POST /v1/jobs that declares ``declared_bytes`` of body and sends only ``sent``; the socket stays open."""
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {declared_bytes}\r\n\r\n".encode() + sent)
    return sock


def requests_counted(s: Stack, status: str) -> float:
    """``jacobian_http_requests_total`` of POST /v1/jobs with this status code, from the API's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(s.http.get("/metrics").text):
        for sample in family.samples:
            if (sample.name == "jacobian_http_requests_total" and sample.labels.get("route") == "/v1/jobs"
                    and sample.labels.get("method") == "POST" and sample.labels.get("status_code") == status):
                return sample.value
    return 0.0
