"""``jacobian compute``: a Jacobian in this process, no Redis, written as a job's Zarr result and manifest.

The engine and the worker's pipeline run in-process (``worker.pipeline.compute_to_storage``; the matrix-free
kinds in ``jacobian.cli_matfree``, ``--sparsity`` in ``jacobian.cli_sparse``); TensorFlow and ``worker`` are
imported inside ``cmd_compute`` only, so building the parser needs neither (``jacobian --help`` on a client
install).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from contracts.jobspec import MATRIX_FREE_KINDS as MATFREE_KINDS
from jacobian.cli_matfree import add_arguments as add_matfree_arguments
from jacobian.cli_sparse import add_arguments as add_sparse_arguments

_STARTED = time.perf_counter()
KINDS = ("jacobian", "batch_jacobian", "hessian")
MODES = ("auto", "reverse", "forward")


def cmd_compute(args: argparse.Namespace) -> int:
    """The engine in-process, no Redis: Zarr result and manifest under ``{out}/{job_id}/``."""
    from contracts.settings import get_settings
    from jacobian.cli_matfree import cmd_compute_matfree
    from worker.main import configure_devices

    configure_devices(get_settings())
    if args.sparsity is not None and args.kind != "jacobian":
        print("error: --sparsity: only kind 'jacobian' is computed sparse; remove it or use --kind jacobian",
              file=sys.stderr)
        return 2
    if args.kind in MATFREE_KINDS:
        return cmd_compute_matfree(args)
    if args.wrt and len(args.wrt) > 1:
        print(f"error: --wrt: several names are taken by the matrix-free kinds ({', '.join(MATFREE_KINDS)}) so "
              f"far; kind {args.kind!r} takes one", file=sys.stderr)
        return 2
    args.wrt = args.wrt[0] if args.wrt else None
    job_id = args.job_id or uuid.uuid4().hex
    if args.sparsity is not None:
        from jacobian.cli_sparse import cmd_compute_sparse

        code = cmd_compute_sparse(args, job_id)
        if code is not None:
            return code
    from contracts import storage
    from jacobian.progress import RowProgress
    from worker.engine import DiskPlanCache, EngineError, TFMemoryProbe
    from worker.engine.planning import prepare
    from worker.inputs import InvalidInputs, effective_budget, load_inputs
    from worker.model_cache import get_model
    from worker.pipeline import compute_to_storage

    model_path = str(Path(args.model).expanduser().resolve())
    settings = get_settings()
    plans = DiskPlanCache(settings.cache_dir)
    progress = RowProgress(sys.stderr)  # a bar on a terminal, else a line every 10 s and the last one

    def on_plan(plan: dict[str, Any]) -> None:
        progress.set_state(f"strategy {plan['strategy']}" if plan.get("strategy") else "")
        progress.note(f"plan: {plan}")

    try:
        inputs = load_inputs(args.input, settings=settings, field="--input")
        model = get_model(model_path, args.signature)
        probe = TFMemoryProbe()
        problem, plan = prepare(model, inputs, cache=plans, device=probe.device, of=args.of, wrt=args.wrt,
                                kind=args.kind, mode=args.mode, reduce=args.reduce,
                                check_independence=args.check_independence, output_dtype=args.output_dtype)
        print(f"job {job_id}: {problem.kind} d{problem.of}/d{problem.wrt}, shape {tuple(problem.layout.shape)}, "
              f"{problem.rows_total} rows, mode {problem.mode}, plan {plan.source} ({plan.strategy})",
              file=sys.stderr, flush=True)
        progress.set_state(f"strategy {plan.strategy}" if plan.strategy else "")
        manifest = compute_to_storage(
            problem, results_url=storage.normalize(args.out), job_id=job_id,
            memory_budget_bytes=effective_budget(args.memory_budget, settings.memory_budget_bytes),
            chunk_rows=args.chunk_rows, plan=plan, on_learned=plans.put, probe=probe, try_xla=settings.try_xla,
            block_bytes=settings.block_bytes, precision=args.precision,
            on_plan=on_plan, on_progress=lambda p: progress.update(p.rows_done, p.rows_total, rate=p.rows_per_second,
                                                                   eta=p.eta_seconds),
            manifest_fields={"model": {"path": model_path, "signature": args.signature}})
    except (EngineError, InvalidInputs) as err:
        progress.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    done = manifest.get("plan") or {}
    if done.get("rows_computed"):
        rate = done["rows_computed"] / max(done.get("run_seconds") or 1e-9, 1e-9)
        print(f"done: {done['rows_computed']} rows in {done.get('run_seconds')} s ({rate:.1f} rows/s, strategy "
              f"{done.get('strategy')}, chunks of {done.get('chunk_rows')}), {time.perf_counter() - _STARTED:.1f} s "
              "since start", file=sys.stderr, flush=True)
    print(manifest["uri"])
    return 0


def add_parser(sub: Any) -> None:
    """The ``compute`` subcommand on ``sub`` (argparse subparsers); it needs the ``worker`` extra."""
    p = sub.add_parser("compute", help="compute a Jacobian in this process (no Redis) into Zarr storage")
    p.add_argument("--model", required=True, help="SavedModel directory")
    p.add_argument("--input", required=True, help="inputs as an .npz (local path, file:// or s3://)")
    p.add_argument("--signature", default="serving_default")
    p.add_argument("--of", help="output name (default: the only output)")
    p.add_argument("--wrt", nargs="+", help="input name or variables/<name> (default: the only float input); "
                   "matrix-free kinds: several, or variables/* for every trainable variable")
    p.add_argument("--kind", choices=KINDS + MATFREE_KINDS, default="jacobian")
    p.add_argument("--mode", choices=MODES, default="auto")
    p.add_argument("--reduce", choices=("sum",), help="Hessian of sum(of) for a non-scalar output")
    p.add_argument("--check-independence", action="store_true", help="batch_jacobian: verify examples are independent")
    p.add_argument("--output-dtype", help="store the result as this float dtype")
    p.add_argument("--precision", choices=("highest", "tf32"), default="highest",
                   help="GPU matmul precision: 'highest' (default; TensorFloat-32 off) or 'tf32' (faster, ~1e-3)")
    p.add_argument("--memory-budget", type=int, metavar="BYTES", help="cap on accelerator memory per chunk (bytes)")
    p.add_argument("--chunk-rows", type=int, metavar="N", help="force N rows per compute chunk")
    p.add_argument("--job-id", help="result folder name under --out (default: a new id)")
    p.add_argument("--out", required=True, help="results URL: a directory or s3://bucket/prefix")
    add_matfree_arguments(p)
    add_sparse_arguments(p)
    p.set_defaults(func=cmd_compute, needs=("worker",))
