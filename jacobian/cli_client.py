"""The client commands of ``jacobian``: ``submit``, ``status``, ``fetch``, ``list``, ``cancel``.

They talk to the API at ``--api`` (default ``JACOBIAN_API_URL``) through ``jacobian.client``; nothing
here imports TensorFlow. Exit codes: 0 success, 1 the job failed or was canceled (``--wait``),
2 an error answer of the API or the API out of reach, printed as ``error: <type>: <message>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from contracts.kinds import KINDS as REGISTERED
from jacobian.cli_words import precision_words

KINDS = tuple(REGISTERED)
MODES = ("auto", "reverse", "forward")
STATUSES = ("queued", "running", "succeeded", "failed", "canceled")


def _api_url(args: argparse.Namespace) -> str:
    if args.api:
        return str(args.api)
    from contracts.settings import get_settings

    return get_settings().api_url


def _client(args: argparse.Namespace) -> Any:
    from jacobian.client import JacobianClient

    return JacobianClient(_api_url(args), api_key=args.api_key or None)


def _fail(kind: str, message: str, code: int = 2) -> int:
    """Print the API's error in the command line's spelling (``jacobian.cli_words.as_flag``); return ``code``."""
    from jacobian.cli_words import as_flag

    print(f"error: {kind}: {as_flag(message)}", file=sys.stderr, flush=True)
    return code


def _show_record(progress: Any, record: dict[str, Any]) -> None:
    """A job record's progress on ``progress`` (``jacobian.progress.RowProgress``): rows, rate, ETA, status,
    strategy."""
    numbers = record.get("progress") or {}
    strategy = (record.get("plan") or {}).get("strategy")
    state = ", ".join(str(s) for s in (record.get("status"), strategy and f"strategy {strategy}") if s)
    progress.update(numbers.get("rows_done") or 0, numbers.get("rows_total"), rate=numbers.get("rows_per_second"),
                    eta=numbers.get("eta_seconds"), state=state)


# -- commands ----------------------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    """Post the .npz as the body (options as query parameters); print the id; ``--wait`` shows progress."""
    from jacobian.cli_matfree import kind_options
    from jacobian.client import JacobianError, JobFailed

    path = Path(args.input)
    try:
        body = path.read_bytes()
    except OSError as exc:
        return _fail("InvalidRequest", f"--input: cannot read {str(path)!r} ({exc.strerror or exc}); give an .npz file")
    if args.seeds:
        try:
            body = _with_seeds(body, args.seeds)
        except (OSError, ValueError) as exc:
            return _fail("InvalidRequest", f"--seeds: cannot add {args.seeds!r} to the inputs ({exc}); give a .npy "
                         "file written by numpy.save and an .npz of inputs")
    options = {"of": args.of, "wrt": args.wrt, "kind": args.kind, "mode": args.mode,
               "memory_budget_bytes": args.memory_budget, "reduce": args.reduce,
               "check_independence": True if args.check_independence else None,
               "output_dtype": args.output_dtype, "chunk_rows": args.chunk_rows, "shards": args.shards,
               "precision": args.precision, **kind_options(args),
               "sparsity": sparsity_option(args.sparsity), "timeout_s": args.job_timeout}
    with _client(args) as client:
        if args.dry_run:
            try:
                quoted = client.quote_npz(args.model, body, signature=args.signature, **options)
            except JacobianError as exc:
                return _fail(exc.type, exc.message)
            print(quoted.model_dump_json(indent=2), flush=True)
            return 0
        try:
            job_id = client.submit_npz(args.model, body, signature=args.signature,
                                       idempotency_key=args.idempotency_key, **options)
        except JacobianError as exc:
            return _fail(exc.type, exc.message)
        print(job_id, flush=True)
        if not args.wait:
            return 0
        return _wait(client, job_id, args, JacobianError, JobFailed)


def sparsity_option(text: str | None) -> str | None:
    """``--sparsity`` as the ``sparsity`` query parameter: ``auto``, ``pattern_from:<job id>`` and
    ``pattern_uri:<url>`` as given, anything else the URL of a pattern ``.npz`` (``pattern_uri:<url>``)."""
    if text is None:
        return None
    text = text.strip()
    if text == "auto" or text.startswith(("pattern_from:", "pattern_uri:", "{")):
        return text
    return f"pattern_uri:{text}"


def _with_seeds(npz_body: bytes, seeds_path: str) -> bytes:
    """The inputs ``.npz`` with the seeds (a ``.npy``) added as the member ``__seeds__``."""
    import io

    import numpy as np

    with np.load(io.BytesIO(npz_body), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    arrays["__seeds__"] = np.load(seeds_path, allow_pickle=False)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _wait(client: Any, job_id: str, args: argparse.Namespace, error_cls: type, failed_cls: type) -> int:
    from jacobian.progress import RowProgress

    # a bar on a terminal; in a log or a pipe, a plain line every 10 s, on each new status and at the end
    progress = RowProgress(sys.stderr, enabled=not args.quiet)
    try:
        record = client.wait(job_id, on_progress=lambda r: _show_record(progress, r), poll_s=args.poll,
                             timeout_s=args.timeout)
    except failed_cls as exc:
        progress.close()
        return _fail(exc.type, exc.message, code=1)
    except error_cls as exc:
        progress.close()
        return _fail(exc.type, exc.message)
    except TimeoutError as exc:
        progress.close()
        return _fail("Timeout", f"{exc}; it goes on: jacobian status {job_id}", code=1)
    finally:
        progress.close()
    result = record.get("result") or {}
    unconverged = f"; NOT CONVERGED, kept by --allow-unconverged: {result.get('warning')}" \
        if result.get("converged") is False else ""
    print(f"succeeded: {job_id} shape {result.get('shape')} {result.get('dtype')} at {result.get('uri')}{unconverged}"
          f"{precision_words(result)}",
          file=sys.stderr, flush=True)
    return 0


def event_line(event: Any) -> str:
    """One line of ``status --follow``: event, status, rows done of total (percent), rate and ETA."""
    record = event.data
    numbers = record.get("progress") or {}
    total = numbers.get("rows_total")
    parts = [event.event, str(record.get("status")),
             f"rows {numbers.get('rows_done') or 0}/{'?' if total is None else total}",
             f"{100.0 * float(numbers.get('fraction') or 0.0):.1f}%"]
    if numbers.get("rows_per_second"):
        parts.append(f"{numbers['rows_per_second']:g} rows/s")
    if numbers.get("eta_seconds") is not None and record.get("status") == "running":
        parts.append(f"ETA {numbers['eta_seconds']:g} s")
    error = record.get("error") or {}
    if error:
        parts.append(f"{error.get('type')}: {error.get('message')}")
    return "  ".join(parts)


def _follow(client: Any, job_id: str, error_cls: type) -> int:
    """One line per event on stdout until the job ends; 0 when it succeeded, 1 failed or canceled, 2 error."""
    status = None
    try:
        for event in client.follow(job_id):
            print(event_line(event), flush=True)
            status = event.data.get("status")
    except error_cls as exc:
        return _fail(exc.type, exc.message)
    if status == "succeeded":
        return 0
    if status in ("failed", "canceled"):
        return 1
    return _fail("StreamEnded", f"job {job_id}: the event stream ended while it was {status} (its record "
                 f"expired?); see jacobian status {job_id}")


def cmd_status(args: argparse.Namespace) -> int:
    """The job's record as JSON on stdout (``--wait``: with a progress bar until it ends; ``--follow``: one
    line per event instead, exit code of the job's end)."""
    from jacobian.client import JacobianError, JobFailed

    code = 0
    with _client(args) as client:
        if args.follow:
            return _follow(client, args.id, JacobianError)
        if args.wait:
            code = _wait(client, args.id, args, JacobianError, JobFailed)
            if code == 2:
                return code
        try:
            record = client.status(args.id)
        except JacobianError as exc:
            return _fail(exc.type, exc.message)
    print(json.dumps(record, indent=2))
    return code


def _parse_rows(text: str | None) -> slice | None:
    """``"a:b"``, ``"a:"``, ``":b"`` or ``"a"`` -> a slice (negative indices count from the end)."""
    if text is None or text.strip() in ("", ":"):
        return None
    parts = text.split(":")
    try:
        if len(parts) == 1:
            start = int(parts[0])
            return slice(start, start + 1 if start != -1 else None)
        if len(parts) == 2:
            return slice(int(parts[0]) if parts[0].strip() else None, int(parts[1]) if parts[1].strip() else None)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--rows: {text!r} is not a row range; use a:b (0-based, b exclusive)")


def cmd_fetch(args: argparse.Namespace) -> int:
    """Rows of a succeeded job into an ``.npy`` file, page by page (host memory stays bounded)."""
    import numpy as np

    from jacobian.client import JacobianError
    from jacobian.progress import RowProgress

    try:
        rows = _parse_rows(args.rows)
    except argparse.ArgumentTypeError as exc:
        return _fail("InvalidRequest", str(exc))
    out = Path(args.output)
    tmp = out.with_name(f".{out.name}.part")
    progress = RowProgress(sys.stderr, enabled=not args.quiet)
    with _client(args) as client:
        try:
            pages = client.iter_rows(args.id, rows, page_bytes=args.page_bytes)
            first = next(pages)
            record_rows = _expected_rows(client, args.id, rows)
            n_rows = record_rows if record_rows is not None else first.shape[0]
            if n_rows == first.shape[0]:
                with open(tmp, "wb") as fh:
                    np.save(fh, first, allow_pickle=False)
            else:
                target = np.lib.format.open_memmap(tmp, mode="w+", dtype=first.dtype, shape=(n_rows,) + first.shape[1:])
                target[:first.shape[0]] = first
                at = first.shape[0]
                progress.update(at, n_rows)
                for page in pages:
                    target[at:at + page.shape[0]] = page
                    at += page.shape[0]
                    progress.update(at, n_rows)
                target.flush()
                del target
            progress.close()
            os.replace(tmp, out)
        except JacobianError as exc:
            progress.close()
            tmp.unlink(missing_ok=True)
            return _fail(exc.type, exc.message)
        except OSError as exc:
            progress.close()
            tmp.unlink(missing_ok=True)
            return _fail("OSError", f"-o: cannot write {str(out)!r} ({exc.strerror or exc})")
        finally:
            progress.close()
    arr = np.load(out, mmap_mode="r")
    print(f"wrote {out}: {arr.shape} {arr.dtype}", file=sys.stderr, flush=True)
    return 0


def _expected_rows(client: Any, job_id: str, rows: slice | None) -> int | None:
    """How many rows ``rows`` selects, from the result's ``rows_total`` (None when unknown)."""
    from jacobian.client import row_range

    total, _ = client.row_geometry(job_id)
    if total is None:
        return None
    start, stop = row_range(rows, total)
    return max(0, min(total, total if stop is None else stop) - start)


def cmd_list(args: argparse.Namespace) -> int:
    """Jobs newest first, as a table (``--json``: the records)."""
    from jacobian.client import JacobianError

    with _client(args) as client:
        try:
            jobs = client.list(status=args.status, limit=args.limit)
        except JacobianError as exc:
            return _fail(exc.type, exc.message)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    header = ("ID", "STATUS", "KIND", "PROGRESS", "ROWS/S", "CREATED", "MODEL")
    table = [header]
    for job in jobs:
        progress = job.get("progress") or {}
        total = progress.get("rows_total")
        rate = progress.get("rows_per_second")
        model = (job.get("model") or {}).get("path") or ""
        table.append((job["id"], job["status"], job.get("kind") or "",
                      f"{progress.get('rows_done') or 0}/{total if total is not None else '?'}",
                      f"{rate:.1f}" if isinstance(rate, (int, float)) else "--",
                      (job.get("created_at") or "")[:19].replace("T", " "), Path(model).name))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Request cancellation; prints the record."""
    from jacobian.client import JacobianError

    with _client(args) as client:
        try:
            record = client.cancel(args.id)
        except JacobianError as exc:
            return _fail(exc.type, exc.message)
    print(json.dumps(record, indent=2))
    return 0


# -- parser ------------------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", metavar="URL", help="API address (default: JACOBIAN_API_URL, http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("JACOBIAN_API_KEY"), metavar="KEY",
                   help="sent as Authorization: Bearer (default: JACOBIAN_API_KEY)")


def _waiting(p: argparse.ArgumentParser) -> None:
    p.add_argument("--poll", type=float, default=0.5, metavar="S", help="seconds between polls (default 0.5)")
    p.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def register(sub: Any) -> None:
    """Add ``submit``, ``status``, ``fetch``, ``list`` and ``cancel`` to the ``jacobian`` parser."""
    p = sub.add_parser("submit", help="submit a job to the API (inputs from an .npz); prints its id")
    p.add_argument("--model", required=True, metavar="PATH", help="SavedModel path under a model root of the API")
    p.add_argument("--input", required=True, metavar="FILE.npz", help="the inputs, one array per signature input")
    p.add_argument("--signature", default="serving_default")
    p.add_argument("--of", help="output name (default: the only output)")
    p.add_argument("--wrt", help="input name or variables/<name> (default: the only float input); the matrix-free "
                   "kinds: several comma-separated, or variables/*")
    p.add_argument("--kind", choices=KINDS)
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--reduce", choices=("sum",), help="Hessian of sum(of) for a non-scalar output")
    p.add_argument("--check-independence", action="store_true", help="batch_jacobian: verify examples are independent")
    p.add_argument("--output-dtype", help="store the result as this float dtype")
    p.add_argument("--precision", choices=("highest", "tf32", "auto"),
                   help="default highest (TensorFloat-32 off on the GPU); tf32: faster, ~1e-3; auto: computed again "
                   "in float64 when the float64-probe error estimate exceeds --tol or the dtype's default")
    p.add_argument("--memory-budget", type=int, metavar="BYTES", help="cap on the memory of a chunk (bytes)")
    p.add_argument("--chunk-rows", type=int, metavar="N", help="force N rows per compute chunk")
    p.add_argument("--job-timeout", type=int, metavar="S", help="the job's wall-clock limit (request field timeout_s; "
                   "default JACOBIAN_JOB_TIMEOUT_S on the server)")
    p.add_argument("--shards", type=int, metavar="N", help="split the job into N row-range shards")
    p.add_argument("--sparsity", metavar="auto|pattern_from:ID|URL",
                   help="kind jacobian: compute J as a sparse (COO) matrix from its sparsity pattern: 'auto' "
                   "(detected from the model), 'pattern_from:<job id>' (an earlier job's non-zeros) or the URL of an "
                   ".npz with int arrays rows and cols under the results storage")
    p.add_argument("--idempotency-key", metavar="KEY", help="same key and inputs: the same job (default: a new key)")
    p.add_argument("--wait", action="store_true", help="wait for the job, with a progress bar on stderr")
    p.add_argument("--dry-run", action="store_true", help="print the API's quote as JSON (POST ?dry_run=true: result "
                   "bytes, passes, predicted peak memory and time) and exit; nothing is queued")
    _waiting(p)
    _common(p)
    from jacobian.cli_matfree import add_arguments as add_matfree_arguments

    add_matfree_arguments(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="a job's status, progress, plan and result as JSON")
    p.add_argument("id")
    p.add_argument("--wait", action="store_true", help="wait for the job to end first, with a progress bar")
    p.add_argument("--follow", action="store_true", help="one line per status or progress event (GET "
                   "/v1/jobs/{id}/events) until the job ends; exit 0 succeeded, 1 failed or canceled")
    _waiting(p)
    _common(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("fetch", help="rows of a succeeded job's result into an .npy file")
    p.add_argument("id")
    p.add_argument("--rows", metavar="A:B", help="row range (0-based, B exclusive; default all rows)")
    p.add_argument("-o", "--output", required=True, metavar="FILE.npy")
    p.add_argument("--page-bytes", type=int, default=64 * 1024 * 1024, metavar="BYTES",
                   help="at most this many bytes per request (default 64 MiB)")
    p.add_argument("--quiet", action="store_true")
    _common(p)
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("list", help="jobs, newest first")
    p.add_argument("--status", choices=STATUSES)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true", help="the records as JSON")
    _common(p)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("cancel", help="cancel a job (a running one stops at its next chunk)")
    p.add_argument("id")
    _common(p)
    p.set_defaults(func=cmd_cancel)
