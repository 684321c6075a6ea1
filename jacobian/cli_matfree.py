"""``jacobian compute``'s and ``jacobian submit``'s options of the matrix-free kinds (``--seeds``, ``--rank``,
``--tol``, ``--samples``, ``--probes``, ``--steps``, ``--sigma``, ``--damping``: the request fields) and the seeds
file they read; the kinds themselves run through ``jacobian.cli_compute`` like every other."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The matrix-free kinds' options of ``jacobian compute``."""
    p.add_argument("--seeds", metavar="FILE.npy", help="jvp, hvp: tangents (k,) + wrt.shape; vjp: cotangents "
                   "(k,) + of.shape (several wrt: (k, total wrt size))")
    p.add_argument("--rank", type=int, help="svd, hessian_eig: how many singular values / eigenpairs")
    p.add_argument("--tol", type=float, help="svd, hessian_eig: relative accuracy (default 1e-4)")
    p.add_argument("--samples", type=int, help="hessian_trace: Hessian-vector products to spend (default 100)")
    p.add_argument("--probes", type=int, help="hessian_diag: Rademacher probes (default 100; exact for a small wrt); "
                   "spectral_density, logdet: Lanczos start vectors (default 10)")
    p.add_argument("--steps", type=int, help="spectral_density, logdet: Lanczos steps per probe (default 50)")
    p.add_argument("--sigma", type=float, help="spectral_density: Gaussian smoothing width (default 1%% of the range "
                   "of the Ritz values)")
    p.add_argument("--damping", type=float, help="logdet: log det(H + damping I) (default 0)")


def kind_fields(args: argparse.Namespace) -> dict:
    """The kinds' own request fields (``rank``, ``tol``, ``samples``, ``probes``, ...) as the parsed flags give them."""
    from contracts.kinds import KIND_FIELDS

    return {name: getattr(args, name, None) for name in KIND_FIELDS}


def load_seeds(path: str | None):
    import numpy as np

    if path is None:
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"--seeds: cannot read {path!r} as a .npy array ({err}); save it with numpy.save") from err
