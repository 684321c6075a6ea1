"""The precision guard of every kind: a few float64 probes estimate the error of a stored result, and ``precision:
"auto"`` computes the job again in float64 when the estimate exceeds the tolerance.

``run_guarded(executor, ctx)`` runs the job (``Executor.run``), then estimates (``estimate``): the model evaluated in
float64 (``worker.engine.float64``) gives ``probes()`` products (``JACOBIAN_PRECISION_PROBES``, default 3), seeded,
that are compared with the result:

- dense kinds (``jacobian``, ``batch_jacobian``, ``hessian``; dense, several ``wrt`` or COO): random rows of the
  stored matrix against the same rows in float64 (one-hot VJPs, or HVPs for a Hessian);
- product kinds (``jvp``, ``vjp``, ``hvp``, ``ggn_vp``, ``fisher_vp``): random stored products against the same
  seeds' products in float64;
- spectral kinds and solves (``svd``, ``*_eig``, ``*_trace``, ``*_diag``, ``spectral_density``, ``logdet``,
  ``ihvp``): the product the kind's algorithm applies (``J v`` for ``svd``, ``H v``, ``G v``) on random seeds in the
  working precision against float64: the error of the products it was built from, not of its values.

The estimate is the largest relative error ``||stored - float64|| / ||float64||`` over the probes. The result records
``precision_error``, ``precision_probes`` and ``precision_method`` (manifest, group attributes, the job's result);
a float64 model records 0 (its result is its own probe); a model that cannot run in float64 records no error and
the reason as its method. With ``precision: "auto"`` the tolerance is the request's ``tol`` (the kinds that take
one) or ``DEFAULT_TOL`` of the model's output dtype; above it the job is computed again on the float64 model,
stored in the first result's dtype, and ``precision_promoted`` says so (``precision_error`` is then the promoted
result's estimate, ``precision_error_before`` the first one's). When the model cannot run in float64 the job
succeeds with its result and ``warning`` says so. A sharded job's finalizer estimates the whole result
(``guarded_finish``); ``auto`` jobs are not split (POST refuses ``shards`` > 1 with ``auto``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from contracts import storage
from contracts.kinds import Family, applied_product
from contracts.layout import job_url

if TYPE_CHECKING:
    from worker.execution.base import Executor
    from worker.execution.context import RunContext

log = logging.getLogger(__name__)



def probes() -> int:
    """Products per estimate: ``JACOBIAN_PRECISION_PROBES`` (0: the operator turned the estimate off)."""
    from contracts.settings import get_settings

    return get_settings().precision_probes

PROBE_SEED = 27       # the probes' rows, products and seeds
DEFAULT_TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}   # "auto"'s tolerance when the request has no tol
EAGER = {"jvp": "reverse/eager", "vjp": "reverse/eager", "hvp": "reverse/eager"}


@dataclass
class Estimate:
    """A result's error estimate: ``error`` (None when none could be made), the ``probes`` spent, and how."""

    error: float | None
    probes: int
    method: str

    def fields(self) -> dict[str, Any]:
        return {"precision_error": self.error, "precision_probes": self.probes, "precision_method": self.method}


def run_guarded(executor: Executor, ctx: RunContext) -> dict[str, Any]:
    """``executor.run(ctx)`` and its error estimate (and, ``precision: "auto"``, its promotion): the manifest with
    the precision fields, which are written to the stored manifest and the group's attributes too. An estimate that
    fails is recorded as such (never failing the job); a float64 computation that fails fails the job."""
    return _guarded(ctx, executor.run(ctx))


def guarded_finish(executor: Executor, ctx: RunContext, writer: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """A sharded job's ``executor.finish`` (the finalizer, every shard's rows stored) and the same estimate over
    the whole result. No promotion: a ``precision: "auto"`` job is never split."""
    return _guarded(ctx, executor.finish(ctx, writer, plan))


def _guarded(ctx: RunContext, manifest: dict[str, Any]) -> dict[str, Any]:
    try:
        first, fields, ctx64 = _estimated(ctx, manifest)
    except Exception as err:  # noqa: BLE001 - the estimate never fails a job that computed its result
        from worker.engine.errors import Stopped

        if isinstance(err, Stopped):
            raise
        log.warning("job %s: no precision estimate: %s", ctx.job_id, err)
        first, ctx64 = None, None
        fields = Estimate(None, 0, f"no estimate: {type(err).__name__}: {str(err)[:200]}").fields()
    if ctx.job.precision == "auto" and ctx64 is not None and first is not None and first.error is not None:
        tol = tolerance(ctx)
        fields.update(precision_tol=tol, precision_promoted=False)
        if first.error > tol:
            manifest, fields = _promoted(ctx, ctx64, first, tol)
    _record(ctx, manifest, fields)
    return {**manifest, **fields}


def _estimated(ctx: RunContext, manifest: dict[str, Any]) -> tuple[Estimate | None, dict[str, Any], Any]:
    """The first estimate, the result's fields, and the float64 context (None without a float64 model)."""
    from worker.engine.float64 import Float64Unavailable, is_float64

    if probes() == 0:
        fields = Estimate(None, 0, "no estimate: JACOBIAN_PRECISION_PROBES=0").fields()
        if ctx.job.precision == "auto":
            fields["warning"] = _joined(manifest.get("warning"), "precision 'auto' could not check the result: "
                                        "the operator set JACOBIAN_PRECISION_PROBES=0")
        return None, fields, None
    if is_float64(ctx.load_model()):
        return None, Estimate(0.0, 0, "float64 model: its result is its own float64 probe").fields(), None
    try:
        ctx64 = float64_context(ctx, manifest["dtype"])
    except Float64Unavailable as err:
        fields = Estimate(None, 0, str(err)).fields()
        if ctx.job.precision == "auto":
            fields["warning"] = _joined(manifest.get("warning"), f"precision 'auto' could not check or promote the "
                                        f"result: {err}")
        return None, fields, None
    first = estimate(ctx, ctx64, manifest)
    return first, first.fields(), ctx64


def _promoted(ctx: RunContext, ctx64: RunContext, first: Estimate, tol: float) -> tuple[dict[str, Any], dict]:
    """The job computed again on the float64 model (the first result removed first): its manifest and fields."""
    from worker.execution import executor_for
    from worker.storage import remove_partial_result

    log.info("job %s: precision estimate %.3g > tol %.3g: computing again in float64", ctx.job_id, first.error, tol)
    remove_partial_result(ctx.results_url, ctx.job_id)
    promoted = executor_for(ctx64.job).run(ctx64)
    after = estimate(ctx64, ctx64, promoted)
    return promoted, {**after.fields(), "precision_tol": tol, "precision_promoted": True,
                      "precision_error_before": first.error,
                      "precision_reason": f"the {first.method} estimate {first.error:.3g} exceeded tol {tol:.3g}: "
                                          f"computed again in float64, stored as {promoted['dtype']}"}


def tolerance(ctx: RunContext) -> float:
    """``precision: "auto"``'s tolerance: the request's ``tol`` where the kind takes one and it is given, else
    ``DEFAULT_TOL`` of the model's output ``of`` (float32's for any other dtype)."""
    if "tol" in ctx.spec.fields and ctx.job.tol is not None:
        return float(ctx.job.tol)
    model = ctx.load_model()
    specs = model.output_specs
    of = ctx.job.of if ctx.job.of in specs else next(iter(specs)) if len(specs) == 1 else None
    dtype = specs[of].dtype.name if of is not None else "float32"
    return DEFAULT_TOL.get(dtype, DEFAULT_TOL["float32"])


def float64_context(ctx: RunContext, output_dtype: str) -> RunContext:
    """``ctx`` on the float64 model, its float inputs and seeds as float64, the result stored as ``output_dtype``
    (no plan or route caches: they are the float32 model's). Raises ``Float64Unavailable``."""
    from worker.engine.float64 import float64_model

    model64 = float64_model(ctx.load_model())
    load_inputs = ctx.load_inputs

    def inputs() -> dict[str, Any]:
        return {n: _as_float64(v) for n, v in load_inputs().items()}

    job = ctx.job.model_copy(update={"output_dtype": output_dtype})
    return replace(ctx, job=job, load_model=lambda: model64, load_inputs=inputs, plans=None, cache_dir=None)


def _as_float64(value: Any) -> Any:
    arr = np.asarray(value)
    return arr.astype(np.float64) if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16" else value


# -- estimates ------------------------------------------------------------------------------------


def estimate(ctx: RunContext, ctx64: RunContext, manifest: dict[str, Any]) -> Estimate:
    """The error estimate of the result ``manifest`` describes (the module docstring says how, per family)."""
    family = ctx.spec.family
    if family is Family.dense:
        return _dense(ctx64, manifest)
    if family is Family.products:
        return _products(ctx64, manifest)
    return _applied(ctx, ctx64)


def _operator64(ctx64: RunContext, kind: str | None = None) -> tuple[Any, Any]:
    """The float64 operator, its products eager (a few probes: no trial of routes, no compiled functions)."""
    from worker.execution.matrix_free import operator

    op, seeds = operator(ctx64, kind=kind)
    op.labels = {**op.labels, **EAGER}   # a copy: the shared choices of the float64 model stay untouched
    return op, seeds


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    """The largest relative error of the rows ``got`` against ``want`` (absolute where a row of ``want`` is 0)."""
    got = np.asarray(got, np.float64).reshape(len(got), -1)
    want = np.asarray(want, np.float64).reshape(len(want), -1)
    diff = np.linalg.norm(got - want, axis=1)
    scale = np.linalg.norm(want, axis=1)
    return float(np.max(np.where(scale > 0, diff / np.where(scale > 0, scale, 1), diff)))


def _picked(n: int) -> np.ndarray:
    return np.sort(np.random.default_rng(PROBE_SEED).choice(n, size=min(probes(), n), replace=False))


def _group(manifest: dict[str, Any]) -> Any:
    return storage.open_group(manifest["uri"], mode="r")


def _dense(ctx64: RunContext, manifest: dict[str, Any]) -> Estimate:
    """Rows of the stored J (or H) against one-hot VJPs (HVPs) of the float64 model."""
    spec = ctx64.spec
    product = "hvp" if spec.scalar_of else "vjp"
    op, _ = _operator64(ctx64, kind=product)
    n_rows = op.n_wrt if spec.scalar_of else op.n_of
    picked = _picked(n_rows)
    seeds = np.zeros((len(picked), n_rows))
    seeds[np.arange(len(picked)), picked] = 1.0
    if product == "vjp":
        seeds = seeds.reshape((len(picked),) + tuple(op.of_shape))
    want = op.apply(product, op.checked_seeds(product, seeds))
    group = _group(manifest)
    if manifest.get("format") == "coo":
        indptr, cols, values = group["indptr"], group["cols"], group["values"]
        got = np.zeros((len(picked), int(manifest["dense_shape"][1])))
        for i, r in enumerate(picked):
            a, b = int(indptr[r]), int(indptr[r + 1])
            got[i, np.asarray(cols[a:b])] = np.asarray(values[a:b], np.float64)
    else:
        array = group[manifest["array"]]
        lead = tuple(op.axis.shape) if spec.scalar_of else tuple(op.of_shape)
        got = np.stack([np.asarray(array[tuple(int(d) for d in np.unravel_index(r, lead))], np.float64).reshape(-1)
                        for r in picked])
    if spec.batch_axis:   # row (b, f): the derivative w.r.t. example b's part of every source
        b_size = op.of_shape[0]
        examples = picked // max(1, op.n_of // max(1, b_size))
        want = np.stack([np.concatenate([want[i, s["start"]:s["stop"]].reshape(b_size, -1)[b]
                                         for s in op.axis.slices.values()]) for i, b in enumerate(examples)])
    label = "Hessian" if spec.scalar_of else "Jacobian"
    return Estimate(_relative(got, want), len(picked), f"{len(picked)} random {label} rows against float64 "
                    f"{'HVPs' if spec.scalar_of else 'VJPs'}")


def _products(ctx64: RunContext, manifest: dict[str, Any]) -> Estimate:
    """Stored products of random seeds against the same seeds' products in float64."""
    kind = ctx64.job.kind.value
    op, seeds = _operator64(ctx64)
    stored = _group(manifest)["products"]
    picked = _picked(int(stored.shape[0]))
    if not len(picked):
        return Estimate(0.0, 0, "no products to probe")
    chosen = np.asarray(seeds)[picked]
    want = op.apply(kind, op.checked_seeds(kind, chosen))
    got = np.stack([np.asarray(stored[int(i)], np.float64) for i in picked])
    return Estimate(_relative(got, want), len(picked), f"{len(picked)} random stored products against float64")


def _applied(ctx: RunContext, ctx64: RunContext) -> Estimate:
    """The product the spectral kind applies, on random seeds: working precision against float64."""
    from worker.execution.matrix_free import operator

    product = applied_product(ctx.spec, ctx.job.curvature) or "jvp"   # svd: J v
    op, _ = operator(ctx)
    op64, _ = _operator64(ctx64, kind=product if product in EAGER else None)
    seeds = np.random.default_rng(PROBE_SEED).standard_normal((probes(), op.n_wrt))
    got = op.apply(product, op.checked_seeds(product, seeds.astype(op.compute_dtype)))
    want = op64.apply(product, op64.checked_seeds(product, seeds))
    return Estimate(_relative(got, want), len(seeds), f"{len(seeds)} random {product} products, working precision "
                    "against float64")


# -- recording ------------------------------------------------------------------------------------


def _joined(first: Any, second: str) -> str:
    return f"{first}; {second}" if first else second


def _record(ctx: RunContext, manifest: dict[str, Any], fields: dict[str, Any]) -> None:
    """The precision fields in the result group's attributes and the stored manifest (rewritten)."""
    from worker import result_group
    from worker.storage import jsonable, write_manifest

    clean = jsonable({k: v for k, v in fields.items() if v is not None})
    result_group.seal(manifest["uri"], clean)
    write_manifest(storage.normalize(job_url(ctx.results_url, ctx.job_id)), {**manifest, **clean})
    fields.clear()
    fields.update(clean)
