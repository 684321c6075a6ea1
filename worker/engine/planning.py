"""A request's plan: its key, a cached plan if there is one, and a default to start with at once."""

from __future__ import annotations

from typing import Any

from worker.engine.model import LoadedModel
from worker.engine.plan import Plan
from worker.engine.plan_cache import PlanCache
from worker.engine.problem import Problem, build_problem, plan_key
from worker.engine.runner import default_plan


def prepare(model: LoadedModel, inputs: dict[str, Any], *, cache: PlanCache | None, device: str,
            of: str | None = None, wrt: str | None = None, kind: str = "jacobian", mode: str = "auto",
            reduce: str | None = None, check_independence: bool = False, output_dtype: str | None = None,
            plan: Plan | None = None) -> tuple[Problem, Plan]:
    """``(problem, plan)`` for a request on ``device`` (``"CPU:0"``, ``"GPU:0"``).

    ``plan`` given (a shard's, from its planner) is used as it is; otherwise the cache's plan for
    this request's key, else a default (``default_plan``: by model structure, or the strategy a
    similar request of the cache ran with). A cached plan's checks spare ``build_problem`` its eager
    probes. Raises EngineError like ``build_problem``.
    """
    key = plan_key(model, inputs, of=of, wrt=wrt, kind=kind, mode=mode, reduce=reduce, device=device)
    if plan is None and cache is not None:
        plan = cache.get(key)
        if plan is not None:
            plan.source = "cache"
    problem = build_problem(model, inputs, of=of, wrt=wrt, kind=kind, mode=mode, reduce=reduce,
                            check_independence=check_independence, output_dtype=output_dtype,
                            checked=plan.checked if plan is not None else None)
    if plan is None:
        similar = cache.family_strategy(key) if cache is not None else None
        plan = default_plan(problem, similar=similar, key=key)
    plan.key = plan.key or key
    return problem, plan
