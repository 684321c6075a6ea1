"""Second derivatives through a loaded ``While`` loop whose body reads a captured variable (issue 30).

A ``tf.while_loop`` that reads a ``tf.Variable`` takes the variable's resource handle as a loop variable, and
the ``While`` op passes it through to an output. TensorFlow 2.21 rebuilds a loaded SavedModel's functions from
their ``FunctionDef``s (``function_def_to_graph``), which restores the resource *handle data* (the variable's
dtype and shape) on a function's inputs and outputs only: the ``While`` op's resource outputs come back without
it. A first derivative never looks at them; a second derivative (the gradient of a function whose gradient
outputs that handle as an intermediate, nested tapes or a forward accumulator over a tape, in graph and eager
mode alike) asks for a zero gradient shaped like the variable and fails with "Internal error: Tried to take
gradients (or similar) of a variable without handle data" (``default_gradient.shape_and_dtype``). Users could
only re-export the model passing the variable's value into the loop.

``install`` wraps ``function_def_to_graph`` so that a ``While``/``StatelessWhile`` resource output without handle
data takes its loop input's (a loop variable passes through the body unchanged in type: the handle is the same
variable's). Nothing else changes: the graph's ops and values are those TensorFlow built. ``load_model`` installs
it before loading, so every function of a loaded model (and every loop body TensorFlow rebuilds later for a
gradient) has the handle data.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = False
WHILE_OPS = ("While", "StatelessWhile")


def _has_handle_data(t: Any) -> bool:
    from tensorflow.python.ops import resource_variable_ops

    data = resource_variable_ops.get_eager_safe_handle_data(t)
    return bool(data is not None and data.is_set and data.shape_and_type)


def restore_while_handles(graph: Any) -> int:
    """Copy handle data from each ``While`` op's resource inputs to its outputs where TensorFlow left none; returns
    how many outputs got it."""
    from tensorflow.python.framework import dtypes
    from tensorflow.python.ops import handle_data_util

    restored = 0
    for op in graph.get_operations():
        if op.type not in WHILE_OPS:
            continue
        for given, out in zip(op.inputs, op.outputs):
            if out.dtype == dtypes.resource and not _has_handle_data(out) and _has_handle_data(given):
                handle_data_util.copy_handle_data(given, out)
                restored += 1
    return restored


def install() -> None:
    """Wrap TensorFlow's ``function_def_to_graph`` once per process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from tensorflow.python.framework import function_def_to_graph as module

    original = module.function_def_to_graph

    def function_def_to_graph(*args: Any, **kwargs: Any) -> Any:
        graph = original(*args, **kwargs)
        restore_while_handles(graph)
        return graph

    module.function_def_to_graph = function_def_to_graph
    _INSTALLED = True
