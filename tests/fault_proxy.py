"""A userspace TCP fault proxy: latency and random resets or stalls between a client and a server.

A stand-in for ``tc qdisc ... netem delay 500ms loss 5%`` where the kernel has no ``sch_netem`` (this
machine's does not: ``tc`` answers "Specified qdisc kind is unknown"). It is NOT packet loss: the proxy
sits at the TCP stream level, so it cannot drop single segments and let TCP retransmit them. It models
what loss and latency do to an HTTP client instead:

- ``latency_s``: every chunk read from either side is held ``latency_s / 2`` before it is passed on (one
  thread per direction), so a request and its answer gain ``latency_s`` together;
- ``fault_rate``: each chunk, with this probability, meets a fault: half of the faults reset both
  connections (``SO_LINGER`` 0, the client sees ``ECONNRESET`` mid-request or mid-answer, as after
  retransmissions run out), the other half stall the chunk for ``stall_s`` first (a retransmission
  timeout's worth of silence).

``tests/integration/test_network_faults.py`` also has the ``tc netem`` variant, which runs where the
kernel has netem and skips loudly here. Counters (``connections``, ``chunks``, ``resets``, ``stalls``)
say what was injected. No pytest import.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time


class FaultProxy:
    """Forwards ``listen_host:port`` to ``target``; ``close()`` stops it and every connection."""

    def __init__(self, target: tuple[str, int], *, listen_host: str = "127.0.0.1", latency_s: float = 0.0,
                 fault_rate: float = 0.0, stall_s: float = 1.0, seed: int = 0) -> None:
        self.target, self.latency_s, self.fault_rate, self.stall_s = target, latency_s, fault_rate, stall_s
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.connections = self.chunks = self.resets = self.stalls = 0
        self._socks: set[socket.socket] = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, 0))
        self._listener.listen(128)
        self.host, self.port = self._listener.getsockname()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"connections": self.connections, "chunks": self.chunks, "resets": self.resets,
                    "stalls": self.stalls}

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _close(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _close(client, reset=True)
                continue
            with self._lock:
                self.connections += 1
                self._socks |= {client, upstream}
            pair = _Pair(client, upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(pair, src, dst), daemon=True).start()

    def _fault(self) -> str | None:
        with self._lock:
            self.chunks += 1
            if self._random.random() >= self.fault_rate:
                return None
            kind = "reset" if self._random.random() < 0.5 else "stall"
            if kind == "reset":
                self.resets += 1
            else:
                self.stalls += 1
            return kind

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not pair.done:
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)  # half-close passed on: the other direction may still answer
                    pair.finish_one()
                    return
                fault = self._fault()
                if fault == "reset":
                    pair.reset()
                    return
                time.sleep(self.latency_s / 2 + (self.stall_s if fault == "stall" else 0.0))
                dst.sendall(data)
        except OSError:
            pair.reset()
        finally:
            with self._lock:
                if pair.done:
                    self._socks -= {pair.a, pair.b}


class _Pair:
    """The two sockets of one proxied connection; ``reset()`` closes both with RST, once."""

    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.a, self.b, self.done = a, b, False
        self._lock = threading.Lock()
        self._finished = 0

    def finish_one(self) -> None:
        """One direction ended cleanly; when both have, close both sockets."""
        with self._lock:
            self._finished += 1
            if self._finished < 2 or self.done:
                return
            self.done = True
        _close(self.a)
        _close(self.b)

    def reset(self) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
        _close(self.a, reset=True)
        _close(self.b, reset=True)


def _close(s: socket.socket, *, reset: bool = False) -> None:
    try:
        if reset:  # RST, not FIN, once the last reference goes; SHUT_RD wakes a thread blocked in recv() on it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
