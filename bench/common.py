"""Timing and memory helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Plans a benchmark's processes learn stay in a folder of its own run (tests.procs.base_env passes it on),
# never in the user's ~/.cache/jacobian: each run starts from no plan unless it says otherwise.
os.environ.setdefault("JACOBIAN_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="jacobian-bench-plans-"))


def median_seconds(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], Any]], *, repeats: int, rounds: int = 3) -> dict[str, float]:
    """Median seconds of each of ``fns``, timed in blocks taken in turn (A A A, B B B, A A A, ...).

    Each of ``rounds`` rounds runs every function once untimed, then ``repeats // rounds`` timed calls
    (at least one), so that each block starts after the other runtime's thread pools have settled and a
    load that comes and goes on a shared machine falls on every method alike, not on whichever was
    timed in that minute.
    """
    per_block = max(1, repeats // rounds)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def tf_peak_bytes(fn: Callable[[], Any], device: str = "CPU:0") -> tuple[Any, int]:
    """Run ``fn`` once; its result and the bytes it added at its peak on ``device`` (TensorFlow's
    allocator peak above what was allocated before: earlier results still held do not count)."""
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats(device)
    base = int(tf.config.experimental.get_memory_info(device)["current"])
    out = fn()
    return out, int(tf.config.experimental.get_memory_info(device)["peak"]) - base


def keep_off_the_gpu() -> None:
    """Hide every GPU from this process's TensorFlow, before its first op: a benchmark's parent only builds models
    and compares arrays, and TensorFlow without memory growth reserves nearly all of a GPU at its first op. On an
    H100 that left the JAX peer (a child process) out of memory at a 1x1 convolution (docs/BENCHMARKS.md, "GPU
    again"). Where this process's TensorFlow has already made its devices it says so on stderr: its
    children then share the GPU with it."""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError as err:
        print(f"WARNING: this benchmark's own process keeps the GPU ({err}); the processes it times share it",
              file=sys.stderr)


def machine() -> dict[str, Any]:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "tensorflow": tf.__version__,
            "device": "GPU" if gpus else "CPU", "processor": platform.processor() or platform.machine(),
            **cpu_model()}


def cpu_model() -> dict[str, Any]:
    """The CPU's model name and its vector extensions that TensorFlow's kernels use (VMs of one kind differ)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
    return {"cpu": name, "cpu_flags": [f for f in wanted if f in flags]}


def emit(name: str, rows: list[dict[str, Any]], out_dir: str | None) -> None:
    print(f"\n== {name}")
    for r in rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in r.items()))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
            json.dump({"machine": machine(), "rows": rows}, fh, indent=2)


def max_error(got: Any, want: Any) -> tuple[float, float]:
    """``(largest |got - want|, largest |want|)``, ``want`` reshaped to ``got``'s shape, in float64."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64).reshape(np.shape(got))
    return float(np.abs(got - want).max()), float(np.abs(want).max())


def assert_same(got: Any, want: Any, what: str, *, rel: float = 1e-4) -> None:
    """``got`` equals ``want`` up to ``rel`` of ``want``'s largest magnitude (Jacobians of untrained
    networks can be ~1e-12, where an absolute tolerance would check nothing)."""
    err, scale = max_error(got, want)
    assert scale > 0 and err <= rel * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def chunk_growth_problems(plan: dict[str, Any], what: str) -> list[str]:
    """Chunks a run planned at more than twice the largest size it had timed, from its recorded plan
    (the job status's or manifest's ``plan``): ``chunks_run`` holds, per chunk size run, the largest size
    timed before it (in the run or in the stored plan it started from; 0: none yet, where the first
    chunk may be ``FIRST_ROWS``). A plan without the record is a problem too: the check could not be made."""
    from worker.engine.tuning import FIRST_ROWS

    if "chunks_run" not in plan:
        return [f"{what}: the plan records no chunks_run (sizes run against sizes timed)"]
    return [f"{what}: a chunk of {size} rows after timing at most {before} rows (more than twice)"
            for size, before in plan["chunks_run"] if size > max(FIRST_ROWS, 2 * before)]


@contextmanager
def cpu_hogs(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` busy CPU processes for the duration of the block: ``stress-ng --cpu n`` where it is installed,
    else ``n`` Python busy loops. Each is stopped (by its own pid) when the block ends."""
    procs: list[subprocess.Popen[bytes]] = []
    if n > 0:
        if shutil.which("stress-ng"):
            procs = [subprocess.Popen(["stress-ng", "--cpu", str(n), "--quiet"])]
        else:
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
