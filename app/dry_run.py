"""``POST /v1/jobs?dry_run=true``: every check of a submission, then the quote (``contracts.quote``);
nothing is queued, no record or idempotency key is written, nothing is stored."""

from __future__ import annotations

from collections.abc import Mapping

from app import checks
from app.notify import check_notify
from app.routes.models import load_signature
from app.submit import validate
from contracts import plans
from contracts.jobstore import JobStore
from contracts.quote import Quote, Shapes, quote
from contracts.settings import ApiKey, Settings


def dry_run(body: bytes, media: str, query: Mapping[str, str], *, settings: Settings, store: JobStore,
            api_key: ApiKey | None = None) -> Quote:
    """The checks of ``app.submit.submit`` (read-only), then the quote, from the plan a worker persisted in
    Redis for this request when there is one."""
    queued, arrays = validate(body, media, query, settings)
    check_notify(queued.notify, settings, api_key)
    checks.check_pattern_from(queued.sparsity, store, model=queued.model, of=queued.of or "",
                              wrt=str(queued.wrt), kind=queued.kind.value)
    _, info, sig = load_signature(queued.model.path, queued.model.signature, settings.model_roots,
                                  op_allow=settings.model_op_allow, path_field="model.path",
                                  signature_field="model.signature")
    shapes: Shapes = {n: (tuple(int(d) for d in a.shape), a.dtype.name) for n, a in arrays.items()}
    request = plans.plan_request(queued, shapes)
    plan = plans.redis_plan(store.connection, request) if request else None
    return quote(queued, sig, info.variables_of(sig.name), shapes, memory_budget_bytes=settings.memory_budget_bytes,
                 plan=plan, plan_name=plans.digest(plan["key"]) if plan else "")
