"""Timing and memory helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
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


def machine() -> dict[str, Any]:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    return {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "tensorflow": tf.__version__,
            "device": "GPU" if gpus else "CPU", "processor": platform.processor() or platform.machine()}


def emit(name: str, rows: list[dict[str, Any]], out_dir: str | None) -> None:
    print(f"\n== {name}")
    for r in rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in r.items()))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
            json.dump({"machine": machine(), "rows": rows}, fh, indent=2)


def assert_same(got: Any, want: Any, what: str, *, rel: float = 1e-4) -> None:
    """``got`` equals ``want`` up to ``rel`` of ``want``'s largest magnitude (Jacobians of untrained
    networks can be ~1e-12, where an absolute tolerance would check nothing)."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64).reshape(np.shape(got))
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert scale > 0 and err <= rel * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"
