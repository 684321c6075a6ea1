"""contracts.quotas: the token bucket on a fake clock, a result's bytes, limits from Settings and per-key overrides."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from contracts.quotas import QuotaLimits, result_bytes, seconds_to_utc_midnight, take_token, utc_day
from contracts.records import ResultInfo
from contracts.settings import Settings


def run_bucket(times: list[float], *, rate: float, size: int) -> list[float]:
    """``take_token`` at each time of ``times``: 0.0 for a request let through, else its retry-after."""
    bucket, out = None, []
    for now in times:
        bucket, wait = take_token(bucket, now_s=now, rate_per_s=rate, size=size)
        out.append(wait)
    return out


def test_a_full_bucket_lets_its_burst_through_then_refuses_until_a_token_refills():
    assert run_bucket([100.0] * 4, rate=2.0, size=3) == [0.0, 0.0, 0.0, 0.5]


def test_tokens_refill_at_the_rate_and_a_refused_request_takes_none():
    # 3 at t=0 empty it; at 0.25 half a token (refused, 0.25 s to go); at 0.5 one token: through
    waits = run_bucket([0.0, 0.0, 0.0, 0.25, 0.5, 0.5], rate=2.0, size=3)
    assert waits == [0.0, 0.0, 0.0, 0.25, 0.0, 0.5]


def test_the_bucket_never_holds_more_than_its_size():
    waits = run_bucket([0.0, 1000.0, 1000.0, 1000.0, 1000.0], rate=1.0, size=3)
    assert waits == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_a_clock_that_goes_back_refills_nothing():
    bucket, _ = take_token(None, now_s=10.0, rate_per_s=1.0, size=1)
    bucket, wait = take_token(bucket, now_s=5.0, rate_per_s=1.0, size=1)
    assert wait == 1.0 and bucket.tokens == 0.0


def test_a_steady_rate_over_the_limit_passes_the_rate_only():
    # 10 requests/s for 10 s against 2/s with a burst of 2: the burst, then 2 per second
    times = [i / 10 for i in range(100)]
    passed = sum(1 for w in run_bucket(times, rate=2.0, size=2) if w == 0.0)
    assert passed == 2 + 19  # refills at 0.5, 1.0, ... 9.5 s


def test_bucket_size_defaults_to_the_rate_rounded_up():
    assert QuotaLimits(requests_per_s=2.5).bucket_size == 3
    assert QuotaLimits(requests_per_s=0.2).bucket_size == 1
    assert QuotaLimits(requests_per_s=2.5, burst=10).bucket_size == 10


def test_result_bytes_of_dense_and_sparse_results():
    assert result_bytes(ResultInfo(uri="u", shape=[4, 2, 8], dtype="float32")) == 4 * 2 * 8 * 4
    assert result_bytes(ResultInfo(uri="u", shape=[3], dtype="bfloat16")) == 6
    coo = ResultInfo(uri="u", shape=[5], dtype="float64", format="coo", dense_shape=[10, 20])
    assert result_bytes(coo) == 5 * 8 + 2 * 5 * 8 + 11 * 8


def test_utc_day_and_midnight():
    assert utc_day(86400 * 3 + 5) == "1970-01-04"
    assert seconds_to_utc_midnight(86400 * 3 + 86399.5) == 1
    assert seconds_to_utc_midnight(86400 * 3) == 86400


def test_settings_defaults_apply_to_every_key_and_overrides_replace_field_by_field(monkeypatch):
    keys = [{"key": "k-a", "name": "a", "quotas": {"max_queued": 1}},
            {"key": "k-b", "name": "b"},
            {"key": "k-c", "name": "c", "quotas": {"max_queued": None, "requests_per_s": 50}}]
    monkeypatch.setenv("JACOBIAN_API_KEYS", json.dumps(keys))
    monkeypatch.setenv("JACOBIAN_QUOTA_MAX_QUEUED", "3")
    monkeypatch.setenv("JACOBIAN_QUOTA_MAX_CONCURRENT", "5")
    monkeypatch.setenv("JACOBIAN_QUOTA_REQUESTS_PER_S", "10")
    settings = Settings()
    a, b, c = (settings.quota_limits(k) for k in settings.api_keys)
    assert (a.max_queued, a.max_concurrent, a.requests_per_s) == (1, 5, 10)
    assert (b.max_queued, b.max_concurrent, b.requests_per_s) == (3, 5, 10)
    assert (c.max_queued, c.max_concurrent, c.requests_per_s) == (None, 5, 50)   # null lifts the limit
    assert settings.quota_limits(None) == b   # the anonymous bucket: the defaults
    assert settings.quota_limits(None).max_result_bytes_per_day is None


def test_a_malformed_override_names_the_key_and_field(monkeypatch):
    monkeypatch.setenv("JACOBIAN_API_KEYS", json.dumps([{"key": "k", "name": "a", "quotas": {"max_queued": -1}}]))
    with pytest.raises(ValidationError, match=r"api_keys\.0\.quotas\.max_queued"):
        Settings()
    monkeypatch.setenv("JACOBIAN_API_KEYS", json.dumps([{"key": "k", "quotas": {"max_queud": 1}}]))
    with pytest.raises(ValidationError, match="max_queud"):
        Settings()
