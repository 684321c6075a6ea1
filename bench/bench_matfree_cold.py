"""Matrix-free kinds (issue 14) as a user runs them: whole processes, cold (a fresh ``JACOBIAN_CACHE_DIR``)
and warm (the same folder again), against the dense route run the same way in the same run.

1. svd, rank 10, of MobileNetV3Small's logits w.r.t. one 224x224x3 image (``weights=None``):
   ``jacobian compute --kind svd`` against ``bench/peer_dense_svd.py`` (load, ``tape.jacobian``, numpy svd);
   the singular values compared. Ours cold, warm (the same request: kept traces and the kept singular vectors
   as its start) and warm on another image (the kept traces; the start vectors of the first image).
2. hessian_eig (rank 5) and hessian_trace (99 samples) of a classification loss over every trainable variable
   of an MLP 784-128-128-10 (118,282 parameters; its dense Hessian, 56 GB in float32, is no peer on this
   machine): ``jacobian compute`` cold and warm.

Wall time from process start to exit and peak RSS (``os.wait4``) per process.
Run: .venv/bin/python -m bench.bench_matfree_cold [--skip-mobilenet] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_sparse import timed_process
from bench.common import emit, machine


def _s_values(uri: str) -> np.ndarray:
    import zarr

    return np.asarray(zarr.open_group(uri, mode="r")["S"][...], np.float64)


def _attrs(uri: str) -> dict[str, Any]:
    import zarr

    return dict(zarr.open_group(uri, mode="r").attrs)


def mobilenet_rows(root: Path, rank: int = 10) -> list[dict[str, Any]]:
    from tests import models

    model = models.mobilenet_v3_small(root / "mobilenet")
    inputs = root / "image.npz"
    np.savez(inputs, image=np.random.default_rng(0).standard_normal((1, 224, 224, 3)).astype("float32"))
    jacobian = str(Path(sys.executable).with_name("jacobian"))
    env = {**os.environ, "JACOBIAN_CACHE_DIR": str(root / "cache_svd")}
    ours = [jacobian, "compute", "--model", str(model), "--input", str(inputs), "--out", str(root / "res"),
            "--kind", "svd", "--rank", str(rank), "--of", "logits", "--wrt", "image"]
    peer = [sys.executable, str(Path(__file__).with_name("peer_dense_svd.py")), str(model), str(inputs),
            str(root / "peer_s.npy"), "--rank", str(rank), "--of", "logits", "--wrt", "image"]
    rows = []
    runs = {"peer": timed_process(peer, dict(os.environ))}
    runs["peer"]["uri"] = str(root / "peer_s.npy")
    rows.append({"what": "dense route (tape.jacobian + numpy svd), whole process", **runs["peer"]})
    print(rows[-1], flush=True)
    other = root / "image_other.npz"
    np.savez(other, image=np.random.default_rng(1).standard_normal((1, 224, 224, 3)).astype("float32"))
    for label in ("cold", "warm", "warm_other_image"):
        args = ours if label != "warm_other_image" else [str(other) if a == str(inputs) else a for a in ours]
        runs[label] = timed_process(args + ["--job-id", f"svd_{label}"], env)
        attrs = _attrs(runs[label]["uri"])
        rows.append({"what": f"jacobian compute --kind svd --rank {rank}, {label}", **runs[label],
                     "iterations": attrs.get("iterations"), "start": attrs.get("start")})
        print(rows[-1], flush=True)
    for label in ("warm", "warm_other_image"):
        rows.append({"what": f"svd {label} / cold (issue 24's goal for warm: at most 0.5)",
                     "ratio": round(runs[label]["s"] / runs["cold"]["s"], 2)})
        print(rows[-1], flush=True)
    want = np.load(runs["peer"]["uri"]).astype(np.float64)
    for label in ("cold", "warm"):
        got = _s_values(runs[label]["uri"])
        rows.append({"what": f"svd {label}: peer / ours", "ratio": round(runs["peer"]["s"] / runs[label]["s"], 2),
                     "rss_ours_over_peer": round(runs[label]["rss_GiB"] / runs["peer"]["rss_GiB"], 2),
                     "max_rel_error_S": f"{float(np.max(np.abs(got - want) / want)):.2g}"})
        print(rows[-1], flush=True)
    return rows


def hessian_rows(root: Path, batch: int = 256) -> list[dict[str, Any]]:
    from tests import models

    model = models.softmax_mlp(root / "mlp784", sizes=(784, 128, 128, 10))
    rng = np.random.default_rng(0)
    inputs = root / "batch.npz"
    np.savez(inputs, x=rng.standard_normal((batch, 784)).astype("float32"),
             labels=rng.integers(0, 10, batch).astype("int32"))
    jacobian = str(Path(sys.executable).with_name("jacobian"))
    env = {**os.environ, "JACOBIAN_CACHE_DIR": str(root / "cache_hessian")}
    base = [jacobian, "compute", "--model", str(model), "--input", str(inputs), "--out", str(root / "res"),
            "--of", "loss", "--wrt", "variables/*"]
    rows = []
    for kind, extra in (("hessian_eig", ["--rank", "5"]), ("hessian_trace", ["--samples", "99"])):
        for label in ("cold", "warm"):
            run = timed_process(base + ["--kind", kind, *extra, "--job-id", f"{kind}_{label}"], env)
            manifest = json.loads((Path(run["uri"]).parent / "manifest.json").read_text())
            plan = manifest["plan"]
            rows.append({"what": f"jacobian compute --kind {kind} {' '.join(extra)}, {label}", **run,
                         "hvps": plan["products"].get("hvp"), "iterations": plan["iterations"],
                         "residuals": [float(f"{r:.3g}") for r in manifest.get("residuals", [])]})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-mobilenet", action="store_true")
    parser.add_argument("--skip-hessian", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not args.skip_hessian:
            emit("matfree_cold_hessian", hessian_rows(root), args.out)
        if not args.skip_mobilenet:
            emit("matfree_cold_svd", mobilenet_rows(root), args.out)


if __name__ == "__main__":
    main()
