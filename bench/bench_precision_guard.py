"""Overhead of the precision guard (worker/execution/precision.py): one request's job without and with it in one
process. ``python bench/bench_precision_guard.py depthwise jacobian out image`` (a ``tests.models`` builder, kind,
of, wrt); docs/BENCHMARKS.md has the figures."""
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")
import numpy as np  # noqa: E402

from tests import models  # noqa: E402
from worker.engine import TFMemoryProbe, load_model  # noqa: E402
from worker.engine import float64 as f64  # noqa: E402
from worker.execution import executor_for  # noqa: E402
from worker.execution.local import local_context  # noqa: E402
from worker.execution.precision import run_guarded  # noqa: E402

name, kind, of, wrt = sys.argv[1:5]
m = load_model(str(getattr(models, name)(Path(tempfile.mkdtemp()) / name)))
spec = m.input_specs[wrt]
x = np.random.default_rng(0).standard_normal([1 if d is None else d for d in spec.shape.as_list()]).astype("float32")
out = tempfile.mkdtemp()
extra = {"rank": 2} if kind in ("svd",) else {}


def job(i, guarded):
    ctx = local_context(m, {wrt: x}, results_url=out, job_id=f"j{i}", probe=TFMemoryProbe(), kind=kind, of=of,
                        wrt=wrt, **extra)
    t = time.perf_counter()
    man = run_guarded(executor_for(ctx.job), ctx) if guarded else executor_for(ctx.job).run(ctx)
    return time.perf_counter() - t, man


t0, _ = job(0, False)                    # cold: traces
t1, _ = job(1, False)                    # warm, no guard
t = time.perf_counter()
f64.float64_model(m)
conv = time.perf_counter() - t
t2, man = job(2, True)                   # warm, guard (float64 copy built already)
t3, _ = job(3, False)
t4, _ = job(4, True)
print(f"second guarded job {t4:.2f}s")
print(f"{name} {kind}: cold {t0:.2f}s; warm without guard {t1:.2f}/{t3:.2f}s; float64 copy {conv:.2f}s (once per "
      f"process); warm with guard {t2:.2f}s; estimate {man.get('precision_error')!r} by {man.get('precision_method')}")
