"""Plans shared by every worker of a service through Redis, in front of each worker's cache folder."""

from __future__ import annotations

import logging
from typing import Any

import redis

from contracts.plans import REQUEST_KEY_TEMPLATE
from worker.engine.plan import Plan, PlanKey
from worker.engine.plan_cache import DiskPlanCache, PlanCache, TieredPlanCache, checked_plan

log = logging.getLogger(__name__)


class RedisPlanCache:
    """``jacobian:plan:{digest}`` holds a plan (JSON), ``jacobian:plan-family:{family}`` the strategy
    of the last plan of that family, ``jacobian:plan-request:{request}`` the last plan of that request on
    any device (what a dry run quotes from, ``contracts.plans``). Plans expire after ``ttl_s`` unused
    (each read renews them). Redis errors are misses: a cache never fails a job."""

    plan_key_template = "jacobian:plan:{digest}"
    family_key_template = "jacobian:plan-family:{family}"

    def __init__(self, connection: Any, *, ttl_s: int = 30 * 24 * 3600) -> None:
        self.connection = connection
        self.ttl_s = ttl_s

    def get(self, key: PlanKey) -> Plan | None:
        name = self.plan_key_template.format(digest=key.digest)
        try:
            with self.connection.pipeline() as pipe:
                pipe.get(name)
                pipe.expire(name, self.ttl_s)
                raw, _ = pipe.execute()
        except redis.RedisError as err:
            log.warning("plan %s: Redis unreachable (%s); planning without it", key.digest, err)
            return None
        return checked_plan(raw, key, "redis")

    def put(self, plan: Plan) -> None:
        if plan.key is None:
            return
        try:
            with self.connection.pipeline() as pipe:
                pipe.set(self.plan_key_template.format(digest=plan.key.digest), plan.dumps(), ex=self.ttl_s)
                pipe.set(self.family_key_template.format(family=plan.key.family), plan.strategy, ex=self.ttl_s)
                pipe.set(REQUEST_KEY_TEMPLATE.format(digest=plan.key.request), plan.dumps(), ex=self.ttl_s)
                pipe.execute()
        except redis.RedisError as err:
            log.warning("plan %s: not stored in Redis (%s)", plan.key.digest, err)

    def family_strategy(self, key: PlanKey) -> str | None:
        try:
            raw = self.connection.get(self.family_key_template.format(family=key.family))
        except redis.RedisError:
            return None
        return raw.decode() if raw else None


def worker_plan_cache(connection: Any, cache_dir: str | None) -> PlanCache:
    """Redis first (shared by the service's workers), then this worker's cache folder."""
    return TieredPlanCache(RedisPlanCache(connection), DiskPlanCache(cache_dir))


class RedisBlobs:
    """Bytes by key in Redis for every worker of the service (the sparsity patterns of
    ``worker.engine.sparsity.patterns``), kept ``ttl_s`` after their last write."""

    def __init__(self, connection: Any, *, prefix: str = "jacobian:sparsity:", ttl_s: int = 30 * 24 * 3600) -> None:
        self.connection, self.prefix, self.ttl_s = connection, prefix, ttl_s

    def get(self, key: str) -> bytes | None:
        raw = self.connection.get(self.prefix + key)
        return bytes(raw) if raw is not None else None

    def put(self, key: str, data: bytes) -> None:
        self.connection.set(self.prefix + key, data, ex=self.ttl_s)
