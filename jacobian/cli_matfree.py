"""``jacobian compute``'s and ``submit``'s options of the matrix-free kinds (``--seeds``, ``--rank``, ``--tol``,
``--max-iterations``, ``--allow-unconverged``, ``--samples``) and
the seeds file they read; the kinds themselves run through ``jacobian.cli_compute`` like every other."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The matrix-free kinds' options of ``jacobian compute``."""
    p.add_argument("--seeds", metavar="FILE.npy", help="jvp, hvp: tangents (k,) + wrt.shape; vjp: cotangents "
                   "(k,) + of.shape (several wrt: (k, total wrt size))")
    p.add_argument("--rank", type=int, help="svd, hessian_eig: how many singular values / eigenpairs")
    p.add_argument("--tol", type=float, help="svd, hessian_eig: relative accuracy (default 1e-4)")
    p.add_argument("--max-iterations", type=int, metavar="N", help="svd, hessian_eig: iterations allowed to meet "
                   "--tol (svd: 200 subspace iterations; hessian_eig: max(20 rank, 100) Lanczos steps); not "
                   "converged within them, the job fails (NotConverged)")
    p.add_argument("--allow-unconverged", action="store_true", help="svd, hessian_eig: keep a result that did not "
                   "meet --tol within --max-iterations (marked converged: false) instead of failing")
    p.add_argument("--samples", type=int, help="hessian_trace: Hessian-vector products to spend (default 100)")


def load_seeds(path: str | None):
    import numpy as np

    if path is None:
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"--seeds: cannot read {path!r} as a .npy array ({err}); save it with numpy.save") from err
