"""Several ``wrt`` at once: names resolved, flattened and concatenated into one ``wrt`` axis.

``wrt`` may be one name, a list of names (inputs and ``variables/<name>``, each resolved by
``contracts.rules.resolve_wrt``, so a bad one is refused naming the field ``wrt``) or the string
``"variables/*"``: every trainable float variable the signature reads, in the order the model lists
them (``LoadedModel.variables``, which is the order of ``GET /v1/models/signature``: the function's
captured inputs). ``"variables/*"`` may also be one item of a list (``["x", "variables/*"]``). A
source named twice (a suffix and the full name of one variable, or a variable and ``"variables/*"``)
is refused.

The sources are flattened (row-major) and concatenated in that order: ``WrtAxis.slices`` maps each
resolved name to its ``[start, stop)`` on the axis and its shape (``wrt_slices`` of the result
group), ``WrtAxis.shape`` is the one ``wrt``'s shape, or ``(size,)`` for several.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts import rules
from worker.engine.errors import InvalidRequest
from worker.engine.model import LoadedModel, shape_tuple

ALL_VARIABLES = rules.VARIABLE_PREFIX + "*"


def trainable_variables(model: LoadedModel) -> list[str]:
    """``variables/<name>`` of every trainable float variable of the signature, in the model's order."""
    return [rules.VARIABLE_PREFIX + n for n, v in model.variables.items()
            if getattr(v, "trainable", True) and rules.is_differentiable(v.dtype.name)]


def _spec(t: Any) -> rules.Spec:
    return rules.Spec(t.dtype.name, shape_tuple(t.shape))


def resolve_wrt_names(model: LoadedModel, wrt: str | Sequence[str] | None,
                      inputs: dict[str, Any]) -> tuple[tuple[str, ...], frozenset[str]]:
    """``(resolved names in axis order, the names that came from "variables/*")``; raises InvalidRequest
    (field ``wrt``). ``inputs``: the request's tensors (their dtypes and shapes)."""
    given = [wrt] if wrt is None or isinstance(wrt, str) else list(wrt)
    if not given:
        raise InvalidRequest("wrt: an empty list names nothing to differentiate with respect to; give input names, "
                             f"'variables/<name>' or {ALL_VARIABLES!r}", field="wrt")
    described_inputs = {n: _spec(t) for n, t in inputs.items()}
    variables = {n: _spec(v) for n, v in model.variables.items()}
    names: list[str] = []
    expanded: set[str] = set()
    for item in given:
        if item is not None and not isinstance(item, str):
            raise InvalidRequest(f"wrt: each item must be a name (a string), got {item!r}", field="wrt")
        if item == ALL_VARIABLES:
            found = trainable_variables(model)
            if not found:
                raise InvalidRequest(f"wrt: {ALL_VARIABLES!r} names no variable: signature {model.signature!r} reads "
                                     "no trainable float variable; differentiate with respect to an input", field="wrt")
            twice = [n for n in found if n in names]
            if twice:
                raise InvalidRequest(f"wrt: {twice[0]!r} is named twice (on its own and by {ALL_VARIABLES!r}); "
                                     "name each input or variable once", field="wrt")
            names.extend(found)
            expanded.update(found)
            continue
        try:
            name = rules.resolve_wrt(item, described_inputs, variables, signature=model.signature)
        except rules.RuleViolation as err:
            raise InvalidRequest(str(err), field=err.field) from None
        if name in names:
            also = f" and by {ALL_VARIABLES!r}" if name in expanded else ""
            raise InvalidRequest(f"wrt: {name!r} is named twice (as {item!r}{also}); name each input or variable "
                                 "once", field="wrt")
        names.append(name)
    return tuple(names), frozenset(expanded)


@dataclass(frozen=True)
class WrtAxis:
    """One flat ``wrt`` axis: ``names`` (resolved) with their shapes and dtypes, concatenated in order.

    ``optional``: names that came from ``"variables/*"``; ``of`` may not depend on them (their slice of
    a gradient is then zero), where a name given explicitly that ``of`` does not depend on is an error.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    optional: frozenset[str] = frozenset()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        """One ``wrt``'s own shape, or ``(size,)`` for several: the trailing shape of products and vectors."""
        return self.shapes[0] if len(self.names) == 1 else (self.size,)

    @property
    def variables(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n.startswith(rules.VARIABLE_PREFIX))

    @property
    def slices(self) -> dict[str, dict[str, Any]]:
        """``{name: {"start", "stop", "shape"}}`` (JSON): the group attribute ``wrt_slices``."""
        out, start = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            out[name] = {"start": start, "stop": start + size, "shape": list(shape)}
            start += size
        return out

    @property
    def dtype(self) -> str:
        """The widest of the sources' dtypes (``contracts.rules.result_dtype`` of them)."""
        widest = self.dtypes[0]
        for d in self.dtypes[1:]:
            widest = rules.result_dtype(widest, d)
        return rules.result_dtype(widest, widest)

    def split(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The last axis of ``flat`` (``(..., size)``) as each source's array ``(...) + its shape``."""
        flat = np.asarray(flat)
        lead = flat.shape[:-1]
        return {name: flat[..., s["start"]:s["stop"]].reshape(lead + tuple(s["shape"]))
                for name, s in self.slices.items()}

    def unflatten(self, flat: np.ndarray) -> np.ndarray:
        """``(k, size)`` as ``(k,) + shape`` (one ``wrt``'s shape, or unchanged for several)."""
        flat = np.asarray(flat)
        return flat.reshape(flat.shape[:-1] + self.shape)

    def targets(self, model: LoadedModel, inputs: dict[str, Any]) -> list[Any]:
        """The tensors (from ``inputs``) and variables the names name, in axis order."""
        prefix = rules.VARIABLE_PREFIX
        return [model.variables[n[len(prefix):]] if n.startswith(prefix) else inputs[n] for n in self.names]


def wrt_axis(model: LoadedModel, inputs: dict[str, Any], wrt: str | Sequence[str] | None) -> WrtAxis:
    """The axis of ``wrt`` (one name, a list, or ``"variables/*"``) for the request's ``inputs`` (tensors)."""
    names, optional = resolve_wrt_names(model, wrt, inputs)
    prefix = rules.VARIABLE_PREFIX
    sources = [model.variables[n[len(prefix):]] if n.startswith(prefix) else inputs[n] for n in names]
    return WrtAxis(names=names, shapes=tuple(tuple(int(d) for d in s.shape) for s in sources),
                   dtypes=tuple(s.dtype.name for s in sources), optional=optional)
