"""The MLP and MobileNet benchmarks on a GPU, and jobs while another process holds most of its memory.

1. MLP 256-512-512-256, batch 64, per-example Jacobian (``bench.bench_mlp.ours_until_refined``): ours
   against ``tape.batch_jacobian`` in a ``tf.function`` on the GPU, and our GPU result against
   ``tape.batch_jacobian`` on the CPU: TensorFloat-32 is off, so GPU rows meet the CPU tolerance (1e-4).
2. MobileNetV3Small, 1000 logits w.r.t. one 224x224x3 image (``bench.bench_mobilenet.peers``): ours,
   first job and steady state, against ``tape.jacobian`` on the GPU; peaks from the GPU allocator.
3. Contention: a second process takes ``--hold`` of the GPU's free memory (0.85, then 0.97) with
   TensorFlow (a ``memory_limit`` without growth: reserved whole at its first allocation) and sleeps;
   ``--jobs`` MobileNet jobs run beside it, each with the plan the last one learnt, as a worker runs
   them. The table shows the free memory each job saw, its chunk (smaller than without the other
   process), OOM halvings, and that every job finished with the rows of the steady run.

Exits with status 2 and a message when TensorFlow sees no GPU; with status 1 when a job failed.
Run: .venv/bin/python -m bench.bench_gpu [--repeats 10] [--jobs 3] [--hold 0.85 0.97] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench.common import assert_same, emit, machine, median_seconds, tf_peak_bytes

os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")  # this process: memory growth, set before TensorFlow
REPO = Path(__file__).resolve().parents[1]
GIB = float(1 << 30)


def gib(n: int) -> float:
    return round(n / GIB, 2)

# The other tenant: NVML's free memory of the GPU CUDA gives it (as the engine finds that device), a
# memory_limit of ``fraction`` of it without growth, one allocation to make TensorFlow reserve it, then
# "HELD <bytes>" and sleep until its stdin closes.
HOG = r"""
import os, sys
from worker.engine import devices
nv = devices.nvml()
handle, _ = devices.nvml_handle(nv, 0, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                bus_id=devices.cuda_pci_bus_id(0))
limit_mb = int(float(sys.argv[1]) * int(nv.nvmlDeviceGetMemoryInfo(handle).free)) >> 20
import tensorflow as tf
gpu = tf.config.list_physical_devices("GPU")[0]
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mb)])
held = tf.zeros((1024,))
print("HELD", limit_mb << 20, int(nv.nvmlDeviceGetMemoryInfo(handle).free), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def other_tenant(fraction: float, script: str = HOG) -> Iterator[tuple[int, int]]:
    """A process holding ``fraction`` of the GPU's free memory: yields (bytes held, free after). ``script`` is the
    tenant (TensorFlow's by default): it prints "HELD <bytes held> <free after>" and sleeps until stdin closes."""
    env = {k: v for k, v in os.environ.items() if k != "TF_FORCE_GPU_ALLOW_GROWTH"}
    proc = subprocess.Popen([sys.executable, "-c", script, str(fraction)], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line.startswith("HELD"):
            raise RuntimeError(f"the process meant to hold GPU memory did not (exit {proc.poll()}): {line!r}")
        _, held, free_after = line.split()
        yield int(held), int(free_after)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def mlp_on_gpu(work: Path, repeats: int) -> list[dict]:
    import tensorflow as tf

    from bench.bench_mlp import compiled_batch_jacobian, ours_until_refined
    from tests import models
    from worker.engine import compute_in_memory, load_model, run_problem

    model = load_model(str(models.mlp(work / "mlp", sizes=(256, 512, 512, 256))))
    x = np.random.default_rng(0).standard_normal((64, 256)).astype("float32")
    problem, plan, jobs, t_refine = ours_until_refined(model, x)
    t_ours = median_seconds(lambda: run_problem(problem, plan=plan), repeats=repeats)
    ours, report = compute_in_memory(model, {"x": x}, kind="batch_jacobian", plan=plan)

    tape_fn = compiled_batch_jacobian(model)

    xt = tf.constant(x)
    t_tape = median_seconds(lambda: tape_fn(xt).numpy(), repeats=repeats)
    assert_same(ours, tape_fn(xt).numpy(), "ours vs tape.batch_jacobian, both on the GPU")
    with tf.device("CPU:0"):
        xc = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xc)
            y = model.fn(x=xc)["y"]
        cpu = tape.batch_jacobian(y, xc).numpy()
    assert_same(ours, cpu, "ours on the GPU vs tape.batch_jacobian on the CPU (TF32 off)")
    return [
        {"method": "MLP: ours run_problem (plan refined)", "ms": round(t_ours * 1e3, 2), "strategy": plan.strategy,
         "chunk_rows": report.plan["chunk_rows"], "jobs_until_refined": jobs,
         "seconds_until_refined": round(t_refine, 2), "free_GiB_at_start": gib(report.plan["free_bytes_at_start"])},
        {"method": "MLP: tape.batch_jacobian tf.function", "ms": round(t_tape * 1e3, 2)},
        {"ratio": "MLP: ours / tape.batch_jacobian tf.function (GPU)", "value": round(t_ours / t_tape, 3)},
        {"check": "MLP: GPU rows equal the CPU's within 1e-4 of the largest entry (TF32 off)", "value": True},
    ]


def mobilenet_on_gpu(work: Path, loop_rows: int, skip_tape: bool) -> tuple[object, object, np.ndarray, list[dict]]:
    import tensorflow as tf

    from bench.bench_mobilenet import ROWS, peers
    from tests import models
    from worker.engine import build_problem, load_model, run_problem

    keras_model = models.mobilenet_v3_small_keras()
    model = load_model(str(models.mobilenet_v3_small(work / "mnv3", keras_model)))
    x = np.random.default_rng(0).standard_normal((1, 224, 224, 3)).astype("float32")
    rows, results, fastest, _ = peers(tf, model, keras_model, tf.constant(x), loop_rows, skip_tape, device="GPU:0")
    problem = build_problem(model, {"image": x}, of="logits")
    sink = np.empty((ROWS,) + problem.layout.row_shape, np.float32)

    def keep(start: int, block: np.ndarray) -> None:
        sink[start:start + len(block)] = block

    t0 = time.perf_counter()
    first = run_problem(problem, on_chunk=keep)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    steady, peak = tf_peak_bytes(lambda: run_problem(problem, on_chunk=keep, plan=first.learned), "GPU:0")
    t_steady = time.perf_counter() - t0
    ours = sink.reshape(ROWS, -1).copy()
    for label, ref in results.items():
        assert_same(ours[:len(ref)], ref, f"MobileNet: ours vs {label}")
    rows += [
        {"method": "MobileNet: ours, first job", "s": round(t_first, 2), "rows_per_s": round(ROWS / t_first, 1)},
        {"method": "MobileNet: ours, steady state", "s": round(t_steady, 2), "rows_per_s": round(ROWS / t_steady, 1),
         "peak_MB": round(max(peak, steady.peak_bytes) / 2**20), "strategy": steady.plan["strategy"],
         "chunk_rows": steady.plan["chunk_rows"], "free_GiB_at_start": gib(steady.plan["free_bytes_at_start"])},
    ]
    if fastest is not None:
        label, t_tape, peak_tape = fastest
        rows.append({"ratio": f"MobileNet: ours rows/s / {label} (GPU)", "value": round(t_tape / t_steady, 2)})
    return problem, steady.learned, ours, rows


def contention(problem: object, plan: object, want: np.ndarray, holds: list[float],
               jobs: int) -> tuple[list[dict], int]:
    """MobileNet jobs beside a process holding most of the GPU's memory: (rows for the table, jobs failed)."""
    from worker.engine import run_problem

    out, failed = [], 0
    got = np.empty_like(want)
    for hold in holds:
        with other_tenant(hold) as (held, nvml_free):
            out.append({"other_process": f"holds {held / GIB:.1f} GiB ({hold:.0%} of the free memory)",
                        "nvml_free_GiB": gib(nvml_free)})
            for job in range(1, jobs + 1):
                got[:] = np.nan

                def keep(start: int, block: np.ndarray) -> None:
                    got[start:start + len(block)] = block.reshape(len(block), -1)

                t0 = time.perf_counter()
                try:
                    report = run_problem(problem, plan=plan, on_chunk=keep)
                except Exception as err:  # noqa: BLE001 - a failed job is the finding, not the end of the run
                    failed += 1
                    out.append({"hold": hold, "job": job, "failed": f"{type(err).__name__}: {str(err)[:200]}"})
                    continue
                secs = time.perf_counter() - t0
                plan = report.learned
                assert_same(got, want, f"job {job} beside a process holding {hold:.0%}")
                out.append({"hold": hold, "job": job, "free_GiB_at_start": gib(report.plan["free_bytes_at_start"]),
                            "chunk_rows": report.plan["chunk_rows"], "strategy": report.plan["strategy"],
                            "oom_retries": report.plan["oom_retries"],
                            "budget_halvings": report.plan.get("budget_halvings", 0),
                            "s": round(secs, 2), "rows_per_s": round(len(want) / secs, 1), "rows_equal_steady": True})
    return out, failed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--loop-rows", type=int, default=50)
    ap.add_argument("--skip-tape", action="store_true")
    ap.add_argument("--jobs", type=int, default=3, help="MobileNet jobs beside the other process, per --hold")
    ap.add_argument("--hold", type=float, nargs="+", default=[0.85, 0.97],
                    help="shares of the GPU's free memory the other process holds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        print("bench_gpu: TensorFlow sees no GPU (CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); this benchmark measures the GPU path and needs "
              "one. The CPU benchmarks are bench.bench_mlp and bench.bench_mobilenet.", file=sys.stderr)
        sys.exit(2)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    rows = mlp_on_gpu(work, args.repeats)
    problem, plan, want, mobile = mobilenet_on_gpu(work, args.loop_rows, args.skip_tape)
    rows += mobile
    beside, failed = contention(problem, plan, want, args.hold, args.jobs)
    rows += beside
    rows.append({"summary": f"{failed} of {args.jobs * len(args.hold)} jobs beside the other process failed"})
    print({**machine(), "gpu": tf.config.experimental.get_device_details(gpus[0]).get("device_name")})
    emit("gpu", rows, args.out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
