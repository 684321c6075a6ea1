"""The rules of the matrix-free kinds (issue 14) on plain numbers and shapes: no TensorFlow, no numpy.

Pure functions that raise ``contracts.rules.RuleViolation`` with the field at fault and a message
naming the fix, as the rest of the rulebook does: the engine turns them into ``InvalidRequest``
(``worker.engine.matfree``), and the API can apply the same functions at POST once they move to
``contracts/rules.py`` (they import nothing from the engine for that reason).

- ``jvp``, ``vjp``, ``hvp``: ``seeds`` of shape ``(k,) + wrt.shape`` (tangents, ``k >= 1``), or
  ``(k,) + of.shape`` (cotangents) for ``vjp``; with several ``wrt``, ``(k, total size)``, and the
  flat ``(k, size)`` is accepted for one ``wrt`` too.
- ``svd``: ``1 <= rank <= min(size of of, size of wrt)``; ``hessian_eig``: ``1 <= rank <= size of wrt``.
- ``tol``: a relative accuracy in ``(0, 0.5)``; ``max_iterations`` (``svd``: subspace iterations, default 200;
  ``hessian_eig``: Lanczos steps, default ``max(20 rank, 100)``): at least 1; ``samples``
  (``hessian_trace``): at least 2, for a standard error (Hutch++ needs 6: two thirds of them deflate, a third
  estimate what is left).
- ``probes`` (``hessian_diag``, ``spectral_density``, ``logdet``): at least 2; ``steps``: 1 to ``MAX_STEPS``, and one
  probe's Lanczos basis within ``BASIS_BYTES`` (``contracts.estimators``); ``sigma`` positive; ``damping`` finite.
- The Hessian kinds (``hvp``, ``hessian_eig``, ``hessian_trace``): ``of`` of one element, or
  ``reduce='sum'`` (``contracts.rules.check_hessian``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from contracts import estimators
from contracts.kinds import kind_spec
from contracts.rules import MATRIX_FREE_HESSIAN_KINDS, RuleViolation, check_hessian, fmt_shape

TRACE_METHODS = ("auto", "hutch++", "hutchinson", "exact")
DEFAULT_TOL = 1e-4
DEFAULT_SAMPLES = 100
DEFAULT_SVD_ITERATIONS = 200
MAX_ITERATIONS = 1_000_000
MIN_SAMPLES = 2
MIN_HUTCHPP_SAMPLES = 6


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_rank(kind: str, rank: object, *, of_size: int, wrt_size: int) -> int:
    """``rank`` for ``svd`` (at most the smaller of ``of``'s and ``wrt``'s sizes) or ``hessian_eig`` (at most
    ``wrt``'s size): the number of singular values or eigenpairs asked for. The kind's spec says which: the
    Hessian of a kind that differentiates twice is ``wrt`` by ``wrt``."""
    spec = kind_spec(kind)
    square = spec.scalar_of or bool(spec.applies)   # H, or a matrix of HVP-like products (G): wrt by wrt
    largest = wrt_size if square else min(of_size, wrt_size)
    what = (f"the size of wrt ({wrt_size})" if square
            else "min(size of of, size of wrt) = " f"min({of_size}, {wrt_size})")
    if rank is None:
        counted = spec.spectrum.counted if spec.spectrum else "values"
        raise RuleViolation(f"rank: kind {kind!r} needs 'rank', the number of {counted} to compute (1 to {largest})",
                            field="rank")
    if not _is_int(rank) or rank < 1:
        raise RuleViolation(f"rank: must be a positive integer, got {rank!r}; ask for 1 to {largest}", field="rank")
    if rank > largest:
        raise RuleViolation(f"rank: {rank} is more than {what}; ask for at most {largest}"
                            + f" (or kind {spec.whole_matrix!r} for the whole matrix)", field="rank")
    return int(rank)


def check_tol(tol: object) -> float:
    """``tol``: the relative accuracy of singular values or eigenvalues, in ``(0, 0.5)``; None: the default."""
    if tol is None:
        return DEFAULT_TOL
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not math.isfinite(tol) or not 0 < tol < 0.5:
        raise RuleViolation(f"tol: must be a relative accuracy between 0 and 0.5 (exclusive), got {tol!r}; "
                            f"the default is {DEFAULT_TOL}", field="tol")
    return float(tol)


def check_max_iterations(max_iterations: object, *, default: int) -> int:
    """``max_iterations``: how many iterations (``svd``) or Lanczos steps (``hessian_eig``) a spectrum may take
    before it ends ``NotConverged``; None: ``default``."""
    if max_iterations is None:
        return default
    if not _is_int(max_iterations) or not 1 <= max_iterations <= MAX_ITERATIONS:
        raise RuleViolation(f"max_iterations: must be an integer from 1 to {MAX_ITERATIONS}, got {max_iterations!r}; "
                            "omit it for the kind's default", field="max_iterations")
    return int(max_iterations)


def check_samples(samples: object, *, method: str = "auto") -> int:
    """``samples``: the number of Hessian-vector products of a trace estimate (None: the default)."""
    if method not in TRACE_METHODS:
        raise RuleViolation(f"method: {method!r} is not a trace method; use one of: "
                            + ", ".join(repr(m) for m in TRACE_METHODS), field="method")
    if samples is None:
        return DEFAULT_SAMPLES
    least = MIN_HUTCHPP_SAMPLES if method == "hutch++" else MIN_SAMPLES
    if not _is_int(samples) or samples < least:
        raise RuleViolation(f"samples: must be an integer of at least {least} (a standard error needs several "
                            f"samples), got {samples!r}; the default is {DEFAULT_SAMPLES}", field="samples")
    return int(samples)


def check_probes(probes: object, *, kind: str) -> int:
    """``probes``: random vectors of an estimate (``hessian_diag``, the quadrature kinds), at least 2 for a standard
    error; None: the kind's default (``contracts.estimators``)."""
    default = estimators.default_probes(kind_spec(kind).fields)
    if probes is None:
        return default
    if not _is_int(probes) or probes < MIN_SAMPLES:
        raise RuleViolation(f"probes: must be an integer of at least {MIN_SAMPLES} (a standard error needs several "
                            f"probes), got {probes!r}; the default is {default}", field="probes")
    return int(probes)


def check_steps(steps: object, *, n: int) -> int:
    """``steps``: Lanczos steps per probe (None: the default); each keeps a float64 basis vector of the wrt size
    ``n`` per probe, so one probe's basis must fit ``contracts.estimators.BASIS_BYTES``."""
    if steps is None:
        steps = estimators.SLQ_STEPS
    if not _is_int(steps) or not 1 <= steps <= estimators.MAX_STEPS:
        raise RuleViolation(f"steps: must be an integer from 1 to {estimators.MAX_STEPS}, got {steps!r}; the default "
                            f"is {estimators.SLQ_STEPS}", field="steps")
    most = max(1, estimators.BASIS_BYTES // (8 * max(1, n)) - 1)
    if min(int(steps), n) > most:
        raise RuleViolation(f"steps: {steps} Lanczos steps over a wrt of {n} elements keep "
                            f"{8 * (min(int(steps), n) + 1) * n} bytes of basis vectors per probe, over "
                            f"{estimators.BASIS_BYTES}; ask for at most {most} steps", field="steps")
    return int(steps)


def check_sigma(sigma: object) -> float | None:
    """``sigma``: the density's Gaussian width, positive and finite (None: from the Ritz values' range)."""
    if sigma is None:
        return None
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not math.isfinite(sigma) or sigma <= 0:
        raise RuleViolation(f"sigma: must be a positive width in eigenvalue units, got {sigma!r}; omit it for "
                            f"{estimators.SIGMA_FRACTION:g} x the range of the Ritz values", field="sigma")
    return float(sigma)


def check_damping(damping: object) -> float:
    """``damping``: the shift of log det(H + damping I), a finite number (None: 0)."""
    if damping is None:
        return 0.0
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or not math.isfinite(damping):
        raise RuleViolation(f"damping: must be a finite number, got {damping!r}; e.g. 1e-3", field="damping")
    return float(damping)


def check_seeds(kind: str, shape: Sequence[int], *, of_shape: Sequence[int], wrt_shape: Sequence[int]) -> int:
    """The shape of ``seeds`` for ``kind``: ``(k,) + of_shape`` for ``vjp``, ``(k,) + wrt_shape`` otherwise
    (``wrt_shape``: one ``wrt``'s shape, or ``(total size,)`` for several), or ``(k, size)`` flat; ``k >= 1``.
    Returns ``k``."""
    name = "of" if kind_spec(kind).seeds == "of" else "wrt"   # cotangents or tangents
    along = tuple(of_shape) if name == "of" else tuple(wrt_shape)
    shape = tuple(int(d) for d in shape)
    size = math.prod(along)
    wanted = f"(k,) + {name}.shape = (k, {', '.join(map(str, along))})" if along else "(k,)"
    if len(shape) == 0 or shape[0] < 1:
        raise RuleViolation(f"seeds: kind {kind!r} needs seeds of shape {wanted} with k >= 1, got "
                            f"{fmt_shape(shape)}", field="seeds")
    if shape[1:] != along and shape[1:] != (size,):
        what = "cotangents shaped like of" if name == "of" else "tangents shaped like wrt"
        raise RuleViolation(f"seeds: kind {kind!r} takes {what}, of shape {wanted} (or flat (k, {size})), got "
                            f"{fmt_shape(shape)}; reshape the seeds", field="seeds")
    return shape[0]


def check_scalar_of(kind: str, of: str, of_shape: Sequence[int] | None, reduce: str | None) -> None:
    """The Hessian kinds need ``of`` of one element or ``reduce='sum'`` (``contracts.rules.check_hessian``)."""
    if kind in MATRIX_FREE_HESSIAN_KINDS:
        check_hessian(of, None if of_shape is None else tuple(of_shape), reduce)
