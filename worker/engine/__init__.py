"""Memory-bounded, chunked Jacobians of TensorFlow SavedModels (no Redis, HTTP or storage code).

See docs/ENGINE_API.md. TensorFlow is imported when a model is loaded, not at import time, and without Keras and
JAX (``tf_import``: imported later where a model needs them).
"""

from worker.engine import tf_import
from worker.engine.errors import (
                                  BatchNotIndependent,
                                  EngineError,
                                  GPUMemoryReserved,
                                  InvalidRequest,
                                  MemoryBudgetTooSmall,
                                  NotDifferentiable,
                                  Stopped,
)
from worker.engine.memory import MemoryProbe, TFMemoryProbe
from worker.engine.model import LoadedModel, describe_signature, load_model
from worker.engine.plan import Plan, PlanKey, StrategyRecord
from worker.engine.plan_cache import DiskPlanCache, MemoryPlanCache, PlanCache, TieredPlanCache
from worker.engine.planner import LinearFit, bucket_rows, fit_linear, plan_chunk
from worker.engine.problem import Problem, build_problem, plan_key, verify_independence
from worker.engine.runner import RunOptions, RunReport, compute_in_memory, default_plan, rows_agree, run_problem

tf_import.install()   # none of the modules above imports TensorFlow: the engine's first use does, without Keras

__all__ = [
    "BatchNotIndependent", "EngineError", "GPUMemoryReserved", "InvalidRequest", "MemoryBudgetTooSmall",
    "NotDifferentiable", "Stopped",
    "MemoryProbe", "TFMemoryProbe", "LoadedModel", "describe_signature", "load_model", "Plan", "PlanKey",
    "StrategyRecord", "DiskPlanCache", "MemoryPlanCache", "PlanCache", "TieredPlanCache", "LinearFit",
    "bucket_rows", "fit_linear", "plan_chunk", "Problem", "build_problem", "plan_key", "verify_independence",
    "RunOptions", "RunReport", "compute_in_memory", "default_plan", "rows_agree", "run_problem",
]
