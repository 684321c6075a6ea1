"""``jacobian compute`` as a subprocess: Zarr result and manifest on disk, exit 2 on a bad request."""

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

from tests import models

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def jacobian_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("jacobian", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "jacobian.cli"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(cmd + list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def multi_io_model(tmp_path_factory) -> Path:
    return models.multi_io(tmp_path_factory.mktemp("models") / "multi_io")


def test_compute_writes_zarr_equal_to_tape_jacobian(multi_io_model: Path, tmp_path: Path) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 4)).astype(np.float32)
    b = rng.normal(size=(2, 3)).astype(np.float32)
    np.savez(tmp_path / "in.npz", a=a, b=b)
    out = tmp_path / "results"
    proc = jacobian_cli("compute", "--model", str(multi_io_model), "--input", str(tmp_path / "in.npz"),
                        "--of", "v", "--wrt", "a", "--chunk-rows", "4", "--job-id", "cli1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    uri = proc.stdout.strip()
    assert uri == str(out / "cli1" / "result.zarr")
    assert "rows 6/6 (100.0%)" in proc.stderr and "\r" not in proc.stderr  # progress on stderr: plain lines

    loaded = tf.saved_model.load(str(multi_io_model))
    fn = loaded.signatures["serving_default"]
    at, bt = tf.constant(a), tf.constant(b)
    with tf.GradientTape() as tape:
        tape.watch(at)
        v = fn(a=at, b=bt)["v"]
    expected = tape.jacobian(v, at).numpy()
    got = zarr.open_array(uri + "/jacobian", mode="r")[:]
    assert got.shape == expected.shape == (2, 3, 2, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    manifest = json.loads((out / "cli1" / "manifest.json").read_text())
    assert manifest["id"] == "cli1" and manifest["uri"] == uri and manifest["shape"] == [2, 3, 2, 4]
    assert manifest["of"] == "v" and manifest["wrt"] == "a" and manifest["plan"]["chunk_rows"] == 4


def test_bad_wrt_exits_2_with_a_message_naming_wrt(multi_io_model: Path, tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", a=np.zeros((1, 4), np.float32), b=np.zeros((1, 3), np.float32))
    proc = jacobian_cli("compute", "--model", str(multi_io_model), "--input", str(tmp_path / "in.npz"),
                        "--of", "u", "--wrt", "nope", "--out", str(tmp_path / "results"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert "wrt" in proc.stderr and "nope" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_input_file_exits_2(multi_io_model: Path, tmp_path: Path) -> None:
    proc = jacobian_cli("compute", "--model", str(multi_io_model), "--input", str(tmp_path / "none.npz"),
                        "--out", str(tmp_path / "results"))
    assert proc.returncode == 2 and "--input" in proc.stderr and "Traceback" not in proc.stderr


def test_compute_sparsity_auto_then_pattern_from_and_a_dense_fallback(tmp_path: Path) -> None:
    import scipy.sparse as sp

    from tests import sparse_models

    conv = sparse_models.conv_net(tmp_path / "conv", size=20, channels=(3, 2))
    np.savez(tmp_path / "in.npz", image=np.random.default_rng(0).normal(size=(1, 20, 20, 3)).astype(np.float32))
    out = tmp_path / "results"
    base = ("compute", "--model", str(conv), "--input", str(tmp_path / "in.npz"), "--out", str(out))
    first = jacobian_cli(*base, "--sparsity", "auto", "--job-id", "sp1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "verified True" in first.stderr and first.stdout.strip() == str(out / "sp1" / "result.zarr")
    again = jacobian_cli(*base, "--sparsity", "pattern_from:sp1", "--job-id", "sp2")
    assert again.returncode == 0, again.stderr[-3000:]
    groups = [zarr.open_group(str(out / j / "result.zarr"), mode="r") for j in ("sp1", "sp2")]
    mats = [sp.coo_array((g["values"][:], (g["rows"][:], g["cols"][:])), shape=tuple(g.attrs["shape"])).toarray()
            for g in groups]
    np.testing.assert_array_equal(mats[0], mats[1])
    assert groups[1].attrs["sparsity"]["source"] == "pattern_from"

    mlp = sparse_models.mlp(tmp_path / "mlp")
    np.savez(tmp_path / "x.npz", x=np.ones((1, 6), np.float32))
    dense = jacobian_cli("compute", "--model", str(mlp), "--input", str(tmp_path / "x.npz"), "--out", str(out),
                         "--sparsity", "auto", "--job-id", "sp3")
    assert dense.returncode == 0, dense.stderr[-3000:]
    assert "sparsity: dense: the pattern holds 100.0%" in dense.stderr
    assert zarr.open_array(str(out / "sp3" / "result.zarr" / "jacobian"), mode="r").shape == (1, 3, 1, 6)
    wrong = jacobian_cli("compute", "--model", str(mlp), "--input", str(tmp_path / "x.npz"), "--out", str(out),
                         "--sparsity", "auto", "--kind", "batch_jacobian")
    assert wrong.returncode == 2 and "--sparsity: only for kind 'jacobian' or 'hessian'" in wrong.stderr


def test_several_wrt_for_the_dense_kinds_equal_gradient_tape(multi_io_model: Path, tmp_path: Path) -> None:
    """``--kind jacobian --wrt a b`` and ``--kind batch_jacobian --wrt a b`` (float32, 2e-5) and ``--kind hessian
    --wrt 'variables/*'`` (float64, 1e-9): one concatenated wrt axis, equal to GradientTape's blocks side by side."""
    import tensorflow as tf

    from tests.engine.reference import tape_jacobian
    from worker.engine import load_model

    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(2, 4)).astype(np.float32), rng.normal(size=(2, 3)).astype(np.float32)
    np.savez(tmp_path / "in.npz", a=a, b=b)
    out = tmp_path / "results"
    model = load_model(str(multi_io_model))
    for kind, job in (("jacobian", "j"), ("batch_jacobian", "bj")):
        proc = jacobian_cli("compute", "--model", str(multi_io_model), "--input", str(tmp_path / "in.npz"),
                            "--of", "v", "--wrt", "a", "b", "--kind", kind, "--job-id", job, "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = zarr.open_array(str(out / job / "result.zarr" / "jacobian"), mode="r")[...]
        batch = kind == "batch_jacobian"
        ja, jb = (tape_jacobian(model, {"a": a, "b": b}, "v", w, batch=batch) for w in ("a", "b"))
        want = np.concatenate([ja.reshape(2, 3, -1), jb.reshape(2, 3, -1)], axis=2)
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=2e-5, atol=2e-6)
        assert got.shape == ((2, 3, 7) if batch else (2, 3, 14))   # per example; the whole batch's inputs

    f64 = models.float64_model(tmp_path / "f64")
    x = rng.normal(size=(3, 5))
    np.savez(tmp_path / "x.npz", x=x)
    proc = jacobian_cli("compute", "--model", str(f64), "--input", str(tmp_path / "x.npz"), "--of", "loss",
                        "--wrt", "variables/*", "--kind", "hessian", "--job-id", "h", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    group = zarr.open_group(str(out / "h" / "result.zarr"), mode="r")
    loaded = load_model(str(f64))
    names = [n.split("/", 1)[1] for n in group.attrs["wrt"]]
    targets = [loaded.variables[n] for n in names]
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            y = loaded.fn(x=tf.constant(x))["loss"]
        flat = tf.concat([tf.reshape(g, [-1]) for g in inner.gradient(y, targets)], axis=0)
    want = np.concatenate([np.asarray(outer.jacobian(flat, t)).reshape(flat.shape[0], -1) for t in targets], axis=1)
    np.testing.assert_allclose(group["jacobian"][...], want, rtol=1e-9, atol=1e-12)
    assert "stacked/hvp" in proc.stderr


def test_cli_refusals_speak_the_cli(multi_io_model: Path, tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", a=np.ones((2, 4), np.float32), b=np.ones((2, 3), np.float32))
    base = ("compute", "--model", str(multi_io_model), "--input", str(tmp_path / "in.npz"), "--out", str(tmp_path))
    proc = jacobian_cli(*base, "--of", "v", "--kind", "svd", "--wrt", "a")
    assert proc.returncode == 2 and "--rank:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    proc = jacobian_cli(*base, "--of", "v", "--kind", "hessian", "--wrt", "a")
    assert proc.returncode == 2 and "--reduce sum" in proc.stderr and "reduce='sum'" not in proc.stderr, \
        proc.stderr[-2000:]


def test_compute_logdet_and_the_diagonal_with_their_flags(tmp_path: Path) -> None:
    """``--kind logdet --probes --steps --damping`` (unit start vectors: exact) and ``hessian_diag`` against the dense
    Hessian; a flag of another kind is refused in the command line's words, a damping too small fails naming it."""
    from tests.engine.reference import tape_hessian
    from worker.engine import load_model

    model = models.float64_model(tmp_path / "f64")
    x = np.random.default_rng(0).normal(size=(3, 5))
    np.savez(tmp_path / "in.npz", x=x)
    H = tape_hessian(load_model(str(model)), {"x": x}, "loss", "x").reshape(15, 15)
    damping = 1.0 - float(np.linalg.eigvalsh(H).min())
    base = ("compute", "--model", str(model), "--input", str(tmp_path / "in.npz"), "--out", str(tmp_path / "out"),
            "--of", "loss", "--wrt", "x")
    proc = jacobian_cli(*base, "--kind", "logdet", "--probes", "15", "--steps", "15", "--damping", str(damping))
    assert proc.returncode == 0, proc.stderr[-2000:]
    group = zarr.open_group(proc.stdout.strip(), mode="r")
    want = np.linalg.slogdet(H + damping * np.eye(15))[1]
    assert float(group["logdet"][...]) == pytest.approx(want, rel=1e-9) and float(group["stderr"][...]) == 0
    proc = jacobian_cli(*base, "--kind", "hessian_diag")
    assert proc.returncode == 0, proc.stderr[-2000:]
    group = zarr.open_group(proc.stdout.strip(), mode="r")
    np.testing.assert_allclose(group["diagonal"][...].ravel(), np.diag(H), rtol=1e-9, atol=1e-12)
    assert group.attrs["method"] == "exact"
    proc = jacobian_cli(*base, "--kind", "hessian_diag", "--damping", "1")
    assert proc.returncode == 2 and "--damping: only for kind 'ihvp' or 'logdet'" in proc.stderr, proc.stderr[-2000:]
    proc = jacobian_cli(*base, "--kind", "logdet", "--probes", "15", "--steps", "15", "--damping", "0")
    assert proc.returncode == 2 and "--damping: H + damping·I is not positive definite" in proc.stderr, \
        proc.stderr[-2000:]


def test_compute_on_a_keras_file_of_a_subclassed_model(tmp_path: Path) -> None:
    """``--model m.keras``: a subclassed model with a registered custom layer, its classes named through
    JACOBIAN_KERAS_CUSTOM_OBJECTS; the Jacobian equals GradientTape on the Keras model itself. Without the setting
    the run exits 2 naming the class and the setting."""
    import tensorflow as tf

    from tests import keras_models

    model = keras_models.subclassed(tmp_path / "sub.keras")
    x = np.random.default_rng(5).normal(size=(3, 3)).astype(np.float32)
    np.savez(tmp_path / "in.npz", inputs=x)
    args = ("compute", "--model", str(tmp_path / "sub.keras"), "--input", str(tmp_path / "in.npz"),
            "--job-id", "k1", "--out", str(tmp_path / "results"))
    refused = jacobian_cli(*args)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "'jt>TwoLayer'" in refused.stderr and "JACOBIAN_KERAS_CUSTOM_OBJECTS" in refused.stderr
    assert "Traceback" not in refused.stderr
    proc = jacobian_cli(*args, env={"JACOBIAN_KERAS_CUSTOM_OBJECTS": "tests.keras_custom", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = model(xt)
    expected = tape.jacobian(y, xt).numpy()
    got = zarr.open_array(proc.stdout.strip() + "/jacobian", mode="r")[:]
    assert got.shape == expected.shape == (3, 4, 3, 3)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_an_unconverged_svd_exits_2_unless_allowed_and_then_says_so(tmp_path: Path) -> None:
    """``--max-iterations 1`` cannot meet ``--tol 1e-12``: exit 2 with the residuals and the fixes in the command
    line's spelling; ``--allow-unconverged`` exits 0 and the ``done:`` line says NOT CONVERGED."""
    model = models.float64_model(tmp_path / "f64")
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).normal(size=(3, 5)))
    base = ("compute", "--model", str(model), "--input", str(tmp_path / "in.npz"), "--out", str(tmp_path / "out"),
            "--of", "y", "--wrt", "x", "--kind", "svd", "--rank", "3", "--tol", "1e-12", "--max-iterations", "1")
    proc = jacobian_cli(*base)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: svd: not converged within 1 iterations" in proc.stderr and "relative residuals [" in proc.stderr
    for fix in ("--max-iterations (now 1)", "--tol (now 1e-12", "--rank (now 3)", "--allow-unconverged"):
        assert fix in proc.stderr, proc.stderr[-2000:]
    assert "allow_unconverged" not in proc.stderr and "Traceback" not in proc.stderr
    proc = jacobian_cli(*base, "--allow-unconverged")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NOT CONVERGED, kept by --allow-unconverged: not converged" in proc.stderr
    manifest = json.loads((Path(proc.stdout.strip()).parent / "manifest.json").read_text())
    assert manifest["converged"] is False


def test_compute_a_sparse_hessian(tmp_path: Path) -> None:
    """``jacobian compute --kind hessian --sparsity auto`` (issue 27): the COO group equal to the tape Hessian."""
    import scipy.sparse as sp

    from tests import sparse_hessian_models
    from tests.engine.reference import tape_hessian
    from worker.engine import load_model

    path = sparse_hessian_models.separable(tmp_path / "sep", n=40, dtype="float64")
    x = np.random.default_rng(2).uniform(0.5, 1.5, 40)
    np.savez(tmp_path / "x.npz", x=x)
    out = tmp_path / "results"
    proc = jacobian_cli("compute", "--model", str(path), "--input", str(tmp_path / "x.npz"), "--out", str(out),
                        "--kind", "hessian", "--of", "f", "--wrt", "x", "--sparsity", "auto", "--job-id", "sh")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 118 non-zeros of 40 x 40" in proc.stderr and "from 3 star products, verified True" in proc.stderr
    group = zarr.open_group(str(out / "sh" / "result.zarr"), mode="r")
    got = sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])), shape=(40, 40)).toarray()
    want = tape_hessian(load_model(str(path)), {"x": x}, "f", "x")
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
