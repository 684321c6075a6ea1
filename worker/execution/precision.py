"""The precision guard of every kind: a few float64 probes estimate the error of a stored result, and ``precision:
"auto"`` computes the job again in float64 when the estimate exceeds the tolerance.

``run_guarded(executor, ctx)`` prepares the float64 side first (``prepare``, ``reference``), runs the job
(``Executor.run``), then compares: the model evaluated in float64 (``worker.engine.float64``) gives ``probes()``
products (``JACOBIAN_PRECISION_PROBES``, default 3), seeded, that are compared with the result:

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from contracts import storage
from contracts.kinds import Family, applied_product
from contracts.layout import job_url
from worker.execution import reference_rows

if TYPE_CHECKING:
    from worker.engine.model import LoadedModel
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
# Where the job has a cache folder the probes run as one compiled function per product (one seed per call), whose
# trace is kept there (``trace_cache``) for the next process on the same model and shapes: building the float64
# backward graph in Python was most of the guard's first probe (MobileNetV3Small: 1.0-1.3 s of a 1.4 s probe).
KEPT = {"jvp": "reverse/loop", "vjp": "reverse/loop", "hvp": "reverse/loop"}


@dataclass
class Estimate:
    """A result's error estimate: ``error`` (None when none could be made), the ``probes`` spent, and how."""

    error: float | None
    probes: int
    method: str

    def fields(self) -> dict[str, Any]:
        return {"precision_error": self.error, "precision_probes": self.probes, "precision_method": self.method}


def run_guarded(executor: Executor, ctx: RunContext, *, keep_copy: bool = True) -> dict[str, Any]:
    """``executor.run(ctx)`` and its error estimate (and, ``precision: "auto"``, its promotion): the manifest with
    the precision fields, which are written to the stored manifest and the group's attributes too. An estimate that
    fails is recorded as such (never failing the job); a float64 computation that fails fails the job.

    The float64 side of the estimate runs first (``prepare``): its products do not depend on the result, and
    memory it frees is reused by the job, where after the job it would add to the process's peak (MobileNetV3Small:
    about 350 MiB of peak RSS). Only the few stored rows it is compared with are read after the job.
    ``keep_copy=False`` (a process that runs one job: ``jacobian compute``) drops the model's float64 copy once its
    products are computed, unless ``precision: "auto"`` may need it: about 200 MiB less during the job on
    MobileNetV3Small; a worker keeps it for the model's next job."""
    prepared = prepare(ctx, keep_copy=keep_copy)
    return _guarded(ctx, executor.run(ctx), prepared)


def guarded_finish(executor: Executor, ctx: RunContext, writer: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """A sharded job's ``executor.finish`` (the finalizer, every shard's rows stored) and the same estimate over
    the whole result. No promotion: a ``precision: "auto"`` job is never split."""
    prepared = prepare(ctx)
    return _guarded(ctx, executor.finish(ctx, writer, plan), prepared)


@dataclass
class Prepared:
    """The float64 side of a job's estimate, made before the job: ``compare`` turns the stored result's manifest into
    the estimate; without it ``fields`` say why there is none (and ``warning`` what ``auto`` could not do).
    ``ctx64`` is kept for ``auto``'s promotion only."""

    compare: Callable[[dict[str, Any]], Estimate] | None = None
    fields: dict[str, Any] | None = None
    warning: str | None = None
    ctx64: RunContext | None = None


def prepare(ctx: RunContext, *, keep_copy: bool = True) -> Prepared:
    """The float64 side of ``ctx``'s estimate (no estimate, and why, where none can be made). Never raises but
    ``Stopped``: an estimate that fails is recorded, the job runs. ``keep_copy``: see ``run_guarded``."""
    from worker.engine.errors import InvalidRequest, Stopped
    from worker.engine.float64 import Float64Unavailable, is_float64, one_grappler_pass

    auto = ctx.job.precision == "auto"
    if probes() == 0:
        return Prepared(fields=Estimate(None, 0, "no estimate: JACOBIAN_PRECISION_PROBES=0").fields(),
                        warning="precision 'auto' could not check the result: the operator set "
                                "JACOBIAN_PRECISION_PROBES=0" if auto else None)
    try:
        if is_float64(ctx.load_model()):
            return Prepared(fields=Estimate(0.0, 0, "float64 model: its result is its own float64 probe").fields())
        with one_grappler_pass():
            try:   # the copy's graph is built on its first use: a model it cannot hold fails in either
                ctx64 = float64_context(ctx)
                compare = reference(ctx, ctx64)
            except Float64Unavailable as err:
                return Prepared(fields=Estimate(None, 0, str(err)).fields(), warning=f"precision 'auto' could not "
                                f"check or promote the result: {err}" if auto else None)
        if not (keep_copy or auto):
            _drop_copy(ctx)
        return Prepared(compare=compare, ctx64=ctx64 if auto else None)
    except Stopped:
        raise
    except Exception as err:  # noqa: BLE001 - the estimate never fails a job
        # a request the job refuses fails here first: the job's refusal, in its own words, is the one to show
        return Prepared(fields=_no_estimate(ctx, err, quiet=isinstance(err, InvalidRequest)))


def _no_estimate(ctx: RunContext, err: Exception, *, quiet: bool = False) -> dict[str, Any]:
    """The fields of an estimate that failed with ``err`` (logged; at debug level when ``quiet``)."""
    (log.debug if quiet else log.warning)("job %s: no precision estimate: %s", ctx.job_id, err)
    return Estimate(None, 0, f"no estimate: {type(err).__name__}: {str(err)[:200]}").fields()


def _drop_copy(ctx: RunContext) -> None:
    """Forget the model's float64 copy and give the memory it and its products freed back to the kernel: the job's
    threads allocate from other malloc arenas than this one, so memory left free here would not serve them."""
    import gc

    from worker.engine.host_peak import trim_heap
    from worker.engine.model import LoadedModel

    compiled = ctx.load_model().compiled
    copy, compiled.float64 = compiled.float64, None
    if copy is None or (isinstance(copy, LoadedModel) and getattr(copy.fn, "call", None) is None
                        and not len(copy.compiled)):
        return   # no copy made, or neither its graph built nor a function of it traced: nothing to collect
    # The copy's functions are in reference cycles (copy -> its compiled probes -> their Python bodies -> the
    # Operator -> copy), which the collection frees only once nothing here refers to the copy: with ``copy``
    # still bound they stayed for the job (MobileNetV3Small 62 MiB, EfficientNetB0 112 MiB of resident memory).
    del copy
    gc.collect()
    trim_heap()


def _guarded(ctx: RunContext, manifest: dict[str, Any], prepared: Prepared) -> dict[str, Any]:
    first = None
    if prepared.compare is None:
        fields = dict(prepared.fields or {})
        if prepared.warning:
            fields["warning"] = _joined(manifest.get("warning"), prepared.warning)
    else:
        from worker.engine.errors import Stopped

        try:
            first = prepared.compare(manifest)
            fields = first.fields()
        except Stopped:
            raise
        except Exception as err:  # noqa: BLE001 - the estimate never fails a job that computed its result
            first, fields = None, _no_estimate(ctx, err)
    ctx64 = prepared.ctx64
    if ctx.job.precision == "auto" and ctx64 is not None and first is not None and first.error is not None:
        tol = tolerance(ctx)
        fields.update(precision_tol=tol, precision_promoted=False)
        if first.error > tol:
            ctx64 = replace(ctx64, job=ctx64.job.model_copy(update={"output_dtype": manifest["dtype"]}))
            manifest, fields = _promoted(ctx, ctx64, first, tol)
    _record(ctx, manifest, fields)
    return {**manifest, **fields}


def _promoted(ctx: RunContext, ctx64: RunContext, first: Estimate, tol: float) -> tuple[dict[str, Any], dict]:
    """The job computed again on the float64 model (the first result removed first): its manifest and fields."""
    from worker.execution import executor_for
    from worker.result_group import remove_partial_result

    log.info("job %s: precision estimate %.3g > tol %.3g: computing again in float64", ctx.job_id, first.error, tol)
    remove_partial_result(ctx.results_url, ctx.job_id)
    promoted = executor_for(ctx64.job).run(ctx64)
    after = reference(ctx64, ctx64)(promoted)
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


def float64_context(ctx: RunContext) -> RunContext:
    """``ctx`` on the float64 model, its float inputs and seeds as float64 (no plan or route caches: they are the
    float32 model's; the promotion sets the stored dtype). The copy is made on the first ``load_model``, which
    raises ``Float64Unavailable`` where it cannot be."""
    from worker.engine.float64 import float64_model

    load_model, load_inputs = ctx.load_model, ctx.load_inputs

    def model() -> LoadedModel:   # made on first use (once per loaded model): kept rows need none of it
        return float64_model(load_model())

    def inputs() -> dict[str, Any]:
        return {n: _as_float64(v) for n, v in load_inputs().items()}

    return replace(ctx, load_model=model, load_inputs=inputs, plans=None, cache_dir=None)


def _as_float64(value: Any) -> Any:
    arr = np.asarray(value)
    return arr.astype(np.float64) if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16" else value


# -- estimates ------------------------------------------------------------------------------------


def reference(ctx: RunContext, ctx64: RunContext) -> Callable[[dict[str, Any]], Estimate]:
    """The float64 side of the estimate, computed now, and what compares a stored result with it (the module
    docstring says how, per family): none of it depends on the result, only on the job's shapes and seeds."""
    family = ctx.spec.family
    trace_dir = ctx.cache_dir   # None on the float64 context of a promotion
    if family is Family.dense:
        return _dense(ctx, ctx64, trace_dir)
    if family is Family.products:
        return _products(ctx64, trace_dir)
    found = _applied(ctx, ctx64, trace_dir)
    return lambda _manifest: found


def _operator64(ctx64: RunContext, kind: str | None = None, trace_dir: str | None = None) -> tuple[Any, Any]:
    """The float64 operator, its products fixed (a few probes: no trial of routes): compiled with their traces kept
    in ``trace_dir`` (``KEPT``), else eager."""
    from worker.execution.matrix_free import operator

    op, seeds = operator(ctx64, kind=kind)
    op.labels = {**op.labels, **(KEPT if trace_dir else EAGER)}   # a copy: the shared choices stay untouched
    op.trace_dir = trace_dir
    return op, seeds


def _apply64(op: Any, kind: str, seeds: np.ndarray) -> np.ndarray:
    """``op.apply`` of the float64 probes; where a compiled probe fails (a graph its function cannot hold), the same
    products eager."""
    from worker.engine.errors import Stopped

    try:
        return op.apply(kind, seeds)
    except Stopped:
        raise
    except Exception as err:  # noqa: BLE001 - eager is the reference form; its own failure is raised
        if not any(op.labels.get(k) == label for k, label in KEPT.items()):
            raise
        log.info("float64 probes compiled failed (%s): eager instead", type(err).__name__)
        op.labels = {**op.labels, **EAGER}
        return op.apply(kind, seeds)


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


def _dense(ctx: RunContext, ctx64: RunContext, trace_dir: str | None) -> Callable[[dict[str, Any]], Estimate]:
    """One-hot VJPs (HVPs) of the float64 model for random rows, then those rows of the stored J (or H). The rows
    are kept in ``trace_dir`` for a later job of the same model, request and inputs (``reference_rows``): such a
    job makes no float64 copy at all (its variables alone: 0.44 s on MobileNetV3Small, 0.72 s on EfficientNetB0)."""
    spec = ctx64.spec
    product = "hvp" if spec.scalar_of else "vjp"
    key = reference_key(ctx, product) if trace_dir else None
    kept = reference_rows.load(trace_dir, key)
    if kept is not None:
        picked, want, lead = kept
    else:
        picked, want, lead = _dense_rows(ctx64, product, trace_dir)
        reference_rows.store(trace_dir, key, picked, want, lead)
    label = "Hessian" if spec.scalar_of else "Jacobian"
    method = f"{len(picked)} random {label} rows against float64 {'HVPs' if spec.scalar_of else 'VJPs'}"

    def compare(manifest: dict[str, Any]) -> Estimate:
        group = _group(manifest)
        if manifest.get("format") == "coo":
            indptr, cols, values = group["indptr"], group["cols"], group["values"]
            got = np.zeros((len(picked), int(manifest["dense_shape"][1])))
            for i, r in enumerate(picked):
                a, b = int(indptr[r]), int(indptr[r + 1])
                got[i, np.asarray(cols[a:b])] = np.asarray(values[a:b], np.float64)
        else:
            array = group[manifest["array"]]
            got = np.stack([np.asarray(array[tuple(int(d) for d in np.unravel_index(r, lead))],
                                       np.float64).reshape(-1) for r in picked])
        return Estimate(_relative(got, want), len(picked), method)

    return compare


def _dense_rows(ctx64: RunContext, product: str, trace_dir: str | None) -> tuple[np.ndarray, np.ndarray, tuple]:
    """``(picked rows, their float64 values, the stored array's leading shape)`` of a dense kind's estimate."""
    spec = ctx64.spec
    op, _ = _operator64(ctx64, kind=product, trace_dir=trace_dir)
    n_rows = op.n_wrt if spec.scalar_of else op.n_of
    picked = _picked(n_rows)
    seeds = np.zeros((len(picked), n_rows))
    seeds[np.arange(len(picked)), picked] = 1.0
    if product == "vjp":
        seeds = seeds.reshape((len(picked),) + tuple(op.of_shape))
    want = _apply64(op, product, op.checked_seeds(product, seeds))
    if spec.batch_axis:   # row (b, f): the derivative w.r.t. example b's part of every source
        b_size = op.of_shape[0]
        examples = picked // max(1, op.n_of // max(1, b_size))
        want = np.stack([np.concatenate([want[i, s["start"]:s["stop"]].reshape(b_size, -1)[b]
                                         for s in op.axis.slices.values()]) for i, b in enumerate(examples)])
    return picked, want, tuple(op.axis.shape) if spec.scalar_of else tuple(op.of_shape)


def reference_key(ctx: RunContext, product: str) -> str | None:
    """What a dense estimate's float64 rows are kept under: the (working precision) model's content, the request,
    the probes and the inputs' bytes as the job has them (None where the model has no content fingerprint)."""
    from worker.engine.float64 import float64_fingerprint

    fingerprint = float64_fingerprint(ctx.load_model().fingerprint)   # the copy's, made or not
    if not fingerprint:
        return None
    job = ctx.job
    request = job.model_dump(mode="json", include={"kind", "of", "wrt", "mode", "reduce", "rows"})
    return reference_rows.key(fingerprint, job.model.signature, request, product, probes(), PROBE_SEED,
                              ctx.load_inputs())


def _products(ctx64: RunContext, trace_dir: str | None) -> Callable[[dict[str, Any]], Estimate]:
    """The float64 products of random seeds of the job, then the stored products of the same seeds."""
    kind = ctx64.job.kind.value
    op, seeds = _operator64(ctx64, trace_dir=trace_dir)
    picked = _picked(len(seeds))
    if not len(picked):
        return lambda _manifest: Estimate(0.0, 0, "no products to probe")
    want = _apply64(op, kind, op.checked_seeds(kind, np.asarray(seeds)[picked]))

    def compare(manifest: dict[str, Any]) -> Estimate:
        stored = _group(manifest)["products"]
        got = np.stack([np.asarray(stored[int(i)], np.float64) for i in picked])
        return Estimate(_relative(got, want), len(picked), f"{len(picked)} random stored products against float64")

    return compare


def _applied(ctx: RunContext, ctx64: RunContext, trace_dir: str | None) -> Estimate:
    """The product the spectral kind applies, on random seeds: working precision against float64."""
    from worker.execution.matrix_free import operator

    product = applied_product(ctx.spec, ctx.job.curvature) or "jvp"   # svd: J v
    op, _ = operator(ctx)
    op64, _ = _operator64(ctx64, kind=product if product in EAGER else None, trace_dir=trace_dir)
    seeds = np.random.default_rng(PROBE_SEED).standard_normal((probes(), op.n_wrt))
    got = op.apply(product, op.checked_seeds(product, seeds.astype(op.compute_dtype)))
    want = _apply64(op64, product, op64.checked_seeds(product, seeds))
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
