"""A request that recurs: ``jacobian compute`` processes in a row on one plan cache, as a user's script or cron runs
them, for one or more checkouts of the engine side by side (issue 25: what a plan does over jobs, not one job).

For each tree (``--trees A,B``: folders of checkouts, each run with ``PYTHONPATH`` and working directory there;
default this checkout) the first process is cold (empty ``JACOBIAN_CACHE_DIR``) and the next ones warm on the plan,
the traces and the guard's probes it left. The trees' processes alternate (A1, B1, A2, B2, ...), so that load that
comes and goes falls on each alike. Per process: wall time and peak RSS (``wait4``), the strategy and chunk kept, the
sizes run, the rows/s per size the plan holds, a trial if one ran, and the check that no chunk passed twice the
largest size timed. Every process's rows are compared with the first's (relative 1e-4).

Run: .venv/bin/python -m bench.bench_series [--model mobilenet_softmax] [--processes 5] [--trees A,B] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench.bench_cold import ARCHS, build_model, chunk_figures, run
from bench.common import assert_same, emit, machine
from tests.procs import base_env, jacobian_exe

REPO = Path(__file__).resolve().parents[1]


def process(tree: Path, work: Path, name: str, job: str, model: tuple[Path, str, str]) -> dict:
    """One ``jacobian compute`` of ``tree`` on its own cache: its figures and rows."""
    import json

    import zarr

    model_dir, of, wrt = model
    env = base_env(JACOBIAN_CACHE_DIR=str(work / f"cache-{name}"), PYTHONPATH=str(tree))
    cwd = os.getcwd()
    os.chdir(tree)   # ``python -m`` and the console script find the tree's packages first
    try:
        res = run([*jacobian_exe(), "compute", "--model", str(model_dir), "--input", str(work / "inputs.npz"),
                   "--of", of, "--wrt", wrt, "--out", str(work / f"results-{name}"), "--job-id", job], env,
                  f"jacobian compute ({name} {job})")
    finally:
        os.chdir(cwd)
    folder = work / f"results-{name}" / job
    rows = np.asarray(zarr.open_array(str(folder / "result.zarr" / "jacobian"), mode="r")[:])
    figures, problems = chunk_figures(folder / "manifest.json", f"{name} {job}")
    plan = json.loads((folder / "manifest.json").read_text()).get("plan") or {}
    shutil.rmtree(folder)
    return {"tree": name, "job": job, "wall_s": res["wall_s"], "rss_MiB": res["peak_rss_mib"],
            "strategy": figures["strategy"], "kept": figures["kept"],
            "sizes_run": sorted(size for size, _ in plan.get("chunks_run") or []),
            "rows_per_second": plan.get("rows_per_second"), "run_s": (figures.get("run_s") or {}).get("wall"),
            "trial": _trial(plan.get("trial")), "problems": problems, "_rows": rows}


def _trial(trial: dict | None) -> str | None:
    if not trial:
        return None
    won = trial.get('winner') == trial.get('candidate')
    return f"{trial.get('candidate')} ({'won' if won else 'lost'})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=ARCHS, default="mobilenet_softmax")
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--trees", default=str(REPO), help="comma-separated checkouts of the engine (default: this one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = {Path(t).name or t: Path(t).resolve() for t in args.trees.split(",")}
    work = Path(tempfile.mkdtemp(prefix="bench-series-"))
    model = build_model(args.model, work)
    rows: list[dict] = []
    first = None
    for i in range(args.processes):
        for name, tree in trees.items():
            row = process(tree, work, name, "cold" if i == 0 else f"warm{i}", model)
            got = row.pop("_rows")
            first = got if first is None else first
            assert_same(got, first, f"{name} {row['job']} against the first process")
            print(row, flush=True)
            rows.append(row)
    processes = list(rows)
    for name in trees:
        mine = [r for r in processes if r["tree"] == name]
        warm = [r["wall_s"] for r in mine if r["job"] != "cold"]
        rows.append({"summary": name, "cold_s": mine[0]["wall_s"], "warm_s": warm,
                     "warm_s_median": statistics.median(warm) if warm else None,
                     "rss_MiB_max": max(r["rss_MiB"] for r in mine)})
    problems = [p for r in rows for p in r.get("problems", [])]
    rows.append({"check": "no chunk more than twice the largest size timed", "value": "; ".join(problems) or "ok"})
    print(machine())
    emit(f"series_{args.model}", rows, args.out)
    shutil.rmtree(work, ignore_errors=True)
    if problems:
        raise SystemExit("chunk plans grew past what was timed:\n" + "\n".join(problems))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
