"""The webhook receiver of the keyed load run (``bench/load_keys.py``), as a process of its own so that it
shares no GIL with the load generator: ``http.server`` on 127.0.0.1, one JSON line per POST appended to a file.

Each line: ``{"id": webhook-id, "at": seconds, "status": answered, "verified": bool, "key": the key named in the
URL's query, "type": "job.<event>", "job": data.id, "job_status": data.status}``. A signature is checked with
``tests.webhook_receiver.verify`` (a reference Standard Webhooks implementation, not the service's code) against
the secret of the key the URL names (``?key=<name>``). The first attempt of a share ``--fail-rate`` of the
delivery ids (chosen by a hash of the id, so every process agrees) is answered 500, to make the notifier retry.

Run: python -m bench.load_receiver --port P --secrets secrets.json --out calls.jsonl [--fail-rate 0.1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.webhook_receiver import verify


def fails_first(delivery_id: str, fail_rate: float) -> bool:
    """Whether the first attempt of ``delivery_id`` is answered 500: a stable draw from the id's hash."""
    draw = int.from_bytes(hashlib.sha256(delivery_id.encode()).digest()[:4], "big") / 2**32
    return draw < fail_rate


class Recorder:
    """Answers and records calls; thread-safe."""

    def __init__(self, out: Path, secrets: dict[str, str], fail_rate: float) -> None:
        self.out = open(out, "a", buffering=1)
        self.secrets, self.fail_rate = secrets, fail_rate
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def answer(self, path: str, headers: dict[str, str], body: bytes) -> int:
        key = (parse_qs(urlsplit(path).query).get("key") or [""])[0]
        secret = self.secrets.get(key)
        verified = secret is not None and verify(secret, headers, body)
        delivery_id = headers.get("webhook-id", "")
        try:
            payload: dict[str, Any] = json.loads(body)
        except ValueError:
            payload = {}
        data = payload.get("data") or {}
        with self.lock:
            first = delivery_id not in self.seen
            self.seen.add(delivery_id)
            status = 500 if (first and fails_first(delivery_id, self.fail_rate)) else (204 if verified else 401)
            self.out.write(json.dumps({"id": delivery_id, "at": time.time(), "status": status, "verified": verified,
                                       "key": key, "type": payload.get("type"), "job": data.get("id"),
                                       "job_status": data.get("status")}) + "\n")
        return status


def serve(port: int, recorder: Recorder) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k.lower(): v for k, v in self.headers.items()}
            self.send_response(recorder.answer(self.path, headers, body))
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer.daemon_threads = True
    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def read_calls(path: Path) -> list[dict[str, Any]]:
    """The calls recorded so far (a line being written is left for the next read)."""
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        try:
            calls.append(json.loads(line))
        except ValueError:
            pass
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--secrets", required=True, help="JSON file: {key name: whsec_...}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail-rate", type=float, default=0.0)
    args = ap.parse_args()
    recorder = Recorder(Path(args.out), json.loads(Path(args.secrets).read_text()), args.fail_rate)
    server = serve(args.port, recorder)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"receiver on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()
    recorder.out.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
