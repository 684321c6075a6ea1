"""``jacobian compute --sparsity``: a sparse Jacobian in-process (``worker.sparse_job``), its COO group and
manifest under ``{out}/{job_id}/`` as a job's. When the sparse path does not pay (or fails verification) the
reason is printed and the dense computation follows, as in the service."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sparsity", metavar="auto|pattern_from:JOB|FILE.npz",
                   help="kind jacobian: compute the Jacobian as a sparse matrix (COO) from a colouring of its "
                        "pattern: 'auto' detects the pattern from the graph; 'pattern_from:JOB' takes the entries "
                        "of an earlier result under --out; a path or URL of an .npz (rows, cols) gives it")


def parse_sparsity(text: str | None) -> Any:
    """The ``sparsity`` option from the command line's text."""
    if text is None:
        return None
    if text == "auto":
        return "auto"
    if text.startswith("pattern_from:"):
        return {"pattern_from": text.split(":", 1)[1]}
    return {"pattern_uri": text}


def cmd_compute_sparse(args: argparse.Namespace, job_id: str) -> int | None:
    """The exit code, or None when the dense computation must follow (the reason printed)."""
    from contracts import storage
    from contracts.layout import RESULT_GROUP, job_url
    from contracts.settings import get_settings
    from jacobian.progress import RowProgress
    from worker.engine import EngineError, TFMemoryProbe
    from worker.engine.plan_cache import default_cache_dir
    from worker.inputs import InvalidInputs, effective_budget, load_inputs
    from worker.model_cache import get_model
    from worker.sparse_job import DenseInstead, compute_sparse_to_storage

    settings = get_settings()
    out = storage.normalize(args.out)
    progress = RowProgress(sys.stderr)

    def previous(earlier: str) -> str | None:
        url = storage.join(job_url(out, earlier), RESULT_GROUP)
        return url if storage.exists(storage.join(job_url(out, earlier), "manifest.json")) else None

    try:
        inputs = load_inputs(args.input, settings=settings, field="--input")
        model = get_model(str(Path(args.model).expanduser().resolve()), args.signature)
        print(f"job {job_id}: sparse jacobian ({args.sparsity})", file=sys.stderr, flush=True)
        outcome = compute_sparse_to_storage(
            model, inputs, of=args.of, wrt=args.wrt, sparsity=parse_sparsity(args.sparsity), results_url=out,
            job_id=job_id, probe=TFMemoryProbe(),
            budget_bytes=effective_budget(args.memory_budget, settings.memory_budget_bytes),
            chunk_size=args.chunk_rows, cache_dir=str(settings.cache_dir or default_cache_dir()),
            output_dtype=args.output_dtype, previous=previous,
            on_progress=lambda done, total: progress.update(done, total),
            manifest_fields={"model": {"path": model.path, "signature": args.signature}})
    except (EngineError, InvalidInputs, ValueError) as err:
        progress.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    if isinstance(outcome, DenseInstead):
        print(f"sparsity: {outcome.sparsity.get('fallback')}; computing densely", file=sys.stderr, flush=True)
        return None
    info = outcome["sparsity"]
    print(f"done: {info['nnz']} non-zeros of {outcome['dense_shape'][0]} x {outcome['dense_shape'][1]} "
          f"(density {info['density']:.3g}) from {info['colors']} {info['mode']} products, verified "
          f"{info['verified']}; seconds {info['seconds']}", file=sys.stderr, flush=True)
    print(outcome["uri"], flush=True)
    return 0
