"""A loaded SavedModel signature: its inputs, outputs and variables, and a cache of compiled chunks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from worker.engine.errors import InvalidRequest, NotDifferentiable


def _shape_list(shape: Any) -> list[int | None] | None:
    if shape.rank is None:
        return None
    return [None if d is None else int(d) for d in shape.as_list()]


@dataclass
class LoadedModel:
    """``fn(**inputs) -> dict`` is the signature's concrete function; ``loaded`` keeps it alive."""

    path: str
    signature: str
    loaded: Any
    fn: Any
    input_specs: dict[str, Any]
    output_specs: dict[str, Any]
    variables: dict[str, Any]
    compiled: dict[tuple, Any] = field(default_factory=dict)
    trials: dict[tuple, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def find_variable(self, name: str) -> tuple[str, Any]:
        """The variable called ``name`` (``:0`` optional; a unique suffix such as ``kernel`` of one layer works)."""
        key = name[:-2] if name.endswith(":0") else name
        if key in self.variables:
            return key, self.variables[key]
        matches = [n for n in self.variables if n.endswith("/" + key)]
        if len(matches) == 1:
            return matches[0], self.variables[matches[0]]
        choices = ", ".join(f"'variables/{n}'" for n in sorted(self.variables)) or "(the model has no variables)"
        why = "is ambiguous" if matches else "is not a variable of this model"
        raise InvalidRequest(f"wrt: 'variables/{name}' {why}; choose one of: {choices}", field="wrt")


def load_model(path: str, signature: str = "serving_default") -> LoadedModel:
    """Load ``signature`` of the SavedModel at ``path`` (raises InvalidRequest naming the field)."""
    import tensorflow as tf

    try:
        loaded = tf.saved_model.load(str(path))
    except (OSError, ValueError, tf.errors.OpError) as err:
        raise InvalidRequest(f"model.path: cannot load a SavedModel from {path!r}: {err}", field="model.path") from err
    signatures = dict(getattr(loaded, "signatures", {}) or {})
    if signature not in signatures:
        names = ", ".join(repr(n) for n in sorted(signatures)) or "(none)"
        raise InvalidRequest(f"model.signature: {signature!r} is not a signature of {path!r}; choose one of: {names}",
                             field="model.signature")
    fn = signatures[signature]
    input_specs = dict(fn.structured_input_signature[1])
    outputs = fn.structured_outputs
    if not isinstance(outputs, dict):
        raise NotDifferentiable(f"model.signature: {signature!r} does not return a dict of named outputs",
                                field="model.signature")
    output_specs = {name: tf.TensorSpec(t.shape, t.dtype, name) for name, t in outputs.items()}
    variables = {}
    for v in fn.variables:
        name = v.name[:-2] if v.name.endswith(":0") else v.name
        variables.setdefault(name, v)
    return LoadedModel(path=str(path), signature=signature, loaded=loaded, fn=fn, input_specs=input_specs,
                       output_specs=output_specs, variables=variables)


def describe_signature(model: LoadedModel) -> dict[str, dict[str, dict[str, Any]]]:
    """Inputs, outputs and variables with dtype and shape (``None`` for free dimensions)."""
    def spec(s: Any) -> dict[str, Any]:
        return {"dtype": s.dtype.name, "shape": _shape_list(s.shape)}

    return {
        "inputs": {n: spec(s) for n, s in sorted(model.input_specs.items())},
        "outputs": {n: spec(s) for n, s in sorted(model.output_specs.items())},
        "variables": {n: spec(v) for n, v in sorted(model.variables.items())},
    }
