"""``jacobian compute``: any kind in this process, no Redis, written as a job's Zarr result and manifest.

The request is checked by the rules a POST meets (``contracts.jobspec``) and run through the worker's one
execution interface (``worker.execution.local.run_local``: the executor of the kind's family, as a job's);
TensorFlow and ``worker`` are imported inside ``cmd_compute`` only, so building the parser needs neither
(``jacobian --help`` on a client install). Messages use the command line's spelling (``--wrt``, ``--reduce sum``).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from contracts.kinds import KINDS as REGISTERED
from jacobian.cli_matfree import add_arguments as add_matfree_arguments
from jacobian.cli_sparse import add_arguments as add_sparse_arguments
from jacobian.cli_words import as_flag, cli_spelling, precision_words

_STARTED = time.perf_counter()
KINDS = tuple(REGISTERED)
MODES = ("auto", "reverse", "forward")


def cmd_compute(args: argparse.Namespace) -> int:
    """The engine in-process, no Redis: Zarr result and manifest under ``{out}/{job_id}/``, every kind through the
    worker's one execution interface (``worker.execution.local.run_local``), the same rules as at POST."""
    from pydantic import ValidationError

    from contracts.settings import get_settings
    from jacobian.cli_matfree import kind_options, load_seeds
    from jacobian.cli_sparse import parse_sparsity
    from jacobian.progress import RowProgress
    from worker.device_setup import configure_devices
    from worker.engine import EngineError
    from worker.execution.local import local_job, run_local
    from worker.inputs import InvalidInputs, effective_budget, load_inputs

    settings = get_settings()
    job_id = args.job_id or uuid.uuid4().hex
    wrt = args.wrt[0] if args.wrt and len(args.wrt) == 1 else args.wrt
    options = {"of": args.of, "wrt": wrt, "kind": args.kind, "mode": args.mode, "reduce": args.reduce,
               "check_independence": args.check_independence, "output_dtype": args.output_dtype,
               "precision": args.precision, "chunk_rows": args.chunk_rows, **kind_options(args),
               "sparsity": parse_sparsity(args.sparsity)}
    try:
        job = local_job(options, model_path=str(Path(args.model).expanduser().resolve()), signature=args.signature,
                        out=args.out, job_id=job_id, inputs_path=args.input)
    except ValidationError as err:
        print(f"error: {cli_spelling(err)}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(job, args, settings)
    configure_devices(settings)
    progress = RowProgress(sys.stderr)  # a bar on a terminal, else a line every 10 s and the last one

    def on_plan(plan: dict[str, Any]) -> None:
        progress.set_state(f"strategy {plan['strategy']}" if plan.get("strategy") else "")
        progress.note(f"plan: {plan}")

    print(f"job {job_id}: {args.kind} of {args.of or '(the output)'} w.r.t. {wrt or '(the input)'}"
          f"{f' ({args.sparsity} sparsity)' if args.sparsity else ''}", file=sys.stderr, flush=True)
    from worker.engine.host_peak import freeze_imports

    freeze_imports()   # TensorFlow, after the devices are set and the job's line is out
    try:
        seeds = load_seeds(args.seeds)
        inputs = load_inputs(args.input, settings=settings, field="--input")
        manifest = run_local(job, inputs=inputs, seeds=seeds, on_plan=on_plan,
                             on_progress=lambda p: progress.update(p.rows_done, p.rows_total, rate=p.rows_per_second,
                                                                   eta=p.eta_seconds),
                             budget_bytes=effective_budget(args.memory_budget, settings.memory_budget_bytes))
    except (EngineError, InvalidInputs, ValueError) as err:
        progress.close()
        print(f"error: {as_flag(str(err))}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    print(done_line(manifest, time.perf_counter() - _STARTED), file=sys.stderr, flush=True)
    print(manifest["uri"], flush=True)
    return 0


def _dry_run(job: Any, args: argparse.Namespace, settings: Any) -> int:
    """Print the quote (JSON) of this run and exit 0; nothing is computed, loaded into TensorFlow or written."""
    from contracts import npz
    from contracts.rules import RuleViolation
    from contracts.savedmodel import SavedModelError, SignatureNotFound
    from jacobian.cli_quote import local_quote

    try:
        quoted = local_quote(job, inputs_path=args.input, seeds_path=args.seeds, cache_dir=settings.cache_dir,
                             memory_budget_bytes=args.memory_budget or settings.memory_budget_bytes)
    except (RuleViolation, SavedModelError, SignatureNotFound, npz.NpzError, OSError, ValueError) as err:
        print(f"error: {as_flag(str(err))}", file=sys.stderr)
        return 2
    print(quoted.model_dump_json(indent=2), flush=True)
    return 0


def done_line(manifest: dict[str, Any], since_start_s: float) -> str:
    """The ``done:`` line: what was computed, by which route, how fast."""
    plan = manifest.get("plan") or {}
    lines = []
    if (plan.get("sparsity") or {}).get("fallback"):
        lines.append(f"sparsity: {plan['sparsity']['fallback']}; computed densely")
    if manifest.get("format") == "coo":
        info = manifest["sparsity"]
        lines.append(f"done: {info['nnz']} non-zeros of {manifest['dense_shape'][0]} x {manifest['dense_shape'][1]} "
                     f"(density {info['density']:.3g}) from {info['colors']} {info['mode']} products, verified "
                     f"{info['verified']}; seconds {info['seconds']}")
    elif "method" in plan:
        lines.append(f"done: {plan.get('kind')} by {plan['method']}, {plan.get('iterations')} iterations, products "
                     f"{plan.get('products')}, {plan.get('run_seconds')} s")
        if manifest.get("converged") is False:
            lines[-1] += f"; NOT CONVERGED, kept by --allow-unconverged: {manifest.get('warning')}"
    else:
        rows = plan.get("rows_computed") or 0
        rate = rows / max(plan.get("run_seconds") or 1e-9, 1e-9)
        lines.append(f"done: {rows} rows in {plan.get('run_seconds')} s ({rate:.1f} rows/s, strategy "
                     f"{plan.get('strategy')}, chunks of {plan.get('chunk_rows')}), {since_start_s:.1f} s since start")
    lines[-1] += precision_words(manifest)
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """The ``compute`` subcommand on ``sub`` (argparse subparsers); it needs the ``worker`` extra."""
    p = sub.add_parser("compute", help="compute a Jacobian in this process (no Redis) into Zarr storage")
    p.add_argument("--model", required=True, help="SavedModel directory")
    p.add_argument("--input", required=True, help="inputs as an .npz (local path, file:// or s3://)")
    p.add_argument("--signature", default="serving_default")
    p.add_argument("--of", help="output name (default: the only output)")
    p.add_argument("--wrt", nargs="+", help="input name or variables/<name> (default: the only float input); "
                   "several, or variables/* for every trainable variable: one concatenated wrt axis")
    p.add_argument("--kind", choices=KINDS, default="jacobian")
    p.add_argument("--mode", choices=MODES, default="auto")
    p.add_argument("--reduce", choices=("sum",), help="Hessian of sum(of) for a non-scalar output")
    p.add_argument("--check-independence", action="store_true", help="batch_jacobian: verify examples are independent")
    p.add_argument("--output-dtype", help="store the result as this float dtype")
    p.add_argument("--precision", choices=("highest", "tf32", "auto"), default="highest",
                   help="'highest' (default; TensorFloat-32 off on the GPU), 'tf32' (faster, ~1e-3) or 'auto' (as "
                   "highest, and computed again in float64 when the float64-probe error estimate exceeds --tol or "
                   "the default of the output's dtype; README 'Precision')")
    p.add_argument("--memory-budget", type=int, metavar="BYTES", help="cap on accelerator memory per chunk (bytes)")
    p.add_argument("--chunk-rows", type=int, metavar="N", help="force N rows per compute chunk")
    p.add_argument("--job-id", help="result folder name under --out (default: a new id)")
    p.add_argument("--out", required=True, help="results URL: a directory or s3://bucket/prefix")
    p.add_argument("--dry-run", action="store_true", help="print the quote as JSON (result bytes, passes, predicted "
                   "peak memory and time, from this machine's plan of the request when there is one) and exit; "
                   "nothing is computed or written")
    add_matfree_arguments(p)
    add_sparse_arguments(p)
    p.set_defaults(func=cmd_compute, needs=("worker",))
