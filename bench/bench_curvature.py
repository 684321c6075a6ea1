"""Curvature kinds (issue 27) as a user runs them: whole ``jacobian compute`` processes, cold (a fresh
``JACOBIAN_CACHE_DIR`` per kind) and warm (the same folder again), on a classifier of 1,333,770 parameters.

The model: an MLP 784-1024-512-10 (tanh) built here from Keras ``Dense`` layers with random weights (Glorot,
``keras.utils.set_random_seed(0)``) inside a ``tf.Module`` whose signature takes ``x`` (None, 784) float32 and
``labels`` (None,) int32 and returns ``logits`` and ``loss`` (mean sparse softmax cross-entropy), saved with
``tf.saved_model.save`` as ``tests/models.py`` does. A batch of 128 standard normal inputs with random labels in
0..9. Every kind w.r.t. ``--wrt 'variables/*'`` (all 1,333,770 parameters):

1. ``ggn_eig`` top 5 of the Gauss-Newton matrix G of ``--loss softmax_cross_entropy`` on ``logits``;
2. ``ihvp --curvature ggn`` of 4 random normal seeds, ``damping = lambda_max(G) / 100`` with ``lambda_max(G)``
   the top eigenvalue step 1 found (so the damped matrix' condition number is at most 101 and conjugate
   gradients meet the default ``tol`` 1e-5 in some tens of iterations; ``--ihvp-damping`` fixes it instead);
3. ``hessian_diag`` of ``loss``, Hutchinson with 100 probes;
4. ``spectral_density`` of the Hessian of ``loss``, stochastic Lanczos quadrature, 10 probes x 50 steps;
5. ``logdet`` of (H + damping I), 10 probes x 50 steps: H of an untrained classifier is indefinite, so
   ``damping = 2 max(0, -theta_min) + 1e-3 theta_max`` with ``theta`` the Ritz values step 4 found (the same
   probes, seeds fixed at 0: the same Ritz values, so every shifted one is positive; ``--logdet-damping``
   fixes it instead).

Per process: wall time from start to exit and peak RSS (``os.wait4``, ``bench.bench_sparse.timed_process``),
the products spent and the iterations (the manifest's ``plan``), and what it found (eigenvalues, residuals, the
estimate and its standard error). Then the table. The sparse Hessian part of issue 27's benchmark is not here:
no sparse Hessian kind exists yet (the script says so).

Run (the full benchmark; about 10 processes one after the other, results in bench/results/curvature.json):
    .venv/bin/python -m bench.bench_curvature [--out bench/results] [--kinds ggn_eig,ihvp,...]
Check that it works end to end on a tiny model (MLP 32-16-10, batch 16; no result file unless --out):
    .venv/bin/python -m bench.bench_curvature --small
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

KINDS = ("ggn_eig", "ihvp", "hessian_diag", "spectral_density", "logdet")   # in this order: 2 and 5 use 1 and 4
FULL = {"sizes": (784, 1024, 512, 10), "batch": 128}
SMALL = {"sizes": (32, 16, 10), "batch": 16}
SPARSE_NOTE = ("sparse Hessian of a partially separable function of 1e5 variables (issue 27): not benchmarked "
               "here, no sparse Hessian kind exists yet")


def classifier(path: Path, sizes: tuple[int, ...], seed: int = 0) -> tuple[Path, int]:
    """An MLP classifier of Keras ``Dense`` layers (tanh, random weights) as a SavedModel: ``x`` (None, sizes[0])
    float32 and ``labels`` (None,) int32 -> ``logits`` (None, sizes[-1]) and ``loss`` (), the mean sparse
    softmax cross-entropy. Returns the path and the number of parameters."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(seed)

    class Classifier(tf.Module):
        def __init__(self):
            super().__init__()
            self.dense = [keras.layers.Dense(n, activation="tanh" if i < len(sizes) - 2 else None, name=f"d{i}")
                          for i, n in enumerate(sizes[1:])]
            width = sizes[0]
            for layer in self.dense:
                layer.build((None, width))
                width = layer.units

        @tf.function(input_signature=[tf.TensorSpec([None, sizes[0]], tf.float32, name="x"),
                                      tf.TensorSpec([None], tf.int32, name="labels")])
        def __call__(self, x, labels):
            h = x
            for layer in self.dense:
                h = layer(h)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h))
            return {"logits": h, "loss": loss}

    m = Classifier()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path, sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def _group(uri: str) -> Any:
    import zarr

    return zarr.open_group(uri, mode="r")


def _num(x: Any) -> float:
    return float(f"{float(x):.4g}")


def found(kind: str, uri: str) -> dict[str, Any]:
    """What the run computed, from its result group: the values a reader checks, in a few numbers."""
    g = _group(uri)
    if kind == "ggn_eig":
        return {"eigenvalues": [_num(v) for v in g["eigenvalues"][...]]}
    if kind == "ihvp":
        return {"residuals": [float(f"{r:.3g}") for r in g["residuals"][...]],
                "cg_iterations": [int(i) for i in g["iterations"][...]]}
    if kind == "hessian_diag":
        diag, err = np.asarray(g["diagonal"][...], np.float64), np.asarray(g["stderr"][...], np.float64)
        return {"method": g.attrs.get("method"), "diag_mean": _num(diag.mean()),
                "diag_abs_max": _num(np.abs(diag).max()), "stderr_median": _num(np.median(err))}
    if kind == "spectral_density":
        nodes = np.asarray(g["nodes"][...], np.float64)
        return {"ritz_min": _num(np.nanmin(nodes)), "ritz_max": _num(np.nanmax(nodes)),
                "sigma": _num(g.attrs.get("sigma"))}
    if kind == "logdet":
        return {"logdet": _num(g["logdet"][...]), "stderr": _num(g["stderr"][...])}
    return {}


def run_kind(kind: str, base: list[str], extra: list[str], root: Path) -> list[dict[str, Any]]:
    """``kind`` cold (a fresh cache folder of its own) then warm (the same folder): one row per process."""
    env = {**os.environ, "JACOBIAN_CACHE_DIR": str(root / f"cache_{kind}")}
    rows = []
    for label in ("cold", "warm"):
        run = timed_process(base + ["--kind", kind, *extra, "--job-id", f"{kind}_{label}"], env)
        manifest = json.loads((Path(run["uri"]).parent / "manifest.json").read_text())
        plan = manifest.get("plan") or {}
        shown = " ".join(Path(a).name if a.startswith(str(root)) else a for a in extra)   # no temporary folder
        rows.append({"kind": kind, "run": label, "args": shown, "s": run["s"], "rss_GiB": run["rss_GiB"],
                     "products": plan.get("products"), "iterations": plan.get("iterations"),
                     "run_seconds": plan.get("run_seconds"), **found(kind, run["uri"]), "uri": run["uri"]})
        print(rows[-1], flush=True)
    rows.append({"kind": kind, "run": "warm / cold", "ratio": round(rows[1]["s"] / rows[0]["s"], 2)})
    return rows


def curvature_rows(root: Path, *, sizes: tuple[int, ...], batch: int, kinds: tuple[str, ...],
                   ihvp_damping: float | None, logdet_damping: float | None) -> list[dict[str, Any]]:
    model, n_params = classifier(root / "classifier", sizes)
    rng = np.random.default_rng(0)
    inputs = root / "batch.npz"
    np.savez(inputs, x=rng.standard_normal((batch, sizes[0])).astype("float32"),
             labels=rng.integers(0, sizes[-1], batch).astype("int32"))
    seeds = root / "seeds.npy"
    np.save(seeds, rng.standard_normal((4, n_params)).astype("float32"))
    jacobian = str(Path(sys.executable).with_name("jacobian"))
    base = [jacobian, "compute", "--model", str(model), "--input", str(inputs), "--out", str(root / "res"),
            "--wrt", "variables/*"]
    ggn = ["--of", "logits", "--loss", "softmax_cross_entropy"]
    rows: list[dict[str, Any]] = [{"model": f"MLP {'-'.join(map(str, sizes))} (tanh, Keras Dense, random weights)",
                                   "parameters": n_params, "batch": batch, "wrt": "variables/*"}]
    print(rows[0], flush=True)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for kind in kinds:
        if kind == "ggn_eig":
            extra = [*ggn, "--rank", "5"]
        elif kind == "ihvp":
            damping = ihvp_damping
            if damping is None:   # lambda_max(G) / 100: condition number at most 101
                damping = float(f"{abs(by_kind['ggn_eig'][0]['eigenvalues'][0]) / 100:.3g}")
            extra = [*ggn, "--curvature", "ggn", "--damping", str(damping), "--seeds", str(seeds)]
        elif kind == "hessian_diag":
            extra = ["--of", "loss", "--probes", "100"]
        elif kind == "spectral_density":
            extra = ["--of", "loss", "--probes", "10", "--steps", "50"]
        elif kind == "logdet":
            damping = logdet_damping
            if damping is None:   # above the least Ritz value of the same probes: every shifted one positive
                sd = by_kind["spectral_density"][0]
                damping = float(f"{2 * max(0.0, -sd['ritz_min']) + 1e-3 * abs(sd['ritz_max']):.3g}")
            extra = ["--of", "loss", "--probes", "10", "--steps", "50", "--damping", str(damping)]
        else:
            raise ValueError(f"unknown kind {kind!r}")
        by_kind[kind] = run_kind(kind, base, extra, root)
        rows.extend(by_kind[kind])
    rows.append({"note": SPARSE_NOTE})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The runs as a Markdown table: kind, run, whole-process seconds, peak RSS, products, iterations, result."""
    out = ["| kind | run | args | s | peak RSS GiB | products | iterations | result |",
           "| --- | --- | --- | ---: | ---: | --- | ---: | --- |"]
    for r in rows:
        if "run" not in r or "s" not in r:
            continue
        shown = {k: v for k, v in r.items() if k not in {"kind", "run", "args", "s", "rss_GiB", "products",
                                                         "iterations", "run_seconds", "uri"}}
        products = ", ".join(f"{k} {v}" for k, v in (r.get("products") or {}).items())
        result = "; ".join(f"{k} {v}" for k, v in shown.items())
        out.append(f"| {r['kind']} | {r['run']} | `{r['args']}` | {r['s']} | {r['rss_GiB']} | {products} | "
                   f"{r['iterations']} | {result} |")
    ratios = [f"{r['kind']} {r['ratio']}" for r in rows if r.get("run") == "warm / cold"]
    return "\n".join(out + ["", "warm / cold wall time: " + ", ".join(ratios)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (MLP 32-16-10, batch 16) to check the "
                        "script end to end; writes no result file unless --out is given")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated, in order (default {','.join(KINDS)})")
    parser.add_argument("--ihvp-damping", type=float, help="default: ggn_eig's top eigenvalue / 100")
    parser.add_argument("--logdet-damping", type=float, help="default: 2 max(0, -least Ritz value) + 1e-3 largest, "
                        "from spectral_density")
    parser.add_argument("--out", default=None,
                        help="folder of curvature.json (default bench/results; none for --small)")
    args = parser.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: unknown kind {kind!r}; choose among {', '.join(KINDS)}")
    for kind, source, flag in (("ihvp", "ggn_eig", "--ihvp-damping"), ("logdet", "spectral_density",
                                                                      "--logdet-damping")):
        if kind in kinds and getattr(args, flag[2:].replace("-", "_")) is None and (
                source not in kinds or kinds.index(source) > kinds.index(kind)):
            parser.error(f"--kinds: {kind}'s damping comes from {source}; list {source} before {kind} "
                         f"(--kinds {source},{kind}) or give {flag}")
    out = args.out if args.out or args.small else str(Path(__file__).with_name("results"))
    config = SMALL if args.small else FULL
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = curvature_rows(Path(tmp), sizes=config["sizes"], batch=config["batch"],
                              kinds=kinds,
                              ihvp_damping=args.ihvp_damping, logdet_damping=args.logdet_damping)
    for r in rows:
        r.pop("uri", None)   # a temporary folder, gone
    emit("curvature_small" if args.small else "curvature", rows, out)
    print()
    print(table(rows))
    print()
    print(SPARSE_NOTE)


if __name__ == "__main__":
    main()
