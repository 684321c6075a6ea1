"""``jacobian compute --dry-run``: the quote of a local run (``contracts.quote``), nothing computed or written.

The inputs' shapes come from the ``.npz`` headers, the signature from ``saved_model.pb`` (no TensorFlow), ``of``
and ``wrt`` are resolved by the rules a POST meets, and the prediction comes from the plan this machine's cache
folder keeps for the request (``plans/request-<digest>.json``, written by earlier local runs and workers).
"""

from __future__ import annotations

from typing import Any

from contracts.jobspec import SEEDS_MEMBER, QueuedJob
from contracts.quote import Quote


def local_quote(job: QueuedJob, *, inputs_path: str, seeds_path: str | None, cache_dir: str | None,
                memory_budget_bytes: int | None) -> Quote:
    """Raises ``rules.RuleViolation`` (naming the field), ``SavedModelError``, ``SignatureNotFound``,
    ``npz.NpzError``, ``OSError`` or ``ValueError`` for what a run would refuse or could not read."""
    import numpy as np

    from contracts import npz, plans, rules, storage
    from contracts.kinds import kind_spec, several_wrt
    from contracts.quote import quote
    from contracts.savedmodel import read_saved_model

    info = read_saved_model(job.model.path)
    sig = info.signature(job.model.signature)
    with storage.open_file(inputs_path) as fh, npz.open_zip(fh) as zf:
        shapes = {m.name: (tuple(int(d) for d in m.shape), m.dtype.name) for m in npz.read_headers(zf)}
    if seeds_path is not None:
        seeds = np.load(seeds_path, mmap_mode="r", allow_pickle=False)
        shapes[SEEDS_MEMBER] = (tuple(seeds.shape), seeds.dtype.name)
    variables = info.variables_of(sig.name)
    extra = {SEEDS_MEMBER} | ({job.labels} if job.labels and job.labels not in sig.inputs else set())
    specs = {n: rules.Spec(d, s) for n, (s, d) in shapes.items() if n not in extra}
    wrt: Any
    if kind_spec(job.kind).matrix_free or several_wrt(job.wrt):
        rules.check_inputs(specs, sig.inputs, signature=sig.name)
        of = rules.resolve_of(job.of, sig.outputs, signature=sig.name)
        if job.wrt == "variables/*" or job.wrt == ["variables/*"]:
            wrt = "variables/*"
        elif isinstance(job.wrt, list):
            wrt = [rules.resolve_wrt(w, sig.inputs, variables, signature=sig.name) for w in job.wrt]
        else:
            wrt = rules.resolve_wrt(job.wrt, sig.inputs, variables, signature=sig.name)
    else:
        resolved = rules.check_request(kind=job.kind.value, of=job.of, wrt=job.wrt, reduce=job.reduce, inputs=specs,
                                       outputs=sig.outputs, variables=variables, signature=sig.name)
        of, wrt = resolved.of, resolved.wrt
    job = job.model_copy(update={"of": of, "wrt": wrt})
    request = plans.plan_request(job, shapes)
    plan = plans.disk_plan(cache_dir or plans.default_cache_dir(), request) if request else None
    return quote(job, sig, variables, shapes, memory_budget_bytes=memory_budget_bytes, plan=plan,
                 plan_name=plans.digest(plan["key"]) if plan else "")
