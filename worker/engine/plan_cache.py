"""Where plans are kept between processes: a Protocol and its in-memory, folder and tiered forms.

The worker adds a Redis level (``worker.plan_store.RedisPlanCache``) in front of a folder, so every
worker of a service shares what one learnt; ``jacobian compute`` uses the folder alone. A stored
plan that cannot be read, or is of another format or key, is a miss: a cache never makes a job fail.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from contracts.files import write_atomically
from contracts.plans import default_cache_dir as default_cache_dir  # re-exported: the engine's name for it
from worker.engine.plan import Plan, PlanKey

log = logging.getLogger(__name__)


@runtime_checkable
class PlanCache(Protocol):
    def get(self, key: PlanKey) -> Plan | None:
        """The plan stored for ``key``, or None."""

    def put(self, plan: Plan) -> None:
        """Store ``plan`` under ``plan.key`` (and its strategy as its family's default)."""

    def family_strategy(self, key: PlanKey) -> str | None:
        """The strategy the last plan of ``key.family`` (same request, other shapes) ran with."""


def checked_plan(raw: str | bytes | None, key: PlanKey, where: str) -> Plan | None:
    if raw is None:
        return None
    try:
        plan = Plan.loads(raw)
    except (ValueError, KeyError, TypeError) as err:
        log.info("plan %s at %s is not usable (%s); planning afresh", key.digest, where, err)
        return None
    if plan.key != key:
        log.info("plan %s at %s was stored for another request; planning afresh", key.digest, where)
        return None
    return plan


class MemoryPlanCache:
    """Plans in this process only (tests, notebooks)."""

    def __init__(self) -> None:
        self._plans: dict[str, str] = {}
        self._families: dict[str, str] = {}

    def get(self, key: PlanKey) -> Plan | None:
        return checked_plan(self._plans.get(key.digest), key, "memory")

    def put(self, plan: Plan) -> None:
        if plan.key is None:
            return
        self._plans[plan.key.digest] = plan.dumps()
        self._families[plan.key.family] = plan.strategy

    def family_strategy(self, key: PlanKey) -> str | None:
        return self._families.get(key.family)


class DiskPlanCache:
    """Plans as JSON files under ``root/plans/`` (written atomically; unreadable files are misses)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def _path(self, name: str) -> Path:
        return self.root / "plans" / f"{name}.json"

    def get(self, key: PlanKey) -> Plan | None:
        path = self._path(key.digest)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            log.warning("plan cache %s is not readable (%s)", path, err)
            return None
        return checked_plan(raw, key, str(path))

    def put(self, plan: Plan) -> None:
        if plan.key is None:
            return
        try:
            self._write(self._path(plan.key.digest), plan.dumps())
            self._write(self._path("family-" + plan.key.family), json.dumps({"strategy": plan.strategy}))
            self._write(self._path("request-" + plan.key.request), plan.dumps())   # for dry runs (contracts.plans)
        except OSError as err:  # a full or read-only disk costs the next job a plan, nothing more
            log.warning("plan cache %s is not writable (%s)", self.root, err)

    def family_strategy(self, key: PlanKey) -> str | None:
        try:
            return str(json.loads(self._path("family-" + key.family).read_bytes())["strategy"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def _write(path: Path, text: str) -> None:
        write_atomically(path, text.encode())


class TieredPlanCache:
    """Levels tried in order (e.g. Redis, then a folder); a hit further down fills the levels above."""

    def __init__(self, *levels: PlanCache) -> None:
        self.levels = levels

    def get(self, key: PlanKey) -> Plan | None:
        for i, level in enumerate(self.levels):
            plan = level.get(key)
            if plan is not None:
                for above in self.levels[:i]:
                    above.put(plan)
                return plan
        return None

    def put(self, plan: Plan) -> None:
        for level in self.levels:
            level.put(plan)

    def family_strategy(self, key: PlanKey) -> str | None:
        for level in self.levels:
            found = level.family_strategy(key)
            if found is not None:
                return found
        return None
