"""A real webhook receiver for the tests: ``http.server`` on a thread on 127.0.0.1, recording every POST,
verifying signatures with a reference implementation of Standard Webhooks written here (not the service's
code), and answering as told: the first ``fail_first`` attempts of each delivery id fail, or every one does
while ``down`` is set."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOLERANCE_S = 300  # the Standard Webhooks libraries' default: older timestamps are replays


def verify(secret: str, headers: dict[str, str], body: bytes, *, now: float | None = None) -> bool:
    """Standard Webhooks verification: the timestamp within 5 minutes, and one ``v1,`` signature equal to the
    base64 HMAC-SHA256 of ``{webhook-id}.{webhook-timestamp}.{body}`` keyed by the base64 after ``whsec_``."""
    msg_id, timestamp = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
    if not msg_id or not timestamp.isdigit() or abs((now or time.time()) - int(timestamp)) > TOLERANCE_S:
        return False
    key = base64.b64decode(secret.removeprefix("whsec_"))
    expected = base64.b64encode(hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest())
    given = [s.partition(",")[2].encode() for s in headers.get("webhook-signature", "").split() if s.startswith("v1,")]
    return any(hmac.compare_digest(expected, g) for g in given)


@dataclass
class Call:
    """One POST the receiver got, and what it answered."""

    headers: dict[str, str]
    body: bytes
    status: int
    at: float

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def type(self) -> str:
        return str(self.json["type"])


@dataclass
class Receiver:
    """The receiver's script and record; ``url`` is its endpoint."""

    fail_first: int = 0
    down: bool = False
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/jacobian?tenant=t1"

    def answer(self, headers: dict[str, str], body: bytes) -> int:
        with self.lock:
            seen = sum(1 for c in self.calls if c.headers.get("webhook-id") == headers.get("webhook-id"))
            status = 503 if self.down else (500 if seen < self.fail_first else 204)
            self.calls.append(Call(headers, body, status, time.time()))
        return status

    def accepted(self) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.status == 204]

    def snapshot(self) -> list[Call]:
        with self.lock:
            return list(self.calls)


def start(receiver: Receiver) -> ThreadingHTTPServer:
    """Serve ``receiver`` on a free port of 127.0.0.1 on a daemon thread; ``shutdown()`` it when done."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k.lower(): v for k, v in self.headers.items()}
            headers[":path"] = self.path
            self.send_response(receiver.answer(headers, body))
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
