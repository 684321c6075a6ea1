"""``jacobian compute`` for the matrix-free kinds (``jvp``, ``vjp``, ``hvp``, ``svd``, ``hessian_eig``,
``hessian_trace``): the engine in-process (``worker.matfree_job``), the result group and manifest under
``{out}/{job_id}/`` as a job's, progress in seeds or iterations on stderr, the group's URI on stdout."""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The matrix-free kinds' options of ``jacobian compute``."""
    p.add_argument("--seeds", metavar="FILE.npy", help="jvp, hvp: tangents (k,) + wrt.shape; vjp: cotangents "
                   "(k,) + of.shape (several wrt: (k, total wrt size))")
    p.add_argument("--rank", type=int, help="svd, hessian_eig: how many singular values / eigenpairs")
    p.add_argument("--tol", type=float, help="svd, hessian_eig: relative accuracy (default 1e-4)")
    p.add_argument("--samples", type=int, help="hessian_trace: Hessian-vector products to spend (default 100)")


def cmd_compute_matfree(args: argparse.Namespace) -> int:
    from contracts import storage
    from contracts.settings import get_settings
    from jacobian.progress import RowProgress
    from worker.engine import EngineError, TFMemoryProbe
    from worker.engine.matfree import build_operator
    from worker.inputs import InvalidInputs, effective_budget, load_inputs
    from worker.matfree_job import compute_matfree_to_storage
    from worker.model_cache import get_model

    job_id = args.job_id or uuid.uuid4().hex
    settings = get_settings()
    progress = RowProgress(sys.stderr)
    try:
        seeds = _load_seeds(args.seeds)
        inputs = load_inputs(args.input, settings=settings, field="--input")
        model = get_model(str(Path(args.model).expanduser().resolve()), args.signature)
        wrt = args.wrt[0] if args.wrt and len(args.wrt) == 1 else args.wrt
        op = build_operator(model, inputs, of=args.of, wrt=wrt, kind=args.kind, reduce=args.reduce,
                            output_dtype=args.output_dtype)
        op.plan_memory(TFMemoryProbe(), effective_budget(args.memory_budget, settings.memory_budget_bytes))
        print(f"job {job_id}: {args.kind} of {op.of} w.r.t. {', '.join(op.axis.names)} ({op.n_of} x {op.n_wrt})",
              file=sys.stderr, flush=True)
        manifest = compute_matfree_to_storage(
            op, args.kind, results_url=storage.normalize(args.out), job_id=job_id, seeds=seeds, rank=args.rank,
            tol=args.tol, samples=args.samples, chunk_size=args.chunk_rows,
            on_progress=lambda done, total: progress.update(done, total),
            manifest_fields={"model": {"path": model.path, "signature": args.signature}})
    except (EngineError, InvalidInputs, ValueError) as err:
        progress.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    plan = manifest["plan"]
    print(f"done: {args.kind} by {plan['method']}, {plan['iterations']} iterations, products {plan['products']}, "
          f"{plan['run_seconds']} s", file=sys.stderr, flush=True)
    print(manifest["uri"], flush=True)
    return 0


def _load_seeds(path: str | None):
    import numpy as np

    if path is None:
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"--seeds: cannot read {path!r} as a .npy array ({err}); save it with numpy.save") from err
