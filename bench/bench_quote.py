"""Quotes against what the job then measured (issue 25): on each architecture, a cold ``jacobian compute``
makes the plan, ``jacobian compute --dry-run`` quotes the same request from it, and a warm run measures;
then a second quote (from the plan of both jobs: its latest peaks are a warm process's) and a second warm
run. Each quote's ``predicted_peak_bytes`` (at its ``predicted_chunk_rows``; ``peak_bound_bytes`` beside it)
is compared with the peak the run after it measured at that chunk size (the manifest's ``plan.peaks``), and
``predicted_seconds`` (a fresh process: the steady chunks and the plan's first calls;
``predicted_steady_seconds`` beside it) with that run's compute seconds (a fresh process too). Each run's
strategy and trial are listed. Goal: the peak within 25 %. Also the quote's own wall time as a process (no
TensorFlow).

Run: .venv/bin/python -m bench.bench_quote [--models mobilenet_softmax,efficientnet,transformer,lstm,conv1d]
     [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.bench_cold import ARCHS, build_model, run
from bench.common import emit, machine
from tests.procs import base_env, jacobian_exe

DEFAULT = ("mobilenet_softmax", "efficientnet", "transformer", "lstm", "conv1d")


def compared(quote: dict, plan: dict) -> dict:
    """The quote's peak and seconds against what the run whose manifest's plan is ``plan`` measured."""
    k = quote.get("predicted_chunk_rows")
    peaks = {int(s): int(p) for s, p in (plan.get("peaks") or {}).items()}
    measured = peaks.get(k) if k is not None else None
    predicted, bound = quote.get("predicted_peak_bytes"), quote.get("peak_bound_bytes")
    row = {"guess": quote.get("guess"), "strategy": quote.get("strategy"),
           "predicted_chunk_rows": k, "run_chunk_rows": plan.get("chunk_rows"),
           "predicted_peak_MiB": None if predicted is None else round(predicted / 2**20, 1),
           "peak_bound_MiB": None if bound is None else round(bound / 2**20, 1),
           "measured_peak_MiB": None if measured is None else round(measured / 2**20, 1),
           "peak_predicted/measured": None if not (predicted and measured) else round(predicted / measured, 3),
           "predicted_s": quote.get("predicted_seconds"), "predicted_steady_s": quote.get("predicted_steady_seconds"),
           "run_compute_s": plan.get("run_seconds"),
           "predicted/run_compute": None if not (quote.get("predicted_seconds") and plan.get("run_seconds"))
           else round(quote["predicted_seconds"] / plan["run_seconds"], 3),
           "run_strategy": plan.get("strategy"), "run_trial": plan.get("trial"),
           "measured_peaks_MiB": {s: round(p / 2**20, 1) for s, p in sorted(peaks.items())}}
    if measured is None:
        row["note"] = f"the run did not run the quoted chunk size {k} (it ran {sorted(peaks)})"
    return row


def one(name: str, work: Path) -> list[dict]:
    """Cold run, quote, warm run, quote, second warm run: each quote against the run after it (the first from a
    plan of one job, the second from a plan of two, whose latest peaks are a warm process's)."""
    model_dir, of, wrt = build_model(name, work)
    env = {**base_env(), "JACOBIAN_CACHE_DIR": str(work / "cache")}
    base = [*jacobian_exe(), "compute", "--model", str(model_dir), "--input", str(work / "inputs.npz"),
            "--of", of, "--wrt", wrt, "--out", str(work / "results")]
    cold = run([*base, "--job-id", "cold"], env, f"{name}: cold")
    cold_plan = json.loads((work / "results" / "cold" / "manifest.json").read_text()).get("plan") or {}
    rows = []
    for jobs, job in ((1, "warm"), (2, "warm2")):
        quoted = run([*base, "--job-id", f"quote{jobs}", "--dry-run"], env, f"{name}: dry run")
        measured = run([*base, "--job-id", job], env, f"{name}: {job}")
        plan = json.loads((work / "results" / job / "manifest.json").read_text()).get("plan") or {}
        row = {"model": name, "plan_jobs": jobs, **compared(json.loads(quoted["stdout"]), plan),
               "cold_strategy": cold_plan.get("strategy"), "cold_trial": cold_plan.get("trial"),
               "cold_s": cold["wall_s"], "run_s": measured["wall_s"], "quote_process_s": quoted["wall_s"]}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT), help=f"comma-separated, of {', '.join(ARCHS)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(machine(), flush=True)
    rows = []
    for name in args.models.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"bench-quote-{name}-"))
        try:
            rows.extend(one(name, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for jobs in (1, 2):
        of_jobs = [r for r in rows if r.get("plan_jobs") == jobs]
        within = [r for r in of_jobs if r["peak_predicted/measured"] is not None]
        near = sum(0.75 <= r["peak_predicted/measured"] <= 1.25 for r in within)
        rows.append({"summary": f"plans of {jobs} job(s): peak within 25 % on {near} of {len(within)} models "
                                f"compared ({len(of_jobs) - len(within)} not comparable)"})
        print(rows[-1], flush=True)
    emit("quotes", rows, args.out)


if __name__ == "__main__":
    main()
