"""The options of the matrix-free kinds for ``jacobian compute`` and ``jacobian submit`` (``--seeds``, ``--rank``,
``--tol``, ``--max-iterations``, ``--allow-unconverged``, ``--samples``; the curvature kinds' ``--loss``,
``--labels``, ``--damping``, ``--curvature``, ``--precondition``; ``--probes``, ``--steps``, ``--sigma``: each the
request field of its name) and the seeds file they read; the kinds themselves run through ``jacobian.cli_compute``
like every other."""

from __future__ import annotations

import argparse
from typing import Any

from contracts.kinds import CURVATURES, KIND_FIELDS, LOSSES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The matrix-free kinds' options of ``jacobian compute``."""
    p.add_argument("--seeds", metavar="FILE.npy", help="jvp, hvp: tangents (k,) + wrt.shape; vjp: cotangents "
                   "(k,) + of.shape (several wrt: (k, total wrt size))")
    p.add_argument("--rank", type=int, help="svd, hessian_eig, ggn_eig: how many singular values / eigenpairs")
    p.add_argument("--tol", type=float, help="svd, hessian_eig, ggn_eig: relative accuracy (default 1e-4); ihvp: "
                   "relative residual (default 1e-5)")
    p.add_argument("--max-iterations", type=int, metavar="N", help="svd, hessian_eig, ggn_eig, ihvp: iterations "
                   "allowed to meet --tol (svd: 200 subspace iterations; hessian_eig, ggn_eig: max(20 rank, 100) "
                   "Lanczos steps; ihvp: conjugate-gradient iterations per seed, 1000); not converged within them, "
                   "the job fails (NotConverged)")
    p.add_argument("--allow-unconverged", action="store_true", help="svd, hessian_eig, ggn_eig: keep a result that "
                   "did not meet --tol within --max-iterations (marked converged: false) instead of failing")
    p.add_argument("--samples", type=int, help="hessian_trace, ggn_trace: products to spend (default 100)")
    p.add_argument("--loss", choices=LOSSES, help="ggn_vp, fisher_vp, ggn_eig, ggn_trace, ggn_diag, ihvp "
                   "--curvature ggn: the loss on --of (its Gauss-Newton matrix, or its empirical Fisher)")
    p.add_argument("--labels", metavar="NAME", help="fisher_vp: the member of the --input .npz that holds the labels")
    p.add_argument("--damping", type=float, help="ihvp: solve (A + damping I) x = v, damping > 0; logdet: log det(H "
                   "+ damping I) (default 0)")
    p.add_argument("--probes", type=int, help="hessian_diag, ggn_diag: Rademacher probes (default 100; exact for a "
                   "small wrt); spectral_density, logdet: Lanczos start vectors (default 10)")
    p.add_argument("--steps", type=int, help="spectral_density, logdet: Lanczos steps per probe (default 50)")
    p.add_argument("--sigma", type=float, help="spectral_density: Gaussian smoothing width (default 1%% of the range "
                   "of the Ritz values)")
    p.add_argument("--curvature", choices=tuple(CURVATURES), help="ihvp: the matrix A (default hessian)")
    p.add_argument("--precondition", choices=("none", "diagonal"), help="ihvp: 'diagonal' for Jacobi-preconditioned "
                   "CG (the diagonal exact for a wrt of at most 64 elements, else 100 Hutchinson probes; those "
                   "products counted); default none")


def kind_options(args: argparse.Namespace) -> dict[str, Any]:
    """The kinds' own request fields (``contracts.kinds.KIND_FIELDS``) from their flags, of the same names (an
    unset switch such as ``--allow-unconverged`` is left out, as None)."""
    return {name: (None if getattr(args, name, None) is False else getattr(args, name, None)) for name in KIND_FIELDS}


def load_seeds(path: str | None):
    import numpy as np

    if path is None:
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"--seeds: cannot read {path!r} as a .npy array ({err}); save it with numpy.save") from err
