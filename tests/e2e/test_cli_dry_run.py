"""``jacobian compute --dry-run``: the quote as JSON, exit 0, nothing computed or written; a guess before
the first run on this machine, the plan that run kept after it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from contracts.plan_predictions import first_call_sizes
from tests import models

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def jacobian_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("jacobian", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "jacobian.cli"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "JACOBIAN_CACHE_DIR": str(cache)}
    return subprocess.run(cmd + list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_compute_dry_run_prints_the_quote_and_computes_nothing(tmp_path: Path) -> None:
    model = models.mlp(tmp_path / "models" / "mlp")
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32))
    out, cache = tmp_path / "results", tmp_path / "cache"
    run = ("compute", "--model", str(model), "--input", str(tmp_path / "in.npz"), "--job-id", "j1", "--out", str(out))

    dry = jacobian_cli(*run, "--dry-run", cache=cache)
    assert dry.returncode == 0, dry.stderr[-3000:]
    quote = json.loads(dry.stdout)
    assert not out.exists() and not cache.exists()
    assert quote["of"] == "y" and quote["wrt"] == "x" and quote["passes"]["count"] == 256
    assert quote["arrays"][0]["shape"] == [64, 4, 64, 8] and quote["guess"] is True

    real = jacobian_cli(*run, cache=cache)
    assert real.returncode == 0, real.stderr[-3000:]
    assert quote["result_bytes"] == zarr.open_array(real.stdout.strip() + "/jacobian", mode="r").nbytes

    planned = json.loads(jacobian_cli(*run, "--dry-run", cache=cache).stdout)
    assert planned["guess"] is False and planned["basis"].startswith("persisted plan "), planned
    assert planned["predicted_peak_bytes"] > 0 and planned["predicted_seconds"] > 0
    # predicted_seconds: a fresh process (as every ``jacobian compute`` is), the steady chunks plus the plan's
    # measured first call (the trace) and, for each further chunk size it would call, that size's own first call
    (stored,) = (cache / "plans").glob("request-*.json")
    record = json.loads(stored.read_text())["strategies"][planned["strategy"]]
    assert record["compile_s"] is not None, record   # the cold run measured its first call
    sizes = first_call_sizes(planned["strategy"], 256, planned["predicted_chunk_rows"], timed=record["rates"])
    first = planned["predicted_seconds"] - planned["predicted_steady_seconds"]
    assert "fresh worker process" in planned["basis"]
    later = record["compile_s"] if planned["strategy"].endswith("+xla") else record.get("resize_s") or 0.0
    firsts = record["compile_s"] + later * (len(sizes) - 1)   # under XLA every size compiles
    if "finishes this job first" in planned["basis"]:   # a trial left a strategy cheaper to start: its time
        assert first < firsts, (planned, record)
    else:
        assert first == pytest.approx(firsts, abs=2e-4), (planned, record)


def test_compute_dry_run_refuses_what_a_run_refuses(tmp_path: Path) -> None:
    model = models.mlp(tmp_path / "models" / "mlp")
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 8), np.float32))
    proc = jacobian_cli("compute", "--model", str(model), "--input", str(tmp_path / "in.npz"), "--of", "nope",
                        "--out", str(tmp_path / "results"), "--dry-run", cache=tmp_path / "cache")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --of"), proc.stderr
