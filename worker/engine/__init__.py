"""Memory-bounded, chunked Jacobians of TensorFlow SavedModels (no Redis, HTTP or storage code).

See docs/ENGINE_API.md. TensorFlow is imported when a model is loaded, not at import time.
"""

from worker.engine.errors import (BatchNotIndependent, EngineError, InvalidRequest, MemoryBudgetTooSmall,
                                  NotDifferentiable, Stopped)
from worker.engine.memory import MemoryProbe, TFMemoryProbe
from worker.engine.model import LoadedModel, describe_signature, load_model
from worker.engine.planner import LinearFit, bucket_rows, fit_linear, plan_chunk
from worker.engine.problem import Problem, build_problem, verify_independence
from worker.engine.runner import RunReport, compute_in_memory, run_problem, select_strategy

__all__ = [
    "BatchNotIndependent", "EngineError", "InvalidRequest", "MemoryBudgetTooSmall", "NotDifferentiable", "Stopped",
    "MemoryProbe", "TFMemoryProbe", "LoadedModel", "describe_signature", "load_model", "LinearFit", "bucket_rows",
    "fit_linear", "plan_chunk", "Problem", "build_problem", "verify_independence", "RunReport", "compute_in_memory",
    "run_problem", "select_strategy",
]
