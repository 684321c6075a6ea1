"""``POST /v1/jobs?dry_run=true``: every check of a submission, then the quote (``contracts.quote``);
nothing is queued, no record or idempotency key is written, nothing is stored."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app import checks
from app.routes.models import load_signature
from app.submit import validate
from contracts import plans
from contracts.jobspec import SEEDS_MEMBER, QueuedJob
from contracts.jobstore import JobStore
from contracts.kinds import Family, kind_spec
from contracts.quote import Quote, Shapes, quote
from contracts.settings import Settings


def dry_run(body: bytes, media: str, query: Mapping[str, str], *, settings: Settings, store: JobStore) -> Quote:
    """The checks of ``app.submit.submit`` (read-only), then the quote, from the plan a worker persisted in
    Redis for this request when there is one."""
    queued, arrays = validate(body, media, query, settings)
    checks.check_pattern_from(queued.sparsity, store, model=queued.model, of=queued.of or "", wrt=str(queued.wrt))
    _, info, sig = load_signature(queued.model.path, queued.model.signature, settings.model_roots,
                                  op_allow=settings.model_op_allow, path_field="model.path",
                                  signature_field="model.signature")
    shapes: Shapes = {n: (tuple(int(d) for d in a.shape), a.dtype.name) for n, a in arrays.items()}
    request = plan_request(queued, shapes)
    plan = plans.redis_plan(store.connection, request) if request else None
    return quote(queued, sig, info.variables_of(sig.name), shapes, memory_budget_bytes=settings.memory_budget_bytes,
                 plan=plan, plan_name=plans.digest(plan["key"]) if plan else "")


def plan_request(queued: QueuedJob, shapes: Shapes) -> str | None:
    """The request digest of this job's plan (``contracts.plans``): dense kinds only, which are planned."""
    kind = kind_spec(queued.kind)
    if kind.family is not Family.dense or queued.sparsity is not None:
        return None
    key: dict[str, Any] = plans.request_key_json(
        model=plans.model_fingerprint(queued.model.path), signature=queued.model.signature, of=queued.of or "",
        wrt=queued.wrt, kind=kind.name, mode=queued.mode.value, reduce=queued.reduce,  # type: ignore[arg-type]
        inputs=[(n, s, d) for n, (s, d) in shapes.items() if n != SEEDS_MEMBER], batch_axis=kind.batch_axis)
    return plans.request_digest(key)
