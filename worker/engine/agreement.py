"""Whether computed rows agree with their references: rows against eager rows (``rows_agree``), a forward-mode
probe against a reverse-mode product by the dot-product test (``agrees``, ``Adjoint``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

TF32_TOLERANCE = 1e-2


def tf32_enabled() -> bool:
    tf = sys.modules.get("tensorflow")
    return bool(tf is not None and tf.config.experimental.tensor_float_32_execution_enabled())


def rows_agree(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal up to 1e-4 (1e-3 for 16-bit floats, 1e-2 with TensorFloat-32 on) of ``want``'s largest finite
    magnitude, with NaN and infinities in the same places (``tape.jacobian`` of ``sqrt`` at 0 is inf, and so
    must ours be)."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    if not np.array_equal(np.isposinf(a), np.isposinf(b)) or not np.array_equal(np.isneginf(a), np.isneginf(b)):
        return False
    finite = np.isfinite(b)
    if not finite.any():
        return True
    scale = float(np.abs(b[finite]).max()) or 1.0
    tol = 1e-3 if np.asarray(got).dtype.itemsize <= 2 else 1e-4
    if tf32_enabled():  # a job that asked for precision "tf32": matmul inputs carry 10 bits of mantissa
        tol = max(tol, TF32_TOLERANCE)
    return bool(np.abs(a[finite] - b[finite]).max() <= tol * scale)


@dataclass(frozen=True)
class Adjoint:
    """A JVP probe's reference: ``w = J^T u`` for a random ``u`` (``Operator._adjoint``)."""

    u: np.ndarray
    w: np.ndarray


def agrees(row: np.ndarray, seed: np.ndarray, reference: Any) -> bool:
    """A probe row against its reference: equal rows (``rows_agree``), or for an ``Adjoint`` the dot-product
    test ``u . row == w . seed`` within ``rows_agree``'s tolerance of the products' Cauchy-Schwarz bound."""
    if not isinstance(reference, Adjoint):
        return rows_agree(row, reference)
    row64, seed64 = np.asarray(row, np.float64), np.asarray(seed, np.float64)
    if not np.isfinite(row64).all():
        return False
    u, w = reference.u.astype(np.float64), reference.w.astype(np.float64)
    bound = max(float(np.linalg.norm(u) * np.linalg.norm(row64)), float(np.linalg.norm(w) * np.linalg.norm(seed64)))
    tol = 1e-3 if np.asarray(row).dtype.itemsize <= 2 else 1e-4
    return abs(float(u @ row64) - float(w @ seed64)) <= tol * max(bound, 1e-300)
