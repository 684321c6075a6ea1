"""Matrix-free operators of one worker, reused across jobs: the route each product kind chose (its trial against
the eager reference) is kept per request, so the next job on the same model, ``of``, ``wrt`` and input shapes
starts with the chosen route; the compiled functions themselves live on the loaded model (``model.compiled``)."""

from __future__ import annotations

from typing import Any


def request_key(op: Any) -> tuple[Any, ...]:
    """What makes two operators the same for their choices: model, signature, of, wrt, reduce, dtype, shapes."""
    shapes = tuple(sorted((n, tuple(int(d) for d in t.shape), t.dtype.name) for n, t in op.inputs.items()))
    return ("operator-choices", op.model.fingerprint, op.model.signature, op.of, op.axis.names, op.reduce,
            op.compute_dtype, shapes)


def cached_operator(model: Any, inputs: dict[str, Any], **options: Any) -> Any:
    """``worker.engine.matfree.build_operator(model, inputs, **options)`` whose chosen routes (``labels``) are shared
    with every operator of the same request in this process: the trial runs once per request and worker."""
    from worker.engine.matfree import build_operator

    op = build_operator(model, inputs, **options)
    op.labels = model.compiled.choices.setdefault(request_key(op), {})
    return op
