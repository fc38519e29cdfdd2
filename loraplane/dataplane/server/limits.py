"""Per-tenant rate limits: requests per minute and tokens per minute, as token buckets.

Each tenant has two buckets that refill continuously (limit / 60 per second) up to one minute's
worth. A request takes one request token and its prompt tokens up front (`admit`); the tokens it
generates are charged as they are produced (`charge`), which may drive the bucket below zero:
then the tenant's next request waits until it has refilled. A limit of 0 means unlimited.

    limiter = RateLimiter()
    limiter.admit("acme", requests_per_minute=60, tokens_per_minute=10_000, prompt_tokens=42)
    ...
    limiter.charge("acme", tokens_per_minute=10_000, tokens=1)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplane.dataplane.server.errors import RateLimited


@dataclass(slots=True)
class _Bucket:
    level: float
    stamp: float
    limit: int


PRUNE_EVERY = 1024  # refills between sweeps of full buckets


class TokenBucket:
    """Named buckets of capacity `limit`, refilled at `limit` per minute. A bucket that has
    refilled completely is forgotten (a new one starts full), so idle tenants cost nothing."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._refills = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def _refill(self, key: str, limit: int) -> _Bucket:
        now = self._clock()
        self._refills += 1
        if self._refills % PRUNE_EVERY == 0:
            self._prune(now)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(limit), now, limit)
        bucket.limit = limit
        bucket.level = min(float(limit), bucket.level + (now - bucket.stamp) * limit / 60.0)
        bucket.stamp = now
        return bucket

    def _prune(self, now: float) -> None:
        full = [
            k
            for k, b in self._buckets.items()
            if b.level + (now - b.stamp) * b.limit / 60.0 >= b.limit
        ]
        for k in full:
            del self._buckets[k]

    def wait_for(self, key: str, limit: int, amount: float) -> float:
        """Seconds until `amount` (capped at `limit`) is available; 0 when it is now."""
        bucket = self._refill(key, limit)
        need = min(amount, float(limit)) - bucket.level
        return 0.0 if need <= 0 else need * 60.0 / limit

    def take(self, key: str, limit: int, amount: float) -> None:
        """Remove `amount` (the level may go below zero)."""
        self._refill(key, limit).level -= amount


class RateLimiter:
    """Requests and tokens per minute per tenant; raises RateLimited with a Retry-After."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._requests = TokenBucket(clock)
        self._tokens = TokenBucket(clock)

    def admit(
        self, tenant: str, *, requests_per_minute: int, tokens_per_minute: int, prompt_tokens: int
    ) -> None:
        """Let a request in (taking 1 request and its prompt tokens), or raise RateLimited."""
        waits = []
        if requests_per_minute > 0:
            waits.append(self._requests.wait_for(tenant, requests_per_minute, 1))
        if tokens_per_minute > 0:
            waits.append(self._tokens.wait_for(tenant, tokens_per_minute, prompt_tokens))
        wait = max(waits, default=0.0)
        if wait > 0:
            raise RateLimited(
                f"tenant {tenant!r} is over its rate limit "
                f"({requests_per_minute or 'unlimited'} requests, "
                f"{tokens_per_minute or 'unlimited'} tokens per minute); retry in {wait:.1f} s",
                retry_after=wait,
            )
        if requests_per_minute > 0:
            self._requests.take(tenant, requests_per_minute, 1)
        if tokens_per_minute > 0:
            self._tokens.take(tenant, tokens_per_minute, prompt_tokens)

    def charge(self, tenant: str, *, tokens_per_minute: int, tokens: int) -> None:
        """Count generated tokens against the tenant's tokens per minute."""
        if tokens_per_minute > 0 and tokens > 0:
            self._tokens.take(tenant, tokens_per_minute, tokens)
