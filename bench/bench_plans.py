"""Plans that persist, through the service: what a first job costs on a worker that never saw the model.

One redis-server and one ``jacobian serve``; workers are ``jacobian worker`` processes, each with its
own ``JACOBIAN_CACHE_DIR`` (as on its own machine), sharing plans through Redis. Job time is what a
client sees: POST to ``succeeded`` seen by polling every 10 ms.

Part 1, MobileNetV3Small (weights=None), 1000 logits w.r.t. one 224x224x3 image:
  A1  worker A, first job ever on this request (no plan anywhere)
  A2  worker A, the same job again (warm: model, plan and compiled function in the process)
  B1  worker B, started after A stopped, first job of its life on this request (plan from Redis)
  Goal (issue 10): B1 / A2 <= 3 (it was 10x before plans were shared).
Part 2, a small MLP (8-64-64-4), ``batch_jacobian`` on a warm worker: one batch size repeated, then
  new batch sizes in the same power-of-two bucket (33..64). Goal: median(new) / median(repeated) <= 3
  (it was 40x: a new trial and compile per shape).

Run: .venv/bin/python -m bench.bench_plans [--skip-mobilenet] [--repeats 10] [--out bench/results]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import emit, machine
from tests.procs import Proc, base_env, free_port, jacobian_exe, wait_for

POLL_S = 0.01


class Stack:
    """redis-server and the API; workers come and go (``start_worker``/``stop_worker``)."""

    def __init__(self, work: Path, model_root: Path) -> None:
        import httpx

        self.work = work
        redis_port, api_port = free_port(), free_port()
        self.env = base_env(JACOBIAN_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
                            JACOBIAN_RESULTS_URL=str(work / "results"), JACOBIAN_MODEL_ROOTS=str(model_root),
                            JACOBIAN_LOG_FORMAT="text")
        self.procs: dict[str, Proc] = {}
        self.procs["redis"] = Proc("redis", [shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
                                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                             "--dir", str(work)], self.env, work / "redis.log")
        self.procs["api"] = Proc("api", [*jacobian_exe(), "serve", "--port", str(api_port)], self.env, work / "api.log")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=120.0)
        self._wait(lambda: self.client.get("/readyz").status_code == 200, "API")

    def _wait(self, check: Any, what: str, timeout_s: float = 60) -> None:
        wait_for(check, timeout_s, what, poll_s=0.05,
                 report=lambda: "\n".join(p.report() for p in self.procs.values()))

    def start_worker(self, name: str) -> None:
        import redis

        env = {**self.env, "JACOBIAN_CACHE_DIR": str(self.work / f"cache-{name}")}
        self.procs[name] = Proc(name, [*jacobian_exe(), "worker"], env, self.work / f"{name}.log")
        conn = redis.Redis.from_url(self.env["JACOBIAN_REDIS_URL"])
        self._wait(lambda: any(name in k.decode() or True for k in conn.smembers("rq:workers")) and
                   len(conn.smembers("rq:workers")) >= 1, f"worker {name}")
        time.sleep(1.0)  # registered and idle in its blocking dequeue

    def worker_peak_rss_mib(self, name: str) -> int:
        """The worker process's peak resident memory so far (``VmHWM``), MiB."""
        status = Path(f"/proc/{self.procs[name].proc.pid}/status").read_text()
        return round(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024)

    def stop_worker(self, name: str) -> None:
        self.procs.pop(name).stop()

    def job(self, npz: dict[str, np.ndarray], params: dict[str, str]) -> dict[str, Any]:
        buf = io.BytesIO()
        np.savez(buf, **npz)
        t0 = time.perf_counter()
        r = self.client.post("/v1/jobs", content=buf.getvalue(), params=params,
                             headers={"Content-Type": "application/x-npz"})
        if r.status_code != 202:
            raise RuntimeError(f"POST: {r.status_code} {r.text[:1000]}")
        job_id = r.json()["id"]
        while True:
            rec = self.client.get(f"/v1/jobs/{job_id}").json()
            if rec["status"] in ("succeeded", "failed", "canceled"):
                break
            time.sleep(POLL_S)
        seconds = time.perf_counter() - t0
        if rec["status"] != "succeeded":
            raise RuntimeError(f"job {job_id}: {rec['status']} {rec.get('error')}")
        return {"seconds": round(seconds, 3), "plan": rec["plan"], "id": job_id}

    def close(self) -> None:
        self.client.close()
        for p in reversed(list(self.procs.values())):
            p.stop()


def brief(plan: dict[str, Any]) -> str:
    return f"{plan.get('strategy')} x{plan.get('chunk_rows')} ({plan.get('source')})"


def mobilenet_part(stack: Stack) -> list[dict[str, Any]]:
    x = np.random.default_rng(0).standard_normal((1, 224, 224, 3)).astype(np.float32)
    params = {"model_path": "mnv3", "of": "logits"}
    stack.start_worker("A")
    a1 = stack.job({"image": x}, params)
    a2 = stack.job({"image": x}, params)
    stack.stop_worker("A")
    stack.start_worker("B")
    b1 = stack.job({"image": x}, params)
    b2 = stack.job({"image": x}, params)
    stack.stop_worker("B")
    rows = [{"job": "A1: first job ever (no plan)", "s": a1["seconds"], "plan": brief(a1["plan"])},
            {"job": "A2: warm repeat on A", "s": a2["seconds"], "plan": brief(a2["plan"])},
            {"job": "B1: first job of a new worker (plan from Redis)", "s": b1["seconds"], "plan": brief(b1["plan"])},
            {"job": "B2: warm repeat on B", "s": b2["seconds"], "plan": brief(b2["plan"])},
            {"ratio": "B1 / A2 (new worker, planned request / warm repeat)",
             "value": round(b1["seconds"] / a2["seconds"], 2), "goal": "<= 3"},
            {"ratio": "A1 / A2 (first job ever / warm repeat)", "value": round(a1["seconds"] / a2["seconds"], 2)}]
    for r in rows:
        print(r, flush=True)
    return rows


def batch_part(stack: Stack, repeats: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    params = {"model_path": "small", "kind": "batch_jacobian"}
    stack.start_worker("C")
    stack.job({"x": rng.standard_normal((40, 8)).astype(np.float32)}, params)  # the first job of this request
    repeated = [stack.job({"x": rng.standard_normal((40, 8)).astype(np.float32)}, params) for _ in range(repeats)]
    sizes = [33, 37, 44, 48, 51, 56, 59, 61, 63, 64][:max(repeats, 3)]
    new = [stack.job({"x": rng.standard_normal((b, 8)).astype(np.float32)}, params) for b in sizes]
    stack.stop_worker("C")
    t_rep = statistics.median(r["seconds"] for r in repeated)
    t_new = statistics.median(r["seconds"] for r in new)
    rows = [{"job": f"repeated batch 40 (median of {len(repeated)})", "s": round(t_rep, 4),
             "plan": brief(repeated[-1]["plan"])},
            {"job": f"new batch sizes {sizes} (median)", "s": round(t_new, 4), "max_s": max(r["seconds"] for r in new),
             "plans": sorted({brief(r["plan"]) for r in new})},
            {"ratio": "new batch size in the bucket / repeated job", "value": round(t_new / t_rep, 2), "goal": "<= 3"}]
    for r in rows:
        print(r, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-mobilenet", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tests import models

    work = Path(tempfile.mkdtemp(prefix="bench-plans-"))
    root = work / "models"
    models.mlp(root / "small", sizes=(8, 64, 64, 4))
    if not args.skip_mobilenet:
        models.mobilenet_v3_small(root / "mnv3")
    stack = Stack(work, root)
    rows: list[dict[str, Any]] = []
    try:
        if not args.skip_mobilenet:
            rows += mobilenet_part(stack)
        rows += batch_part(stack, args.repeats)
    except BaseException:
        print("\n".join(p.report() for p in stack.procs.values()), file=sys.stderr)
        raise
    finally:
        stack.close()
    print(machine())
    emit("plans_service_cold_start", rows, args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
