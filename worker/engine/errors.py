"""Domain errors of the engine; each message names the request field and the fix."""

from __future__ import annotations


class EngineError(Exception):
    """Base class; ``field`` is the request field at fault ("wrt", "inputs.x", ...)."""

    transient = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    @property
    def type(self) -> str:
        return type(self).__name__


class InvalidRequest(EngineError):
    """The request does not fit the model: unknown names, wrong dtype or shape, bad kind."""


class NotDifferentiable(EngineError):
    """TensorFlow cannot differentiate the model along the requested path."""


class BatchNotIndependent(EngineError):
    """``batch_jacobian`` was asked for a model whose examples interact."""


class NotConverged(EngineError):
    """A spectral kind or a solve (``ihvp``) did not meet ``tol`` within ``max_iterations`` (and the request did not
    say ``allow_unconverged``): the message names the residuals and what to change; never a silent answer."""

    def __init__(self, message: str, *, field: str | None = "max_iterations", residuals: list[float] | None = None
                 ) -> None:
        super().__init__(message, field=field)
        self.residuals = residuals or []


class MemoryBudgetTooSmall(EngineError):
    """Not even one row fits in the memory budget or the free memory."""


class Stopped(EngineError):
    """``should_stop`` asked the run to stop between chunks (cancel)."""


class WrongRowsDelivered(EngineError):
    """A strategy was found wrong after it had delivered rows (``on_chunk``): ``ranges`` must be computed
    again, with ``learned`` (the plan that marks it ``disagrees``). ``compute_to_storage`` and
    ``compute_in_memory`` do so; a caller of ``run_problem`` with its own ``on_chunk`` must."""

    transient = True

    def __init__(self, message: str, *, ranges: list[tuple[int, int]], learned: object) -> None:
        super().__init__(message, field=None)
        self.ranges, self.learned = ranges, learned


class GPUMemoryReserved(EngineError):
    """TensorFlow reserved the whole GPU before memory growth (or a memory limit) was set: no plan can hold."""


class NotPositiveDefinite(EngineError):
    """Conjugate gradients met a direction of non-positive curvature: the damped matrix is not positive definite."""
