"""``jacobian compute --precision auto`` as a subprocess: a float32 model that loses digits is computed again in
float64, and the ``done:`` line says so with the estimate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import precision_models
from tests.e2e.test_cli_compute import jacobian_cli

pytestmark = pytest.mark.e2e


def test_compute_precision_auto_promotes_and_says_so(tmp_path: Path) -> None:
    model = precision_models.cancelling(tmp_path / "cancelling")
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32))
    out = tmp_path / "results"
    common = ("compute", "--model", str(model), "--input", str(tmp_path / "in.npz"), "--of", "y", "--wrt", "x",
              "--out", str(out))
    proc = jacobian_cli(*common, "--job-id", "plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.loads((out / "plain" / "manifest.json").read_text())
    assert plain["precision_error"] > 1e-5 and "precision_promoted" not in plain
    assert f"precision error ~{plain['precision_error']:.2g} (3 float64 probes)" in proc.stderr

    proc = jacobian_cli(*common, "--job-id", "auto", "--precision", "auto", "--output-dtype", "float64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    auto = json.loads((out / "auto" / "manifest.json").read_text())
    assert auto["precision_promoted"] is True and auto["dtype"] == "float64" and auto["precision_error"] < 1e-10
    assert "promoted to float64 (estimate was" in proc.stderr and "> tol 1e-05" in proc.stderr


def test_compute_refuses_an_unknown_precision(tmp_path: Path) -> None:
    proc = jacobian_cli("compute", "--model", str(tmp_path), "--input", str(tmp_path / "in.npz"), "--precision",
                        "float64")
    assert proc.returncode == 2 and "--precision" in proc.stderr and "auto" in proc.stderr
