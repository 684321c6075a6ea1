"""Overhead of the whole service path (HTTP -> Redis -> worker -> storage -> status) against
``jacobian compute`` on the same job, with the model loaded and the strategy trial cached in both.

The job: the per-example (batch) Jacobian of a Keras MLP 256-2048-2048-2048-256 (``tests/models.mlp``)
with a batch sized so that the compute takes about ``--target-s`` seconds here (calibrated at start,
or ``--batch N``).

(a) compute: the calls ``jacobian compute`` makes (load_inputs, get_model, build_problem,
    compute_to_storage to local disk), in this process, run once to warm, then timed.
(b) service: redis-server, ``jacobian serve`` and one ``jacobian worker`` as subprocesses, results on
    local disk; the job is POSTed once to warm the worker (model cache, trial, compiled functions),
    then timed from the POST to the status ``succeeded`` seen by polling every 0.1 s.
After both warm-ups, (a) and (b) alternate ``--runs`` times, so that each pair meets the same load on a
shared machine; the ratio is median(service) / median(compute), the paired ratios are reported too.
Each path picks its strategy and chunk by its own timed trial; ``--chunk-rows N`` forces the chunk.

Goal: service / compute <= 1.15.
Run: .venv/bin/python -m bench.bench_service [--target-s 10] [--runs 3] [--body npz|json] [--out bench/results]
"""

from __future__ import annotations

import argparse
import calendar
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import emit, machine
from tests.procs import Proc, free_port, jacobian_exe, wait_for

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]
SIZES = (256, 2048, 2048, 2048, 256)
KIND = "batch_jacobian"
POLL_S = 0.1
CALIBRATION_BATCH = 32


def _memory_plans():
    from worker.engine import MemoryPlanCache

    return MemoryPlanCache()


PLANS = _memory_plans()  # (a)'s plans, as jacobian compute keeps them in its cache folder


# -- (a) the CLI's calls in this process ------------------------------------------------------------


def compute_like_cli(model_path: str, input_npz: str, out: str,
                     chunk_rows: int | None = None) -> tuple[float, dict[str, Any]]:
    """What ``cmd_compute`` does, minus argument parsing and printing; returns (seconds, manifest)."""
    from contracts import storage
    from contracts.settings import get_settings
    from worker.engine.planning import prepare
    from worker.inputs import load_inputs
    from worker.model_cache import get_model
    from worker.pipeline import compute_to_storage

    t0 = time.perf_counter()
    inputs = load_inputs(input_npz, settings=get_settings(), field="--input")
    model = get_model(model_path, "serving_default")
    problem, plan = prepare(model, inputs, cache=PLANS, device="CPU:0", kind=KIND)
    manifest = compute_to_storage(problem, results_url=storage.normalize(out), job_id=uuid.uuid4().hex,
                                  memory_budget_bytes=get_settings().memory_budget_bytes, chunk_rows=chunk_rows,
                                  on_plan=lambda plan: None, on_progress=lambda progress: None, plan=plan,
                                  on_learned=PLANS.put,
                                  manifest_fields={"model": {"path": model_path, "signature": "serving_default"}})
    return time.perf_counter() - t0, manifest


def calibrate_batch(model_path: str, target_s: float) -> tuple[int, float]:
    """A batch size whose compute takes about ``target_s``, from a timed run at a small batch."""
    from worker.engine import build_problem, run_problem
    from worker.model_cache import get_model

    model = get_model(model_path, "serving_default")
    x = np.random.default_rng(1).standard_normal((CALIBRATION_BATCH, SIZES[0])).astype(np.float32)
    run_problem(build_problem(model, {"x": x}, kind=KIND))  # trial and compile
    t0 = time.perf_counter()
    run_problem(build_problem(model, {"x": x}, kind=KIND))
    dt = time.perf_counter() - t0
    batch = int(round(CALIBRATION_BATCH * target_s / dt / 8)) * 8
    return max(8, batch), dt


# -- (b) the service --------------------------------------------------------------------------------


def _epoch(iso: str | None) -> float | None:
    """``2026-01-02T03:04:05.678Z`` (UTC) -> seconds since the epoch."""
    if not iso:
        return None
    head, _, frac = iso.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S")) + (int(frac) / 1000 if frac else 0.0)


class Service:
    """redis-server + ``jacobian serve`` + one ``jacobian worker``, results on local disk."""

    def __init__(self, work: Path, models_root: Path) -> None:
        import httpx

        cli = jacobian_exe()
        redis_exe = shutil.which("redis-server")
        if redis_exe is None:
            raise SystemExit("redis-server is not installed: run scripts/setup.sh")
        self.results = work / "service-results"
        self.results.mkdir()
        redis_port, api_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("JACOBIAN_") or k in ("JACOBIAN_TRY_XLA", "JACOBIAN_CACHE_DIR")}
        env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
                   JACOBIAN_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0", JACOBIAN_RESULTS_URL=str(self.results),
                   JACOBIAN_MODEL_ROOTS=str(models_root))
        self.procs: list[Proc] = []
        self.procs.append(Proc("redis", [redis_exe, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(work)], env, work / "redis.log"))
        self.procs.append(Proc("api", cli + ["serve", "--port", str(api_port)], env, work / "api.log"))
        self.procs.append(Proc("worker", cli + ["worker"], env, work / "worker.log"))
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=120.0)
        try:
            wait_for(lambda: self.client.get("/readyz").status_code == 200, 60, "API /readyz")
        except BaseException:
            self.close(show_logs=True)
            raise

    def run_job(self, body: bytes, content_type: str, params: dict[str, str]) -> dict[str, Any]:
        """POST, then poll every 0.1 s until a terminal status; returns timings and the record."""
        t0 = time.perf_counter()
        wall0 = time.time()
        r = self.client.post("/v1/jobs", content=body, params=params, headers={"Content-Type": content_type})
        if r.status_code != 202:
            raise RuntimeError(f"POST /v1/jobs: {r.status_code} {r.text[:2000]}")
        t_post = time.perf_counter() - t0
        job_id = r.json()["id"]
        while True:
            record = self.client.get(f"/v1/jobs/{job_id}").json()
            if record["status"] in ("succeeded", "failed", "canceled"):
                break
            if any(p.proc.poll() is not None for p in self.procs):
                raise RuntimeError("a service process exited\n" + "\n".join(p.report() for p in self.procs))
            time.sleep(POLL_S)
        seconds = time.perf_counter() - t0
        if record["status"] != "succeeded":
            raise RuntimeError(f"job {job_id} {record['status']}: {record.get('error')}")
        created, started, finished = (_epoch(record.get(k)) for k in ("created_at", "started_at", "finished_at"))
        return {"seconds": seconds, "post_s": t_post, "record": record,
                "queue_wait_s": (started - created) if started and created else None,
                "worker_s": (finished - started) if finished and started else None,
                "after_finish_s": (wall0 + seconds - finished) if finished else None}

    def close(self, show_logs: bool = False) -> None:
        self.client.close()
        for p in reversed(self.procs):
            p.stop()
        if show_logs:
            for p in self.procs:
                print(p.report(), file=sys.stderr)


def request_body(x: np.ndarray, how: str, chunk_rows: int | None) -> tuple[bytes, str, dict[str, str]]:
    """The job as an ``.npz`` body with query options, or as JSON with inline tensors."""
    if how == "npz":
        buf = io.BytesIO()
        np.savez(buf, x=x)
        params = {"model_path": "mlp", "kind": KIND}
        if chunk_rows:
            params["chunk_rows"] = str(chunk_rows)
        return buf.getvalue(), "application/x-npz", params
    body: dict[str, Any] = {"model": {"path": "mlp", "signature": "serving_default"},
                            "inputs": {"x": {"shape": list(x.shape), "dtype": "float32", "data": x.ravel().tolist()}},
                            "kind": KIND, "mode": "auto"}
    if chunk_rows:
        body["chunk_rows"] = chunk_rows
    return json.dumps(body).encode(), "application/json", {}


def brief(plan: dict[str, Any]) -> str:
    return f"{plan.get('strategy')} x{plan.get('chunk_rows')}"


# -- main -------------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3),
            "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-s", type=float, default=10.0, help="compute time to size the job for")
    ap.add_argument("--batch", type=int, default=None, help="batch size (skips the calibration)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each path (after one warm-up)")
    ap.add_argument("--body", choices=("npz", "json"), default="npz", help="how the job is POSTed")
    ap.add_argument("--chunk-rows", type=int, default=None,
                    help="force the compute chunk in both paths (default: each path plans its own)")
    ap.add_argument("--no-xla", action="store_true",
                    help="JACOBIAN_TRY_XLA=0 in both paths: the trial chooses among fewer, steadier strategies")
    ap.add_argument("--out", default=None, help="folder for the JSON summary (bench/common.py emit)")
    args = ap.parse_args()
    if args.no_xla:
        os.environ["JACOBIAN_TRY_XLA"] = "0"  # read by the engine here and inherited by the worker

    from contracts.settings import get_settings
    from worker.main import configure_devices

    configure_devices(get_settings())
    from tests import models

    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    try:
        models_root = work / "models"
        model_path = str(models.mlp(models_root / "mlp", sizes=SIZES))
        if args.batch:
            batch, calib_s = args.batch, None
        else:
            batch, calib_s = calibrate_batch(model_path, args.target_s)
            print(f"calibration: batch {CALIBRATION_BATCH} in {calib_s:.3f} s -> batch {batch}", flush=True)
        x = np.random.default_rng(0).standard_normal((batch, SIZES[0])).astype(np.float32)
        input_npz = work / "inputs.npz"
        np.savez(input_npz, x=x)

        # The service first, so that (a) and (b) alternate under the same load on a shared machine.
        body, content_type, params = request_body(x, args.body, args.chunk_rows)
        service = Service(work, models_root)
        out = work / "compute-results"
        try:
            warm_a, manifest = compute_like_cli(model_path, str(input_npz), str(out), args.chunk_rows)
            shutil.rmtree(out, ignore_errors=True)
            print(f"compute: warm-up {warm_a:.3f} s, plan {brief(manifest['plan'])}", flush=True)
            warm_b = service.run_job(body, content_type, params)
            print(f"service: warm-up {warm_b['seconds']:.3f} s, plan {brief(warm_b['record']['plan'])}", flush=True)
            compute_s, plans_a, runs_b = [], [], []
            for i in range(args.runs):
                seconds, manifest = compute_like_cli(model_path, str(input_npz), str(out), args.chunk_rows)
                shutil.rmtree(out, ignore_errors=True)
                compute_s.append(seconds)
                plans_a.append(brief(manifest["plan"]))
                runs_b.append(service.run_job(body, content_type, params))
                print(f"run {i + 1}: compute {seconds:.3f} s ({plans_a[-1]}), service {runs_b[-1]['seconds']:.3f} s "
                      f"({brief(runs_b[-1]['record']['plan'])}; worker {runs_b[-1]['worker_s']:.3f} s)", flush=True)
        finally:
            service.close()
        result_mb = round(float(np.prod(manifest["shape"])) * 4 / 1e6, 1)
        service_s = [r["seconds"] for r in runs_b]
        plans_b = [brief(r["record"]["plan"]) for r in runs_b]

        ratios = [s / c for s, c in zip(service_s, compute_s)]
        # time from POST to the status seen, outside the worker's started..finished (ms resolution)
        overhead_s = [r["seconds"] - (r["worker_s"] or 0.0) for r in runs_b]
        ratio = statistics.median(service_s) / statistics.median(compute_s)
        rows = [
            {"path": "compute (jacobian compute calls, in-process, warm)", "seconds": summarize(compute_s)["median"],
             "runs": [round(t, 3) for t in compute_s], "plans": plans_a},
            {"path": f"service (POST {args.body} -> succeeded, poll {POLL_S} s, warm worker)",
             "seconds": summarize(service_s)["median"], "runs": [round(t, 3) for t in service_s],
             "post_s": round(statistics.median(r["post_s"] for r in runs_b), 3),
             "queue_wait_s": round(statistics.median(r["queue_wait_s"] or 0.0 for r in runs_b), 3),
             "worker_s": round(statistics.median(r["worker_s"] or 0.0 for r in runs_b), 3),
             "outside_worker_s": round(statistics.median(overhead_s), 3),
             "plans": plans_b},
            {"path": "ratio service/compute", "ratio": round(ratio, 3),
             "paired_ratios": [round(r, 3) for r in ratios], "goal": "<= 1.15", "met": ratio <= 1.15},
        ]
        print(f"\ncompute {statistics.median(compute_s):.3f} s, service {statistics.median(service_s):.3f} s "
              f"(of which {statistics.median(overhead_s):.3f} s outside the worker), "
              f"ratio service/compute {ratio:.3f} (goal <= 1.15)")
        emit("service_overhead", rows, args.out)
        summary = {"name": "service_overhead", "machine": machine(),
                   "job": {"model": "mlp " + "-".join(map(str, SIZES)), "kind": KIND, "batch": batch,
                           "rows": SIZES[-1], "result_shape": manifest["shape"], "result_mb": result_mb,
                           "body": args.body, "forced_chunk_rows": args.chunk_rows, "no_xla": args.no_xla,
                           "calibration_s": round(calib_s, 3) if calib_s else None},
                   "compute_s": summarize(compute_s), "service_s": summarize(service_s),
                   "service_worker_s": summarize([r["worker_s"] or 0.0 for r in runs_b]),
                   "service_outside_worker_s": summarize(overhead_s),
                   "warmup_s": {"compute": round(warm_a, 3), "service": round(warm_b["seconds"], 3)},
                   "plans": {"compute": plans_a, "service": plans_b},
                   "ratio": round(ratio, 3), "paired_ratios": [round(r, 3) for r in ratios],
                   "paired_ratio_median": round(statistics.median(ratios), 3), "goal": 1.15,
                   "met": ratio <= 1.15}
        print(json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
