"""The kinds, declared once: family, request fields, result arrays, and what each can do (shards, resume, sparsity).

Every other place asks this registry (``kind_spec(name)``) instead of comparing kind names: the API's
rules (``contracts.jobspec``), the worker's executors (``worker.execution``), the previews and the CLI.
A new kind is one ``KindSpec`` here and one executor (docs/ARCHITECTURE.md, "Adding a kind").
No TensorFlow here: the API imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Family(str, Enum):
    """How a kind is computed; each family has one executor in ``worker.execution``."""

    dense = "dense"          # the matrix, rows streamed into the ``jacobian`` array (chunk planner, strategies)
    products = "products"    # J v, v^T J, H v of given seeds, streamed into ``products``
    spectral = "spectral"    # a few values (and vectors) of J or H, by Krylov methods or sampling


@dataclass(frozen=True)
class Spectrum:
    """A spectral kind's method and words. ``algorithm``: the method of ``worker.engine.spectra`` that computes
    it. ``counted``: what ``rank`` counts, in messages ("" when the kind takes no rank). For ``preview.png``:
    ``title`` (with ``{of}`` and ``{wrt}``), ``value`` (one value's name: the y label, or the symbol of a 0-d
    value), ``order`` (the x label), ``residual`` (the footer: what the residuals measure) and ``log_scale``
    (a log axis when the values are positive and span decades)."""

    algorithm: str
    title: str
    value: str
    counted: str = ""
    order: str = ""
    residual: str = ""
    log_scale: bool = False


@dataclass(frozen=True)
class KindSpec:
    """One kind: how it is asked for and what it stores.

    ``arrays``: the result group's arrays, the main one first; ``dims``: each one's axes, in words that
    ``contracts.layout.array_dimension_names`` spells out (``"of"``, ``"wrt"``: that tensor's axes, without
    the batch axis when ``batch_axis``; ``"wrt2"``: a Hessian's second copy of ``wrt``'s; any other word:
    one axis of that name). ``seeds``: the trailing shape of the seeds (``"wrt"``: tangents, ``"of"``:
    cotangents), None when the kind takes none. ``scalar_of``: ``of`` must be a scalar (or ``reduce: "sum"``):
    the kind differentiates twice (H, its products or its spectrum). ``fields``: the kind's own request
    fields, and ``required`` those of them that must be given. ``several_wrt``: ``wrt`` may be a list or
    ``"variables/*"``; ``batch_axis``: the result has a per-example first axis (variables cannot be wrt).
    ``sparsity``: the ``sparsity`` option applies. ``shards``/``resume``: the unit a job splits into and
    resumes from (``"blocks"``: storage blocks of rows or seeds; None: no shards / starts over);
    ``sparse_unit``: the same for the ``sparsity`` route (``"colours"``: storage blocks of the compressed
    products, one row a colour; a pattern that does not pay falls back to ``shards``). ``preview``: how
    ``preview.png`` draws it (``heatmap``, ``products``, ``spectrum``; ``density``: a curve over its grid), with
    ``symbol`` and ``product_axes`` (the tensor a product row is shaped like) for the products. ``routes``: the
    modes a product kind can be computed by (``"forward"``: forward mode, tried first where it applies;
    ``"reverse"``). ``spectrum``: a spectral kind's method and words (``Spectrum``).
    """

    name: str
    family: Family
    arrays: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]
    summary: str
    seeds: str | None = None
    scalar_of: bool = False
    fields: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    several_wrt: bool = True
    batch_axis: bool = False
    sparsity: bool = False
    shards: str | None = "blocks"
    resume: str | None = "blocks"
    sparse_unit: str | None = None
    preview: str = "heatmap"
    symbol: str = ""          # the product's symbol in previews ("J v"), for the product kinds
    product_axes: str = ""    # the products' trailing axes: "of" or "wrt", for the product kinds
    routes: tuple[str, ...] = ()
    spectrum: Spectrum | None = None
    curvature: str = ""       # a product J^T M J with M applied on the host: "ggn" (the loss' Hessian), "fisher"
    applies: str = ""         # the product kind a spectral kind's algorithm runs ("hvp"); "curvature": the field's

    @property
    def main_array(self) -> str:
        return self.arrays[0]

    @property
    def matrix_free(self) -> bool:
        """Computed from products, never as the matrix (products and spectra)."""
        return self.family is not Family.dense

    @property
    def whole_matrix(self) -> str:
        """The dense kind that computes the whole matrix of this kind's products or spectrum (``hessian`` for
        a kind that differentiates twice, ``jacobian`` otherwise)."""
        return kinds_where(family=Family.dense, scalar_of=self.scalar_of, batch_axis=False)[0]

    def dims_of(self, array: str) -> tuple[str, ...]:
        """The axes of ``array`` (one of ``arrays``) in the words of ``dims``."""
        return self.dims[self.arrays.index(array)]


_SVD = Spectrum("subspace_iteration", "Singular values of ∂{of}/∂{wrt}", "singular value", counted="singular values",
                order="k (largest first)", residual="residual ||J v - s u|| / s", log_scale=True)
_EIG = Spectrum("lanczos", "Eigenvalues of the Hessian of {of} w.r.t. {wrt}", "eigenvalue", counted="eigenpairs",
                order="k (largest magnitude first)", residual="residual ||H v - λ v||")
_TRACE = Spectrum("trace_estimate", "Trace of the Hessian of {of} w.r.t. {wrt}", "tr(H)")
_GGN_EIG = Spectrum("lanczos", "Eigenvalues of the Gauss-Newton matrix of the loss of {of} w.r.t. {wrt}", "eigenvalue",
                    counted="eigenpairs", order="k (largest magnitude first)", residual="residual ||G v - λ v||")
_GGN_TRACE = Spectrum("trace_estimate", "Trace of the Gauss-Newton matrix of the loss of {of} w.r.t. {wrt}", "tr(G)")
_DIAG = Spectrum("diagonal", "Diagonal of the Hessian of {of} w.r.t. {wrt}", "H_ii", order="i (flat wrt index)")
_GGN_DIAG = Spectrum("diagonal", "Diagonal of the Gauss-Newton matrix of the loss of {of} w.r.t. {wrt}", "G_ii",
                     order="i (flat wrt index)")
_DENSITY = Spectrum("slq_density", "Spectral density of the Hessian of {of} w.r.t. {wrt}", "density",
                    order="eigenvalue")
_LOGDET = Spectrum("slq_logdet", "log det(H + damping·I) of {of} w.r.t. {wrt}", "log det")
_IHVP = Spectrum("conjugate_gradients", "(A + damping I)⁻¹ v of {of} w.r.t. {wrt}", "(A + λI)⁻¹ v",
                 residual="relative residual ||(A + λI) x - v|| / ||v||")

# the iterative spectra's fields: how many values, their accuracy, the iterations allowed, and whether a result
# that misses tol within them may be kept (else the job fails NotConverged)
_SPECTRUM_FIELDS = ("rank", "tol", "max_iterations", "allow_unconverged")

_SPECS = (
    KindSpec("jacobian", Family.dense, ("jacobian",), (("of", "wrt"),), "d of / d wrt, shape of.shape + wrt.shape",
             sparsity=True, sparse_unit="colours"),
    KindSpec("batch_jacobian", Family.dense, ("jacobian",), (("batch", "of", "wrt"),),
             "per example, shape (B,) + of.shape[1:] + wrt.shape[1:]", batch_axis=True),
    KindSpec("hessian", Family.dense, ("jacobian",), (("wrt", "wrt2"),),
             "d2 of / d wrt2 of a scalar of, shape wrt.shape + wrt.shape", scalar_of=True, sparsity=True,
             sparse_unit="colours"),
    KindSpec("jvp", Family.products, ("products",), (("seed", "of"),), "J v for each seed v: (k,) + of.shape",
             seeds="wrt", preview="products", symbol="J v", product_axes="of", routes=("forward", "reverse")),
    KindSpec("vjp", Family.products, ("products",), (("seed", "wrt"),), "v^T J for each seed v: (k,) + wrt.shape",
             seeds="of", preview="products", symbol="vᵀ J", product_axes="wrt", routes=("reverse",)),
    KindSpec("hvp", Family.products, ("products",), (("seed", "wrt"),), "H v for each seed v: (k,) + wrt.shape",
             seeds="wrt", scalar_of=True, preview="products", symbol="H v", product_axes="wrt",
             routes=("forward", "reverse")),
    KindSpec("svd", Family.spectral, ("S", "U", "V"), (("k",), ("k", "of"), ("k", "wrt")),
             "the rank largest singular values of J and their vectors", fields=_SPECTRUM_FIELDS, required=("rank",),
             shards=None, resume=None, preview="spectrum", spectrum=_SVD),
    KindSpec("hessian_eig", Family.spectral, ("eigenvalues", "eigenvectors"), (("k",), ("k", "wrt")),
             "the rank eigenpairs of H of largest magnitude", scalar_of=True, fields=_SPECTRUM_FIELDS,
             required=("rank",), shards=None, resume=None, preview="spectrum", spectrum=_EIG, applies="hvp"),
    KindSpec("hessian_trace", Family.spectral, ("trace", "stderr"), ((), ()),
             "tr(H) by Hutch++/Hutchinson with its stderr", scalar_of=True, fields=("samples",), shards=None,
             resume=None, preview="spectrum", spectrum=_TRACE, applies="hvp"),
    KindSpec("ggn_vp", Family.products, ("products",), (("seed", "wrt"),),
             "G v = J^T H_L J v for each seed v, H_L the loss' Hessian on of: (k,) + wrt.shape", seeds="wrt",
             fields=("loss",), required=("loss",), preview="products", symbol="G v", product_axes="wrt",
             routes=("reverse",), curvature="ggn"),
    KindSpec("fisher_vp", Family.products, ("products",), (("seed", "wrt"),),
             "F v = (1/N) sum_i g_i g_i^T v, g_i example i's loss gradient: (k,) + wrt.shape", seeds="wrt",
             fields=("loss", "labels"), required=("loss", "labels"), preview="products", symbol="F v",
             product_axes="wrt", routes=("reverse",), curvature="fisher"),
    KindSpec("ggn_eig", Family.spectral, ("eigenvalues", "eigenvectors"), (("k",), ("k", "wrt")),
             "the rank eigenpairs of the Gauss-Newton matrix G of largest magnitude",
             fields=("loss", *_SPECTRUM_FIELDS), required=("loss", "rank"), shards=None, resume=None,
             preview="spectrum", spectrum=_GGN_EIG, applies="ggn_vp"),
    KindSpec("ggn_trace", Family.spectral, ("trace", "stderr"), ((), ()),
             "tr(G) of the Gauss-Newton matrix by Hutch++/Hutchinson with its stderr", fields=("loss", "samples"),
             required=("loss",), shards=None, resume=None, preview="spectrum", spectrum=_GGN_TRACE,
             applies="ggn_vp"),
    KindSpec("ihvp", Family.spectral, ("solutions", "residuals", "iterations"), (("seed", "wrt"), ("seed",),
             ("seed",)), "(H + damping I)^-1 v or (G + damping I)^-1 v for each seed v, by conjugate gradients",
             seeds="wrt", fields=("curvature", "damping", "loss", "max_iterations", "precondition", "tol"),
             required=("damping",),
             shards=None, resume=None, preview="products", symbol="(A + λI)⁻¹ v", product_axes="wrt",
             spectrum=_IHVP, applies="curvature"),
    KindSpec("hessian_diag", Family.spectral, ("diagonal", "stderr"), (("wrt",), ("wrt",)),
             "diag(H): exact by unit-vector HVPs, else Hutchinson's estimate with a per-entry stderr",
             scalar_of=True, fields=("probes",), shards=None, resume=None, preview="spectrum", spectrum=_DIAG,
             applies="hvp"),
    KindSpec("ggn_diag", Family.spectral, ("diagonal", "stderr"), (("wrt",), ("wrt",)),
             "diag(G) of the Gauss-Newton matrix: exact by unit-vector G v products, else Hutchinson's estimate with a "
             "per-entry stderr", fields=("loss", "probes"), required=("loss",), shards=None, resume=None,
             preview="spectrum", spectrum=_GGN_DIAG, applies="ggn_vp"),
    KindSpec("spectral_density", Family.spectral, ("density", "grid", "nodes", "weights"),
             (("grid",), ("grid",), ("probe", "step"), ("probe", "step")),
             "the eigenvalue density of H by stochastic Lanczos quadrature", scalar_of=True,
             fields=("probes", "steps", "sigma"), shards=None, resume=None, preview="density", spectrum=_DENSITY,
             applies="hvp"),
    KindSpec("logdet", Family.spectral, ("logdet", "stderr"), ((), ()),
             "log det(H + damping I) by stochastic Lanczos quadrature with its stderr", scalar_of=True,
             fields=("probes", "steps", "damping"), shards=None, resume=None, preview="spectrum", spectrum=_LOGDET,
             applies="hvp"),
)

KINDS: dict[str, KindSpec] = {s.name: s for s in _SPECS}
KIND_FIELDS = tuple(sorted({f for s in _SPECS for f in s.fields}))   # rank, samples, tol, loss, damping, ...
LOSSES = ("mse", "softmax_cross_entropy", "sigmoid_cross_entropy")   # the ``loss`` field's values
CURVATURES = {"hessian": "hvp", "ggn": "ggn_vp"}   # the ``curvature`` field's values: the product kind of each
FIELD_HELP = {   # what a kind's own field holds, for "kind X needs <field>: ..." messages
    "rank": "how many values to compute (e.g. 5)", "loss": "the loss on of, one of " + ", ".join(LOSSES),
    "labels": "the name of the input (a member of inputs) that holds the labels",
    "damping": "the positive damping added to the diagonal (e.g. 1e-3)",
}


def kind_spec(name: str) -> KindSpec:
    """The spec of kind ``name`` (a ``Kind`` enum member or its value); ``KeyError`` for an unknown one."""
    return KINDS[getattr(name, "value", name)]


def spec_or_jacobian(name: object) -> KindSpec:
    """The spec of ``name`` as a result group's ``kind`` attribute says it; ``jacobian``'s for none or unknown."""
    return KINDS.get(str(getattr(name, "value", name) or ""), KINDS["jacobian"])


def kinds_where(**wanted: object) -> tuple[str, ...]:
    """The kind names whose specs have every attribute ``wanted`` (``kinds_where(family=Family.products)``)."""
    return tuple(s.name for s in _SPECS if all(getattr(s, k) == v for k, v in wanted.items()))


def kinds_taking(field: str) -> tuple[str, ...]:
    """The kinds that take the request field ``field`` (``rank``, ``tol``, ``max_iterations``,
    ``allow_unconverged``, ``samples``, ``probes``, ...)."""
    return tuple(s.name for s in _SPECS if field in s.fields)


def applied_product(spec: KindSpec, curvature: str | None = None) -> str:
    """The product kind whose products ``spec``'s algorithm runs: its ``applies``, or for ``"curvature"`` the product
    of the request's ``curvature`` field (default ``"hessian"``); "" for a kind with none (``svd``)."""
    if spec.applies == "curvature":
        return CURVATURES[curvature or "hessian"]
    return spec.applies


def multiplies(spec: KindSpec, curvature: str | None = None) -> KindSpec:
    """The spec of the matrix ``spec`` multiplies by or analyses: its applied product's (``hvp``: the Hessian, scalar
    ``of``; ``ggn_vp``: a loss' curvature), itself when it has none."""
    product = applied_product(spec, curvature)
    return KINDS[product] if product else spec


def several_wrt(wrt: object) -> bool:
    """``wrt`` names more than one source: a list of two or more, or ``"variables/*"`` (alone or in a list)."""
    if isinstance(wrt, (list, tuple)):
        return len(wrt) > 1 or any(w == "variables/*" for w in wrt)
    return wrt == "variables/*"


def no_batch_axis_variable(kind: str, variable: str) -> str:
    """The refusal of a variable as ``wrt`` of a per-example kind (the API's and the engine's words)."""
    return (f"wrt: kind {kind!r} differentiates per example, and {variable!r} has no batch axis; name inputs "
            "with a batch axis, or use kind 'jacobian' for variables")
