"""The options of the matrix-free kinds for ``jacobian compute`` and ``jacobian submit`` (``--seeds``, ``--rank``,
``--tol``, ``--samples``; the curvature kinds' ``--loss``, ``--labels``, ``--damping``, ``--curvature``,
``--max-iterations``: each the request field of its name) and the seeds file they read; the kinds themselves run
through ``jacobian.cli_compute`` like every other."""

from __future__ import annotations

import argparse
from typing import Any

from contracts.kinds import CURVATURES, KIND_FIELDS, LOSSES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The matrix-free kinds' options of ``jacobian compute``."""
    p.add_argument("--seeds", metavar="FILE.npy", help="jvp, hvp: tangents (k,) + wrt.shape; vjp: cotangents "
                   "(k,) + of.shape (several wrt: (k, total wrt size))")
    p.add_argument("--rank", type=int, help="svd, hessian_eig: how many singular values / eigenpairs")
    p.add_argument("--tol", type=float, help="svd, hessian_eig: relative accuracy (default 1e-4)")
    p.add_argument("--samples", type=int, help="hessian_trace, ggn_trace: products to spend (default 100)")
    p.add_argument("--loss", choices=LOSSES, help="ggn_vp, fisher_vp, ggn_eig, ggn_trace, ihvp --curvature ggn: the "
                   "loss on --of (its Gauss-Newton matrix, or its empirical Fisher)")
    p.add_argument("--labels", metavar="NAME", help="fisher_vp: the member of the --input .npz that holds the labels")
    p.add_argument("--damping", type=float, help="ihvp: solve (A + damping I) x = v, damping > 0")
    p.add_argument("--curvature", choices=tuple(CURVATURES), help="ihvp: the matrix A (default hessian)")
    p.add_argument("--max-iterations", type=int, metavar="N", help="ihvp: conjugate-gradient iterations per seed "
                   "before the run fails as not converged (default 1000)")


def kind_options(args: argparse.Namespace) -> dict[str, Any]:
    """The kinds' own request fields (``contracts.kinds.KIND_FIELDS``) from their flags, of the same names."""
    return {name: getattr(args, name, None) for name in KIND_FIELDS}


def load_seeds(path: str | None):
    import numpy as np

    if path is None:
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"--seeds: cannot read {path!r} as a .npy array ({err}); save it with numpy.save") from err
