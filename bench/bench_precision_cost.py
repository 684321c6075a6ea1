"""What the precision guard (float64 probes, README "Precision") costs a whole ``jacobian compute`` process.

MobileNetV3Small with its softmax head (``bench/archs.py``), 1000 x 150528: one cold run makes the plan, then warm
processes alternate ``JACOBIAN_PRECISION_PROBES`` (3, the default, and 0: no estimate). Wall time and peak RSS
(``wait4``) of each process, and its own "since start" minus its compute seconds.

Run: .venv/bin/python -m bench.bench_precision_cost [--model mobilenet_softmax] [--rounds 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench.bench_cold import build_model, with_rss
from bench.common import emit
from tests.procs import base_env, jacobian_exe


def once(work: Path, model_dir: Path, of: str, wrt: str, probes: int) -> dict:
    env = base_env(JACOBIAN_CACHE_DIR=str(work / "cache"), JACOBIAN_PRECISION_PROBES=str(probes))
    cmd = with_rss([*jacobian_exe(), "compute", "--model", str(model_dir), "--input", str(work / "inputs.npz"),
                    "--of", of, "--wrt", wrt, "--out", str(work / "out")])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    rss = int(proc.stderr.strip().splitlines()[-1].split()[-1]) / 1024
    done = next((line for line in reversed((proc.stdout + proc.stderr).splitlines()) if line.startswith("done:")), "")
    found = re.search(r"in ([0-9.]+) s .*?, ([0-9.]+) s since start", done)
    outside = round(float(found.group(2)) - float(found.group(1)), 2) if found else None
    return {"probes": probes, "wall_s": round(wall, 2), "rss_MiB": round(rss), "rc": proc.returncode,
            "outside_compute_s": outside, "done": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_softmax")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-precision-"))
    model_dir, of, wrt = build_model(args.model, work)
    print("cold:", once(work, model_dir, of, wrt, 3), flush=True)
    rows = []
    for _ in range(args.rounds):
        for probes in (3, 0):
            rows.append(once(work, model_dir, of, wrt, probes))
            print(rows[-1], flush=True)
    emit(f"precision_cost_{args.model}", rows, args.out)


if __name__ == "__main__":
    main()
