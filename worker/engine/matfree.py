"""Matrix-free products over one concatenated ``wrt`` axis: J v (``jvp``), v^T J (``vjp``), H v (``hvp``).

``build_operator`` resolves a request (``of``, ``wrt`` as one name, a list or ``"variables/*"``:
``worker.engine.wrt_axis``) and returns an ``Operator`` whose products take a batch of ``k`` seeds
per compiled call, chunked over the seeds by the caller's ``chunk_rows`` (the request's: seeds are the rows of
the products; halved on out-of-memory).
Seeds and results are flat along ``wrt``: ``jvp`` ``(k, n_wrt) -> (k,) + of.shape``, ``vjp``
``(k,) + of.shape -> (k, n_wrt)``, ``hvp`` ``(k, n_wrt) -> (k, n_wrt)`` (``Operator.axis.unflatten``
gives ``(k,) + wrt.shape``). A flat seed is split into per-source pieces by the axis' slices; the
pieces' contributions are summed (``jvp``) or their gradients concatenated (``vjp``, ``hvp``).

How a product is computed (a *label*, ``route/strategy``):

- routes: ``jvp`` by forward mode (``ForwardAccumulator``) or, ``reverse``, as the derivative of a VJP
  with respect to its cotangent (``J t = d/du <J^T u, t>``, two reverse passes); ``hvp`` forward-over-
  reverse or reverse-over-reverse; ``vjp`` reverse. Forward mode is not tried w.r.t. a variable: in a
  compiled function TensorFlow's JVP w.r.t. a variable captured by a loaded function is silently zero.
- strategies: ``vectorized`` (``tf.vectorized_map`` over the seeds: one trace serves any ``k``, the seeds
  are a ``[None, None]`` argument and the inputs arguments too), ``tiled`` (``jvp`` forward, ``vjp``
  reverse; ``products.tiled_ok``: all seeds through one pass over the inputs tiled on the batch axis, a
  plain trace; tried before ``vectorized`` on a graph of more than ``tuning.SMALL_GRAPH_OPS`` ops, after
  it otherwise), ``loop`` (a compiled one-seed function per seed), ``eager`` (no ``tf.function``); last, for
  ``jvp``, ``reverse/rows``: ``J`` from VJPs, kept, where forward mode and second derivatives fail (``jvp_rows``).

The first call of a kind tries the labels in that order on its seeds plus one random probe seed,
whose row is checked against an eager reverse-mode product (``agreement.rows_agree``; a JVP row ``J t`` by
the dot-product test ``u . J t = (J^T u) . t`` against one eager VJP, a single backward pass); the first label
that runs and agrees is kept for the operator (and, through ``worker.execution.operators``, for later jobs
and processes). Compiled functions are cached on the loaded model (``model.compiled``) and the chosen one's
graph in the cache folder (``trace_cache``). ``Operator.counts`` counts the products: per kind, and ``checks``
for the probe rows and reference products spent choosing. Results: the wider dtype of ``of`` and ``wrt`` (or
``output_dtype``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts import rules
from contracts.jobspec import MATRIX_FREE_HESSIAN_KINDS, MATRIX_FREE_KINDS, PRODUCT_KINDS
from contracts.kinds import kind_spec
from worker.engine import jvp_rows, matfree_rules, pfor_patches, product_labels, tf_logs, trace_cache
from worker.engine.agreement import Adjoint, agrees
from worker.engine.errors import EngineError, InvalidRequest, MemoryBudgetTooSmall, Stopped
from worker.engine.matfree_result import MatFreeResult
from worker.engine.memory import is_out_of_memory
from worker.engine.model import LoadedModel
from worker.engine.problem import convert_inputs, described, error_summary, probe_shape, ruled
from worker.engine.products import body
from worker.engine.wrt_axis import WrtAxis, wrt_axis

FIRST_SEEDS = 8          # the first call of a kind whose seeds per call are planned from memory: its peak measured
PROBE_SEED = 20240611   # the random probe row of a kind's first call
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProductKey:
    """One compiled product function of a loaded model (``model.compiled``)."""

    of: str
    wrt: tuple[str, ...]
    optional: frozenset[str]
    kind: str
    label: str
    reduce: str | None
    dtype: str
    inputs: tuple[tuple[str, str], ...]


class Operator:
    """The matrix-free products of one request: ``of`` (shape ``of_shape``) w.r.t. ``axis`` (see the module
    docstring). ``dtype``: the dtype of results; ``compute_dtype``: of seeds and products in the graph."""

    def __init__(self, model: LoadedModel, inputs: dict[str, Any], *, of: str, of_shape: tuple[int, ...],
                 of_dtype: str, axis: WrtAxis, reduce: str | None, dtype: str, compute_dtype: str,
                 routes: dict[str, str] | None = None) -> None:
        self.model, self.inputs, self.of, self.of_shape, self.of_dtype = model, inputs, of, of_shape, of_dtype
        self.axis, self.reduce, self.dtype, self.compute_dtype = axis, reduce, dtype, compute_dtype
        self.routes = {"jvp": "auto", "hvp": "auto", **(routes or {})}
        self.counts = {"jvp": 0, "vjp": 0, "hvp": 0, "checks": 0}
        self.labels: dict[str, str] = {}      # per kind: the label chosen by its first call
        self.on_choice: Callable[[], None] | None = None   # told when a label is chosen (to keep it)
        self.trace_dir: str | None = None     # the cache folder: traced functions kept for later processes
        self.failures: dict[str, str] = {}    # label -> why it was not chosen
        self.jacobian_rows: np.ndarray | None = None   # J, kept by the label reverse/rows (``jvp_rows``)
        self.middles: dict[str, Callable[[np.ndarray], np.ndarray]] = {}   # J^T M J kinds: M (``curvature.middles``)
        self._references: dict[str, np.ndarray | None] = {}
        self.oom_retries = 0
        # Planning chunks of seeds from memory (``plan_memory``): the probe, the budget, what was planned.
        self.probe: Any = None
        self.budget_bytes: int | None = None
        self.planned: dict[str, int] = {}   # per kind: seeds per call, from the first chunk's measured peak

    def plan_memory(self, probe: Any, budget_bytes: int | None = None) -> None:
        """Plan seeds per call from memory when the caller gives no chunk size: the first call of a kind runs
        ``FIRST_SEEDS`` seeds and its peak (``probe``, a ``worker.engine.MemoryProbe``) sets the rest, to peak
        within ``SAFETY`` of the free memory (or ``budget_bytes``); out-of-memory still halves."""
        self.probe, self.budget_bytes = probe, budget_bytes

    @property
    def n_of(self) -> int:
        return math.prod(self.of_shape)

    @property
    def n_wrt(self) -> int:
        return self.axis.size

    def attrs(self) -> dict[str, Any]:
        """The request as the result group's attributes (JSON)."""
        return {"model": self.model.path, "signature": self.model.signature, "of": self.of,
                "wrt": list(self.axis.names), "wrt_slices": self.axis.slices, "reduce": self.reduce,
                "of_shape": list(self.of_shape), "wrt_shape": list(self.axis.shape), "dtype": self.dtype,
                "labels": dict(self.labels)}

    def require_hessian(self, kind: str) -> None:
        """The Hessian kinds' rule: ``of`` of one element or ``reduce='sum'`` (raises InvalidRequest, field ``of``)."""
        ruled(matfree_rules.check_scalar_of, kind, self.of, self.of_shape, self.reduce)

    # -- public products ----------------------------------------------------------------------

    def jvp(self, seeds: Any, **options: Any) -> np.ndarray:
        """``J t`` for tangents ``(k, n_wrt)`` (or ``(k,) + wrt.shape``): ``(k,) + of.shape`` in ``dtype``."""
        flat = self.checked_seeds("jvp", seeds)
        out = self.apply("jvp", flat, **options).astype(self.dtype)
        return out.reshape((len(flat),) + self.of_shape) if out.ndim > 1 else out   # 1-d: not kept (streamed)

    def vjp(self, seeds: Any, **options: Any) -> np.ndarray:
        """``u^T J`` for cotangents ``(k,) + of.shape`` (or ``(k, n_of)``): ``(k, n_wrt)`` in ``dtype``."""
        return self.apply("vjp", self.checked_seeds("vjp", seeds), **options).astype(self.dtype)

    def hvp(self, seeds: Any, **options: Any) -> np.ndarray:
        """``H v`` (Hessian of ``sum(of)``) for ``(k, n_wrt)`` (or ``(k,) + wrt.shape``): ``(k, n_wrt)``."""
        self.require_hessian("hvp")
        return self.apply("hvp", self.checked_seeds("hvp", seeds), **options).astype(self.dtype)

    def curvature_vp(self, kind: str, seeds: Any, **options: Any) -> np.ndarray:
        """``J^T M J v`` of a curvature product ``kind`` (its ``middles`` entry) for ``(k, n_wrt)`` seeds."""
        if kind not in self.middles:
            raise InvalidRequest(f"loss: kind {kind!r} needs a loss (and its labels) on of", field="loss")
        return self.apply(kind, self.checked_seeds(kind, seeds), **options).astype(self.dtype)

    def checked_seeds(self, kind: str, seeds: Any) -> np.ndarray:
        """Seeds checked (``matfree_rules.check_seeds``, finite) and flattened to ``(k, size)``."""
        arr = np.asarray(seeds)
        k = ruled(matfree_rules.check_seeds, kind, arr.shape, of_shape=self.of_shape, wrt_shape=self.axis.shape)
        if not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
            raise InvalidRequest(f"seeds: must be real numbers, got dtype {arr.dtype}; send float seeds", field="seeds")
        if not np.isfinite(arr).all():
            raise InvalidRequest("seeds: hold NaN or infinite values; send finite seeds", field="seeds")
        return arr.reshape(k, -1)

    # -- chunks -------------------------------------------------------------------------------

    def apply(self, kind: str, seeds: np.ndarray, *, chunk_rows: int | None = None,
              should_stop: Callable[[], bool] | None = None,
              on_chunk: Callable[[int, np.ndarray], None] | None = None, keep: bool = True) -> np.ndarray:
        """``kind`` products of flat ``seeds`` ``(k, size)``, ``chunk_rows`` seeds per call (None: all at once;
        halved on out-of-memory): ``(k, out size)`` in ``compute_dtype``. ``on_chunk(start, rows)`` hears of each
        chunk; ``should_stop()`` is asked before each and raises ``Stopped``. ``keep=False`` (a caller that
        streams the chunks away through ``on_chunk``) holds no products: the result is then empty."""
        seeds = np.ascontiguousarray(seeds, dtype=self.compute_dtype)
        total = len(seeds)
        if total == 0:
            return np.empty((0, self.n_of if kind_spec(kind).product_axes == "of" else self.n_wrt), self.compute_dtype)
        planning = chunk_rows is None and self.probe is not None and total > FIRST_SEEDS
        step = max(1, min(chunk_rows or self.planned.get(kind) or (FIRST_SEEDS if planning else total), total))
        out = np.empty(0)
        start = 0
        while start < total:
            if should_stop is not None and should_stop():
                raise Stopped("canceled between chunks", field=None)
            n = min(step, total - start)
            try:
                if planning and kind not in self.planned:
                    rows = self._measured_call(kind, seeds[start:start + n], total)
                    step = self.planned[kind]
                else:
                    rows = self.call(kind, seeds[start:start + n])
            except Exception as err:  # noqa: BLE001 - out of memory halves the chunk; anything else is raised
                if not is_out_of_memory(err):
                    raise
                if n <= 1:
                    raise MemoryBudgetTooSmall("memory_budget_bytes: out of memory even at one seed per call; free "
                                               "device memory", field="memory_budget_bytes") from err
                step, self.oom_retries = n // 2, self.oom_retries + 1
                continue
            if keep and start == 0:
                out = np.empty((total,) + rows.shape[1:], rows.dtype)
            if keep:
                out[start:start + n] = rows
            self.counts[kind] = self.counts.get(kind, 0) + n
            if on_chunk is not None:
                on_chunk(start, rows)
            start += n
        return out

    def _measured_call(self, kind: str, seeds: np.ndarray, total: int) -> np.ndarray:
        """``_call`` with its peak read: seeds per call for the rest of ``kind``'s products (``planned``)."""
        from worker.engine.chunk_run import SAFETY

        limit = int(self.probe.free_bytes())
        if self.budget_bytes is not None:
            limit = min(limit, int(self.budget_bytes))
        self.probe.reset_peak()
        rows = self.call(kind, seeds)
        peak = int(self.probe.peak_bytes())
        per_seed = peak / max(1, len(seeds))
        self.planned[kind] = total if per_seed <= 0 else max(1, min(total, int(SAFETY * limit / per_seed)))
        return rows

    def call(self, kind: str, seeds: np.ndarray) -> np.ndarray:
        if kind in self.middles:   # J^T M J: a JVP, M on the host, a VJP
            from worker.engine.curvature import sandwich

            return sandwich(self, self.middles[kind], seeds)
        if self.jacobian_rows is not None and jvp_rows.transposes(kind):   # J kept by reverse/rows: u^T J on the host
            return seeds @ self.jacobian_rows
        label = self.labels.get(kind)
        if label is None:
            return self._choose(kind, seeds)
        rows = self._run(kind, label, seeds)
        self._keep_trace(kind, label)
        return rows

    # -- choosing how -------------------------------------------------------------------------

    def candidates(self, kind: str) -> list[str]:
        """The labels a kind's first call tries, in order (``product_labels.candidates``)."""
        return product_labels.candidates(self, kind)

    def _choose(self, kind: str, seeds: np.ndarray) -> np.ndarray:
        """The first call of ``kind``: its seeds and a probe row through each candidate label until one runs and
        its probe row agrees with the eager reverse-mode reference; that label is kept."""
        probe = np.random.default_rng(PROBE_SEED).standard_normal((1, seeds.shape[1])).astype(self.compute_dtype)
        if kind not in self._references:   # kept: a first call that runs out of memory comes back here, halved
            along_of = kind_spec(kind).product_axes == "of"   # J t: checked against J^T u
            self._references[kind] = self._adjoint(probe) if along_of else self._reference(kind, probe)
        reference = self._references[kind]
        batch = np.concatenate([seeds, probe])
        for label in self.candidates(kind):
            try:
                rows = self._run(kind, label, batch)
            except EngineError:
                raise
            except Exception as err:  # noqa: BLE001 - out of memory goes to the chunk loop; others: next label
                if is_out_of_memory(err):
                    raise
                self.failures[label] = error_summary(err)
                log.info("%s: %s failed: %s", kind, label, self.failures[label])
                continue
            if reference is not None and not agrees(rows[-1], probe[0], reference):
                self.failures[label] = "disagrees with the eager reverse-mode reference"
                self.counts["checks"] += len(batch)
                continue
            self.labels[kind] = label
            self.counts["checks"] += 1
            self._keep_trace(kind, label)
            if self.on_choice is not None:
                self.on_choice()
            return rows[:-1]
        raise jvp_rows.refusal(self, kind)

    def _reference(self, kind: str, probe: np.ndarray) -> np.ndarray | None:
        """One eager reverse-mode product of ``probe`` (None when eager mode cannot compute it)."""
        try:
            row = self._run(kind, "reverse/eager", probe)[0]
        except EngineError:
            raise
        except Exception as err:  # noqa: BLE001 - no reference: the first label that runs is taken
            self.failures["reference"] = error_summary(err)
            return None
        self.counts["checks"] += 1
        return row

    def _adjoint(self, tangent: np.ndarray) -> Any:
        """The reference of a JVP probe row ``J t``: one eager reverse-mode VJP ``w = J^T u`` of a random ``u``,
        so that ``u . J t`` must equal ``w . t`` (a single backward pass; an eager JVP of a large model costs
        a derivative of a derivative, 5x as long). The eager JVP row when ``w`` is not finite."""
        u = np.random.default_rng(PROBE_SEED + 1).standard_normal((1, self.n_of)).astype(self.compute_dtype)
        try:
            w = self._run("vjp", "reverse/eager", u)[0]
        except EngineError:
            raise
        except Exception as err:  # noqa: BLE001 - as _reference: no adjoint, the JVP's own eager row
            self.failures["reference"] = error_summary(err)
            w = None
        if w is None or not np.isfinite(w).all():
            return self._reference("jvp", tangent)
        self.counts["checks"] += 1
        return Adjoint(u[0], w)

    def _run(self, kind: str, label: str, seeds: np.ndarray) -> np.ndarray:
        """``kind`` products of ``seeds`` by ``label``: one call (``vectorized``) or one per seed."""
        import tensorflow as tf

        if label == jvp_rows.LABEL:
            return jvp_rows.jvp_by_rows(self, seeds)
        with tf_logs.captured(f"{kind} {label}"):   # pfor's and the loop converters' dumps: one line per failure
            if label.endswith("/eager"):
                run = body(tf, self, kind, label)
                return np.concatenate([np.asarray(run(tf.constant(seeds[i:i + 1]), self.inputs))
                                       for i in range(len(seeds))])
            fn = self._compiled(tf, kind, label)
            if label.endswith("/loop"):
                return np.concatenate([np.asarray(fn(tf.constant(seeds[i:i + 1]), self.inputs))
                                       for i in range(len(seeds))])
            return np.asarray(fn(tf.constant(seeds), self.inputs))

    def key(self, kind: str, label: str) -> ProductKey:
        inputs = tuple(sorted((n, t.dtype.name) for n, t in self.inputs.items()))
        return ProductKey(self.of, self.axis.names, self.axis.optional, kind, label,
                          self.reduce if kind_spec(kind).scalar_of else None, self.compute_dtype, inputs)

    def _trace_key(self, kind: str, label: str) -> tuple[Any, ...] | None:
        if not (self.trace_dir and self.model.fingerprint) or label.endswith(("/eager", "/rows")):
            return None
        return ("product-trace", trace_cache.code_digest(), self.model.fingerprint, self.model.signature,
                trace_cache.input_shapes(self.inputs), self.key(kind, label))

    def _keep_trace(self, kind: str, label: str) -> None:
        """Store the chosen label's traced function for later processes (``trace_cache``), once per process."""
        trace_cache.keep(self.trace_dir, self._trace_key(kind, label), self.model.compiled.peek(self.key(kind, label)),
                         self.model.variables)

    def _compiled(self, tf: Any, kind: str, label: str) -> Any:
        pfor_patches.install()

        def build() -> Any:
            key = self._trace_key(kind, label)
            stored = trace_cache.load(self.trace_dir, key, self.model.variables) if key else None
            if stored is not None:
                return stored
            spec = {n: tf.TensorSpec(s.shape, s.dtype) for n, s in self.model.input_specs.items()}
            traced = functools.partial(body(tf, self, kind, label))  # see strategies._compiled (and AutoGraph)
            return tf.function(traced, reduce_retracing=False, autograph=False,
                               input_signature=[tf.TensorSpec([None, None], self.compute_dtype), spec])

        return self.model.compiled.get(self.key(kind, label), build)


def build_operator(model: LoadedModel, inputs: dict[str, Any], *, of: str | None = None,
                   wrt: str | Sequence[str] | None = None, kind: str | None = None, reduce: str | None = None,
                   output_dtype: str | None = None, routes: dict[str, str] | None = None) -> Operator:
    """Resolve and check a matrix-free request (raises InvalidRequest naming the field): the inputs against the
    signature, ``of``, ``wrt`` (one name, a list, ``"variables/*"``), and for a Hessian ``kind`` a scalar ``of``
    (or ``reduce='sum'``); one eager forward pass gives ``of``'s shape. ``routes``: ``{"jvp"|"hvp": "auto" |
    "forward" | "reverse"}`` (default ``auto``)."""
    if kind is not None and kind not in MATRIX_FREE_KINDS:
        raise InvalidRequest(f"kind: {kind!r} is not a matrix-free kind; use one of: "
                             + ", ".join(repr(k) for k in MATRIX_FREE_KINDS), field="kind")
    ruled(rules.check_options, kind="jacobian", reduce=reduce, output_dtype=output_dtype)
    tensors = convert_inputs(model, inputs)
    of = ruled(rules.resolve_of, of, described(model)["outputs"], signature=model.signature)
    axis = wrt_axis(model, tensors, wrt)
    of_shape = probe_shape(model, tensors, of)
    of_dtype = model.output_specs[of].dtype.name
    compute = rules.result_dtype(of_dtype, axis.dtype)
    op = Operator(model, tensors, of=of, of_shape=of_shape, of_dtype=of_dtype, axis=axis, reduce=reduce,
                  dtype=rules.result_dtype(of_dtype, axis.dtype, output_dtype), compute_dtype=compute, routes=routes)
    if kind in MATRIX_FREE_HESSIAN_KINDS:
        op.require_hessian(kind)
    return op


def run_products(op: Operator, kind: str, seeds: Any, *, chunk_rows: int | None = None,
                 progress: Callable[[int, int | None], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 on_chunk: Callable[[int, np.ndarray], None] | None = None) -> MatFreeResult:
    """Kind ``jvp``, ``vjp`` or ``hvp`` as a result: ``products`` in ``op.dtype``, ``(k,) + of.shape`` for ``jvp``,
    ``(k,) + wrt.shape`` otherwise (``WrtAxis.shape``). ``on_chunk(start, rows)`` gets each chunk's rows in that
    layout and dtype as they come (for storage), then ``progress(seeds done, k)`` is called."""
    if kind not in PRODUCT_KINDS:
        raise InvalidRequest(f"kind: {kind!r} is not a product kind; use one of {', '.join(PRODUCT_KINDS)}",
                             field="kind")
    k = len(op.checked_seeds(kind, seeds))   # checked here: progress needs k before the first chunk
    before = dict(op.counts)
    along_of = kind_spec(kind).product_axes == "of"
    row_shape = op.of_shape if along_of else op.axis.shape

    def chunk(start: int, rows: np.ndarray) -> None:
        if on_chunk is not None:
            on_chunk(start, rows.astype(op.dtype).reshape((len(rows),) + row_shape))
        if progress is not None:
            progress(start + len(rows), k)

    streamed = on_chunk is not None   # the caller keeps the chunks: none are held here
    method = functools.partial(op.curvature_vp, kind) if kind_spec(kind).curvature else getattr(op, kind)
    product = method(seeds, chunk_rows=chunk_rows, should_stop=should_stop, on_chunk=chunk, keep=not streamed)
    arrays = {} if streamed else {"products": product if along_of else op.axis.unflatten(product)}
    how = op.labels.get(kind, "") if not kind_spec(kind).curvature else f"J^T M J: {op.labels.get('jvp')} JVPs, " \
        f"{op.labels.get('vjp')} VJPs"
    return MatFreeResult(kind=kind, method=how, arrays=arrays,
                         products={n: op.counts[n] - before.get(n, 0) for n in op.counts}, iterations=1,
                         attrs={"seeds": k})
