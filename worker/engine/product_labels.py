"""The labels a matrix-free kind's first call tries, in order (``Operator.candidates``; routes and strategies:
``worker.engine.matfree``'s docstring).

Forward mode first where it may run (not w.r.t. a variable), then reverse ``vectorized``, ``loop``, ``eager``, and
for ``jvp`` last ``reverse/rows`` (``jvp_rows``). ``tiled`` goes before ``vectorized`` on a large graph, after it
on a small one. A kind that differentiates twice (H v) on a graph with ``While`` loops tries ``reverse/loop`` first:
pfor cannot convert a loop's second derivative (TensorFlow 2.21: the loop gradient's ``TensorList`` accumulators
lack the handle data pfor needs) and takes 50-70 s to fail on a 6-variable RK4 integrator, forward mode over a
loop's gradient fails too, while ``reverse/loop``'s one-seed function traces in seconds (``tuning`` does the same
for the dense Hessian).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contracts.kinds import kind_spec
from worker.engine import jvp_rows
from worker.engine.errors import InvalidRequest
from worker.engine.products import tiled_ok, tiled_route
from worker.engine.tuning import SMALL_GRAPH_OPS

if TYPE_CHECKING:
    from worker.engine.matfree import Operator

LOOP_FIRST = "reverse/loop"


def candidates(op: Operator, kind: str) -> list[str]:
    """The labels ``kind``'s first call on ``op`` tries, in order; raises InvalidRequest (field ``mode``) for a
    route the kind has not."""
    spec = kind_spec(kind)
    asked, routes = op.routes.get(kind, "auto"), spec.routes
    if asked not in ("auto", *routes):
        raise InvalidRequest(f"mode: route {asked!r} cannot compute {kind}; use one of 'auto', "
                             + ", ".join(repr(r) for r in routes), field="mode")
    out = []
    if "forward" in routes and (asked == "forward" or (asked == "auto" and not op.axis.variables)):
        out.append("forward/vectorized")
    if asked != "forward":
        out += ["reverse/vectorized", "reverse/loop", "reverse/eager"]
        out += [jvp_rows.LABEL] if jvp_rows.applies(kind) else []   # last: J from VJPs (``jvp_rows``)
    route = tiled_route(kind)
    if route is not None and tiled_ok(op):
        tiled, vectorized = f"{route}/tiled", f"{route}/vectorized"
        if vectorized in out:   # a large graph or a loop of TensorLists: tiled first (pfor's trace of it costs
            # tens of seconds; pfor fails on that loop's gradient, ``strategies.pfor_fails_on_loops``)
            at = out.index(vectorized) + (op.model.graph_ops <= SMALL_GRAPH_OPS and not op.model.graph_list_loops)
            out.insert(at, tiled)
    if spec.scalar_of and op.model.graph_loops and LOOP_FIRST in out:   # H v through loops: no pfor first
        out.insert(0, out.pop(out.index(LOOP_FIRST)))
    return out
