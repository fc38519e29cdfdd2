"""The one token-bucket mechanism (loraplane.ratelimit) and the two limiters built on it."""

from __future__ import annotations

from loraplane.controlplane.ratelimit import RateLimiter as KeyLimiter
from loraplane.dataplane.server.limits import RateLimiter as TenantLimiter
from loraplane.ratelimit import TokenBuckets


def test_a_bucket_bursts_to_its_limit_then_refills_at_the_limit_per_minute() -> None:
    now = [0.0]
    buckets = TokenBuckets(clock=lambda: now[0])
    assert all(buckets.acquire("k", 60) == 0.0 for _ in range(60))  # a minute's burst
    assert buckets.acquire("k", 60) == 1.0  # then one per second
    now[0] = 1.0
    assert buckets.acquire("k", 60) == 0.0
    buckets.take("k", 60, 30)  # a charge after the fact goes below zero
    assert buckets.wait_for("k", 60, 1) == 31.0


def test_a_limit_of_zero_means_unlimited_in_both_services() -> None:
    buckets = TokenBuckets()
    assert buckets.acquire("k", 0, 10**9) == 0.0 and len(buckets) == 0
    assert KeyLimiter().acquire(1, 0) is None
    TenantLimiter().admit("t", requests_per_minute=0, tokens_per_minute=0, prompt_tokens=10**9)


def test_the_control_planes_limiter_answers_whole_seconds() -> None:
    now = [0.0]
    limiter = KeyLimiter(clock=lambda: now[0])
    assert [limiter.acquire(7, 2) for _ in range(3)] == [None, None, 30]
    assert limiter.acquire(8, 2) is None  # keys do not share buckets
