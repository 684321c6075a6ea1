"""When an iterative spectrum has converged, and what a run that did not says: pure numpy, shared by the
spectral kinds (``worker.engine.spectra``) and the solvers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from contracts.kinds import kind_spec
from worker.engine.errors import NotConverged


def converged(values: np.ndarray, residuals: np.ndarray, tol: float, dtype: str) -> bool:
    """The stopping rule of ``svd`` and ``hessian_eig`` (module docstring): absolute ``residuals``."""
    scale = np.abs(values)
    floor = 100 * float(np.finfo(dtype).eps) * (float(scale.max()) if scale.size else 0.0)
    return bool(np.all(residuals <= np.maximum(tol * scale, floor)))


def relative(residuals: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``residuals / |values|``, a zero value's residual measured against the largest value instead."""
    scale = np.abs(values).astype(np.float64)
    floor = float(scale.max()) if scale.size and scale.max() > 0 else 1.0
    return residuals / np.where(scale > 0, scale, floor)


def worst(values: np.ndarray, residuals: np.ndarray, tol: float, dtype: str) -> float:
    """The largest ratio of a residual to what ``_converged`` allows it (below 1 for every value: converged)."""
    scale = np.abs(values)
    floor = 100 * float(np.finfo(dtype).eps) * (float(scale.max()) if scale.size else 0.0)
    allowed = np.maximum(tol * scale, floor)
    return float(np.max(residuals / np.where(allowed > 0, allowed, np.finfo(np.float64).tiny)))


def stalled(history: list[float], left: int, window: int = 4) -> bool:
    """Whether the residual ratios of the last ``window`` iterations shrink too slowly to reach 1 within half of
    the ``left`` iterations (or do not shrink): then the block is widened."""
    if len(history) <= window:
        return False
    now, before = history[-1], history[-1 - window]
    if not (np.isfinite(now) and np.isfinite(before)) or before <= 0:
        return False
    rate = (now / before) ** (1.0 / window)
    if rate >= 1.0:
        return True
    return math.log(now) / -math.log(rate) > left / 2


def not_converged(kind: str, relative: np.ndarray, *, tol: float, rank: int, limit: int, how: str) -> NotConverged:
    """The ``NotConverged`` of a spectrum: its relative residuals against ``tol`` and the three ways out."""
    relative = np.asarray(relative, np.float64)
    shown = ", ".join(f"{r:.2g}" for r in relative)
    worst = float(relative.max()) if relative.size else float("inf")
    loose = f"{min(0.49, worst * 1.5):.1g}" if np.isfinite(worst) else "larger"
    counted = kind_spec(kind).spectrum.counted if kind_spec(kind).spectrum else "values"
    return NotConverged(
        f"{kind}: not converged within {limit} iterations ({how}): relative residuals [{shown}] of the {rank} "
        f"{counted} against tol {tol:g}; raise max_iterations (now {limit}), loosen tol (now {tol:g}; these "
        f"residuals meet {loose}) or ask for a smaller rank (now {rank}); or set allow_unconverged: true to keep "
        "this result, marked unconverged", residuals=[float(r) for r in relative])


def unconverged_attrs(converged: bool, relative: np.ndarray, tol: float) -> dict[str, Any]:
    """What an unconverged result allowed by ``allow_unconverged`` says of itself (nothing when converged)."""
    if converged:
        return {}
    worst = float(np.max(relative)) if np.size(relative) else float("nan")
    return {"allow_unconverged": True,
            "warning": f"not converged: the largest relative residual is {worst:.2g}, above tol {tol:g} "
                       "(kept because allow_unconverged was set)"}
