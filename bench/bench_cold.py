"""Whole processes, as a new user runs them: ``jacobian compute`` against a tape.jacobian script.

MobileNetV3Small (weights=None), 1000 logits w.r.t. one 224x224x3 image: the full Jacobian
(1, 1000, 1, 224, 224, 3), 602 MB. Each run, in this order:
  peer   ``python bench/peer_tape_jacobian.py`` (load, ``tape.jacobian(parallel_iterations=64)``, np.save)
  cold   ``jacobian compute`` with an empty ``JACOBIAN_CACHE_DIR`` (a new user, a new machine)
  floor  a process that only imports TensorFlow as our engine does and loads the SavedModel (``FLOOR``)
  warm   ``jacobian compute`` again with that cache (the plan from the cold run)
  later  (``--later N``) N more warm processes on that cache: a plan that tried a strategy in the warm one
Wall time from process start to exit and peak RSS (``wait4``'s ru_maxrss) of each process; our
rows are compared with the peer's (relative 1e-4). Goals (issue 10): peer/cold >= 2.5, peer/warm
>= 4, each of ours at most 0.5x the peer's peak RSS (issue 25: peer/cold >= 3, and JAX/warm >= 2 at no more than
JAX's RSS). Each goal's summary row gives, beside our median, the floor's (``floor``) and whether the floor meets
the goal (``reachable``): where the import and the load alone take more than a quarter of the script's time, or
more than half its memory, no TensorFlow process can meet the goal. Steady-state figures are printed beside.

``--service`` adds the service as its users run it: one redis-server and one API for the benchmark, and in each
run a fresh ``jacobian worker`` (its own empty cache, started and idle before the clock starts, as a deployed
worker is); its first job of the model (``svc1``: loads the model, no plan) and the next two (``svc2``, ``svc3``:
warm, model and plan in the process), each timed from POST to ``succeeded`` seen by polling every 10 ms, rows
compared with the peer's, and the worker's peak RSS (``VmHWM``) after them against the peer's.

Every run of ours must plan no chunk more than twice the largest chunk size it had timed (issue 25): the
manifest's ``plan.chunks_run`` says, per chunk size run, the largest size timed before it; the benchmark
fails otherwise. ``--hog N`` runs N busy CPU processes (``stress-ng --cpu N`` where installed, else Python
loops) beside every run, so that the plan can be seen not to explode under load. ``--model mlp`` (a
64-256-256-64 MLP, 2048 rows) is a smoke run of a few seconds.

Run: .venv/bin/python -m bench.bench_cold [--runs 3] [--hog 2] [--model mlp] [--jax] [--service] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import assert_same, chunk_growth_problems, cpu_hogs, emit, keep_off_the_gpu, machine
from tests.procs import base_env, jacobian_exe

REPO = Path(__file__).resolve().parents[1]
# The floor: a process that imports TensorFlow as our engine does (without Keras and JAX, the API's namespaces lazy:
# ``worker/engine/tf_import.py``; the collector off during the import, ``freeze_imports``) and loads the SavedModel,
# nothing else. Any process of ours that computes the Jacobian does at least this, so a goal this process misses
# (peer/floor < 4, floor RSS / peer's > 0.5) is out of reach of the engine as it imports TensorFlow.
FLOOR = ("import sys; from worker.engine.host_peak import freeze_imports; freeze_imports('worker.engine'); "
         "import tensorflow as tf; tf.saved_model.load(sys.argv[1])")
ARCHS = ("mobilenet_softmax", "mobilenet_logits", "efficientnet", "transformer", "lstm", "conv1d")


def timed_process(cmd: list[str], env: dict[str, str]) -> dict:
    """Run ``cmd`` to completion: wall seconds, peak RSS (MiB), exit code, stdout and stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    # communicate() has reaped the child; its rusage is folded into RUSAGE_CHILDREN's maximum, so each
    # process runs under /usr/bin/time-like accounting through a wrapper instead.
    return {"wall_s": round(wall, 2), "rc": proc.returncode, "stdout": out, "stderr": err}


def with_rss(cmd: list[str]) -> list[str]:
    """``cmd`` under a tiny wrapper that prints the child's peak RSS (wait4) as the last stderr line."""
    wrapper = ("import os,sys,subprocess;p=subprocess.Popen(sys.argv[1:]);"
               "_,st,ru=os.wait4(p.pid,0);sys.stderr.write('\\nPEAK_RSS_KB %d\\n'%ru.ru_maxrss);"
               "sys.exit(os.waitstatus_to_exitcode(st))")
    return [sys.executable, "-c", wrapper, *cmd]


def _ratio(a: float | None, b: float | None, digits: int) -> float | None:
    return None if a is None or b is None else round(a / b, digits)


def run(cmd: list[str], env: dict[str, str], what: str, *, allow_fail: bool = False) -> dict:
    res = timed_process(with_rss(cmd), env)
    m = re.search(r"PEAK_RSS_KB (\d+)", res["stderr"])
    res["peak_rss_mib"] = round(int(m.group(1)) / 1024) if m else None
    if res["rc"] != 0 and not allow_fail:
        raise SystemExit(f"{what} failed (exit {res['rc']}):\n{res['stderr'][-3000:]}")
    return res


def plan_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("plan:", "done:", "job "))]


def build_model(name: str, work: Path) -> tuple[Path, str, str]:
    """``(model folder, of, wrt)`` with ``work / "inputs.npz"`` written (and, for the architectures of
    ``bench/archs.py``, their weights in ``work / "weights.weights.h5"`` for the JAX peer)."""
    from bench import archs
    from tests import models

    keep_off_the_gpu()  # the peers and our processes are children: the GPU is theirs
    rng = np.random.default_rng(0)
    if name in archs.BUILDERS:
        import keras

        model = archs.build(name, keras)
        model.save_weights(str(work / "weights.weights.h5"))
        model.export(str(work / name), verbose=False)
        np.savez(work / "inputs.npz", x=rng.standard_normal((1,) + archs.INPUT_SHAPES[name]).astype("float32"))
        return work / name, "y", "x"
    if name == "mlp":
        np.savez(work / "inputs.npz", x=rng.standard_normal((32, 64)).astype("float32"))
        return models.mlp(work / "mlp", sizes=(64, 256, 256, 64)), "y", "x"
    np.savez(work / "inputs.npz", image=rng.standard_normal((1, 224, 224, 3)).astype("float32"))
    return models.mobilenet_v3_small(work / "mnv3"), "logits", "image"


def chunk_figures(manifest_path: Path, what: str) -> tuple[dict, list[str]]:
    """The largest chunk run and the largest size timed, from a run's manifest, the strategy, where the run's
    seconds went (``plan.time``: the run's wall, its calls', the calls at new sizes', the rest; a trial's wall);
    and its problems."""
    plan = json.loads(manifest_path.read_text()).get("plan") or {}
    runs = plan.get("chunks_run") or []
    figures = {"max_chunk": max((size for size, _ in runs), default=None),
               "max_timed": max(plan.get("timed_rows") or [0]), "kept": plan.get("chunk_rows"),
               "strategy": plan.get("strategy")}
    spent = plan.get("time") or {}
    if spent:
        figures["run_s"] = {"wall": spent.get("wall_s"), "calls": spent.get("calls_s"), "other": spent.get("other_s"),
                            "new_sizes": round(sum(c[4] for c in spent.get("calls", []) if c[2]), 3),
                            "trial": (plan.get("trial") or {}).get("wall_s")}
    return figures, chunk_growth_problems(plan, what)


def service_jobs(stack: Any, run_index: int, model: tuple[Path, str, str], work: Path, want: np.ndarray,
                 compared_with: str, rel: float) -> tuple[dict, list[str]]:
    """A fresh worker's first job of the model and two warm ones through the service: seconds (POST to
    ``succeeded``), the strategy and chunk of each, the worker's peak RSS after them; rows checked against
    ``want`` (``compared_with``) within ``rel``, as the processes' rows are."""
    import zarr

    model_dir, of, wrt = model
    name = f"w{run_index}"
    stack.start_worker(name)
    out: dict[str, Any] = {}
    problems: list[str] = []
    try:
        with np.load(work / "inputs.npz") as npz:
            inputs = {k: npz[k] for k in npz.files}
        for job in ("svc1", "svc2", "svc3"):
            res = stack.job(inputs, {"model_path": model_dir.name, "of": of, "wrt": wrt})
            folder = stack.work / "results" / res["id"]
            ours = np.asarray(zarr.open_array(str(folder / "result.zarr" / "jacobian"), mode="r")[:])
            assert_same(ours, want.reshape(ours.shape), f"{job} run {run_index}: ours (service) vs {compared_with}",
                        rel=rel)
            chunks, found = chunk_figures(folder / "manifest.json", f"{job} run {run_index}")
            problems += found
            out[job] = {"s": res["seconds"], "strategy": chunks["strategy"], "kept": chunks["kept"],
                        "max_chunk": chunks["max_chunk"], "max_timed": chunks["max_timed"]}
            shutil.rmtree(folder)
        out["worker_rss_MiB"] = stack.worker_peak_rss_mib(name)
    finally:
        stack.stop_worker(name)
    return out, problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--model", choices=("mobilenet", "mlp", *ARCHS), default="mobilenet",
                    help="mlp: a small MLP (2048 rows), a smoke run of a few seconds; the others: bench/archs.py")
    ap.add_argument("--jax", action="store_true",
                    help="also the JAX peer (bench/peer_jax_jacobian.py: Keras 3 on JAX, jit(vmap(vjp)) over 64 "
                         "rows), for the models of bench/archs.py")
    ap.add_argument("--hog", type=int, default=0, metavar="N",
                    help="N busy CPU processes beside every run (stress-ng --cpu N if installed, else Python loops)")
    ap.add_argument("--precision-probes", type=int, default=None, metavar="N",
                    help="JACOBIAN_PRECISION_PROBES for our runs (default: the service's, 3; 0 shows what the "
                         "precision estimate costs)")
    ap.add_argument("--later", type=int, default=0, metavar="N",
                    help="N more warm processes after the warm one (each run): what a plan still learning does next")
    ap.add_argument("--service", action="store_true",
                    help="also the service's jobs on a fresh worker: its first job and two warm ones (POST to done)")
    args = ap.parse_args()
    with cpu_hogs(args.hog) as hogs:
        if hogs:
            print(f"{args.hog} CPU hogs beside the benchmark: {' '.join(h.args[0] for h in hogs)} "
                  f"(pids {[h.pid for h in hogs]})", flush=True)
        bench(args)


def bench(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-cold-"))
    model_dir, of, wrt = build_model(args.model, work)
    env = base_env(**({} if args.precision_probes is None
                       else {"JACOBIAN_PRECISION_PROBES": str(args.precision_probes)}))
    problems: list[str] = []
    rows: list[dict] = []
    figures: dict[str, list] = {"peer": [], "cold": [], "warm": []}
    stack = None
    if args.service:
        from bench.bench_plans import Stack

        (work / "service").mkdir()
        stack = Stack(work / "service", model_dir.parent)
    try:
        _runs(args, work, (model_dir, of, wrt), env, stack, rows, figures, problems)
    finally:
        if stack is not None:
            stack.close()
    _summary(args, work, rows, figures, problems)


def _runs(args: argparse.Namespace, work: Path, model: tuple[Path, str, str], env: dict[str, str], stack: Any,
          rows: list[dict], figures: dict[str, list], problems: list[str]) -> None:
    model_dir, of, wrt = model
    peer_out = work / "peer.npy"
    for i in range(args.runs):
        peer = run([sys.executable, str(REPO / "bench" / "peer_tape_jacobian.py"), str(model_dir),
                    str(work / "inputs.npz"), str(peer_out), "--of", of, "--wrt", wrt], env, "peer", allow_fail=True)
        peer_failed = peer["rc"] != 0   # e.g. TensorFlow cannot differentiate a loaded LSTM's while loop
        peer_json = {} if peer_failed else json.loads(peer["stdout"].strip().splitlines()[-1])
        want = None if peer_failed else np.load(peer_out)
        jax_row: dict = {}
        jax = None
        if args.jax:
            jax_out = work / "jax.npy"
            jax = run([sys.executable, str(REPO / "bench" / "peer_jax_jacobian.py"), args.model,
                       str(work / "weights.weights.h5"), str(work / "inputs.npz"), str(jax_out)],
                      {**env, "KERAS_BACKEND": "jax"}, "JAX peer")
            got_jax = np.load(jax_out)
            if want is None:
                want = got_jax
            else:
                assert_same(got_jax.reshape(want.shape), want, f"run {i}: JAX vs tape.jacobian", rel=1e-3)
        if want is None:
            raise SystemExit(f"the tape.jacobian script failed and there is no JAX peer to compare with:\n"
                             f"{peer['stderr'][-2000:]}")
        floor = run([sys.executable, "-c", FLOOR, str(model_dir)], {**env, "PYTHONPATH": str(REPO)}, "the floor")
        cache = work / f"cache{i}"
        results = {}
        for phase in ("cold", "warm", *(f"later{j + 1}" for j in range(args.later))):
            job = f"{phase}{i}"
            res = run([*jacobian_exe(), "compute", "--model", str(model_dir), "--input", str(work / "inputs.npz"),
                       "--of", of, "--wrt", wrt, "--out", str(work / "results"), "--job-id", job],
                      {**env, "JACOBIAN_CACHE_DIR": str(cache)}, f"jacobian compute ({phase})")
            results[phase] = res
            import zarr

            ours = np.asarray(zarr.open_array(str(work / "results" / job / "result.zarr" / "jacobian"), mode="r")[:])
            assert_same(ours, want.reshape(ours.shape), f"{phase} run {i}: ours vs "
                        + ("the JAX peer" if peer_failed else "tape.jacobian"), rel=1e-3 if peer_failed else 1e-4)
            res["chunks"], found = chunk_figures(work / "results" / job / "manifest.json", f"{phase} run {i}")
            problems += found
            shutil.rmtree(work / "results" / job)
        if jax is not None:
            jax_row = {"jax_s": jax["wall_s"], "jax_rss_MiB": jax["peak_rss_mib"],
                       "jax/cold": round(jax["wall_s"] / results["cold"]["wall_s"], 2),
                       "jax/warm": round(jax["wall_s"] / results["warm"]["wall_s"], 2),
                       "warm_rss/jax": round(results["warm"]["peak_rss_mib"] / jax["peak_rss_mib"], 3),
                       "jax/floor": round(jax["wall_s"] / floor["wall_s"], 2),
                       "floor_rss/jax": round(floor["peak_rss_mib"] / jax["peak_rss_mib"], 3)}
        if peer_failed:
            last = [line for line in peer["stderr"].splitlines() if "Error" in line][-1:] or ["(no message)"]
            jax_row["peer_failed"] = last[0][:300]
        figures["peer"].append(peer)
        figures["cold"].append(results["cold"])
        figures["warm"].append(results["warm"])
        if peer_failed:   # no ratios against a peer that did not finish
            peer = {**peer, "wall_s": None, "peak_rss_mib": None}
        row = {"run": i + 1, "peer_s": peer["wall_s"], "peer_rss_MiB": peer["peak_rss_mib"],
               "peer_jacobian_s": peer_json.get("jacobian_s"),
               "cold_s": results["cold"]["wall_s"], "cold_rss_MiB": results["cold"]["peak_rss_mib"],
               "warm_s": results["warm"]["wall_s"], "warm_rss_MiB": results["warm"]["peak_rss_mib"],
               "peer/cold": _ratio(peer["wall_s"], results["cold"]["wall_s"], 2),
               "peer/warm": _ratio(peer["wall_s"], results["warm"]["wall_s"], 2),
               "cold_rss/peer": _ratio(results["cold"]["peak_rss_mib"], peer["peak_rss_mib"], 3),
               "warm_rss/peer": _ratio(results["warm"]["peak_rss_mib"], peer["peak_rss_mib"], 3),
               "floor_s": floor["wall_s"], "floor_rss_MiB": floor["peak_rss_mib"],
               "peer/floor": _ratio(peer["wall_s"], floor["wall_s"], 2),
               "floor_rss/peer": _ratio(floor["peak_rss_mib"], peer["peak_rss_mib"], 3),
               "cold_chunks": results["cold"]["chunks"], "warm_chunks": results["warm"]["chunks"], **jax_row}
        later = [results[f"later{j + 1}"] for j in range(args.later)]
        if later:   # processes after the warm one: a plan that keeps learning (a trial in the warm process)
            row.update({"later_s": [r["wall_s"] for r in later], "later_rss_MiB": [r["peak_rss_mib"] for r in later],
                        "peer/last": _ratio(peer["wall_s"], later[-1]["wall_s"], 2),
                        "last_chunks": later[-1]["chunks"]})
            if jax is not None:
                row["jax/last"] = round(jax["wall_s"] / later[-1]["wall_s"], 2)
        if stack is not None:
            svc, found = service_jobs(stack, i, model, work, want, "the JAX peer" if peer_failed else "tape.jacobian",
                                      rel=1e-3 if peer_failed else 1e-4)
            problems += found
            row.update({f"{job}_s": svc[job]["s"] for job in ("svc1", "svc2", "svc3")})
            row.update({"svc_worker_rss_MiB": svc["worker_rss_MiB"],
                        "peer/svc1": _ratio(peer["wall_s"], svc["svc1"]["s"], 2),
                        "peer/svc2": _ratio(peer["wall_s"], svc["svc2"]["s"], 2),
                        "svc_rss/peer": _ratio(svc["worker_rss_MiB"], peer["peak_rss_mib"], 3),
                        "svc_chunks": {job: svc[job] for job in ("svc1", "svc2", "svc3")}})
            if jax is not None:
                row.update({"jax/svc2": round(jax["wall_s"] / svc["svc2"]["s"], 2),
                            "svc_rss/jax": round(svc["worker_rss_MiB"] / jax["peak_rss_mib"], 3)})
        print(row, flush=True)
        for phase in ("cold", "warm"):
            for line in plan_lines(results[phase]["stderr"])[-3:]:
                print(f"  {phase}: {line[:300]}")
        rows.append(row)


def _summary(args: argparse.Namespace, work: Path, rows: list[dict], figures: dict[str, list],
             problems: list[str]) -> None:
    def med(key: str) -> float | None:
        values = [r[key] for r in rows if "run" in r and r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    def goal(what: str, key: str, bound: str, floor_key: str) -> dict:
        """A goal's median beside what the floor process (import and load, nothing else) would score: a goal
        the floor misses is out of reach of our engine as it imports TensorFlow, on this machine."""
        value, best = med(key), med(floor_key)
        above = bound.startswith(">=")
        limit = float(bound.split()[1])
        row = {"ratio": f"{what} (median)", "value": value, "goal": bound, "floor": best}
        if best is not None:
            row["reachable"] = best >= limit if above else best <= limit
        return row

    if args.jax:
        rows += [goal("JAX wall / ours warm wall", "jax/warm", ">= 2", "jax/floor"),
                 goal("ours warm peak RSS / JAX's", "warm_rss/jax", "<= 1", "floor_rss/jax")]
    rows += [
        goal("peer wall / ours cold wall", "peer/cold", ">= 3", "peer/floor"),
        goal("peer wall / ours warm wall", "peer/warm", ">= 4", "peer/floor"),
        goal("ours cold peak RSS / peer's", "cold_rss/peer", "<= 0.5", "floor_rss/peer"),
        goal("ours warm peak RSS / peer's", "warm_rss/peer", "<= 0.5", "floor_rss/peer"),
        {"steady": "peer tape.jacobian call alone (s, median)", "value": med("peer_jacobian_s")},
        *([{"ratio": f"peer wall / ours, the last of {args.later} later warm processes (median)",
            "value": med("peer/last")}] + ([{"ratio": "JAX wall / ours, the last later process (median)",
                                             "value": med("jax/last")}] if args.jax else []) if args.later else []),
        *([{"ratio": "peer wall / the service's first job on a fresh worker (median)", "value": med("peer/svc1")},
           {"ratio": "peer wall / the service's warm job (median)", "value": med("peer/svc2"), "goal": ">= 4"},
           {"ratio": "the service worker's peak RSS / peer's (median)", "value": med("svc_rss/peer"),
            "goal": "<= 0.5"}] if args.service else []),
        *([{"ratio": "JAX wall / the service's warm job (median)", "value": med("jax/svc2"), "goal": ">= 2"},
           {"ratio": "the service worker's peak RSS / JAX's (median)", "value": med("svc_rss/jax"), "goal": "<= 1"}]
          if args.service and args.jax else []),
        {"steady": "ours: last plan lines of the warm run",
         "value": plan_lines(figures["warm"][-1]["stderr"])[-1][:400]},
    ]
    rows.append({"check": "no chunk more than twice the largest size timed", "value": "ok" if not problems
                 else "; ".join(problems), "hogs": args.hog})
    print(machine())
    name = "cold_start_mobilenet_v3_small" if args.model == "mobilenet" else f"cold_start_{args.model}"
    name += ("_jax" if args.jax else "") + ("_service" if args.service else "")
    emit(name + (f"_hog{args.hog}" if args.hog else "")
         + ("" if args.precision_probes is None else f"_probes{args.precision_probes}"), rows, args.out)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print("kept", work)
    if problems:
        raise SystemExit("chunk plans grew past what was timed:\n" + "\n".join(problems))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
