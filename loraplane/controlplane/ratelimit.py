"""Per-key request rate limits: a token bucket per API key, refilled continuously.

A key may burst up to its tenant's requests-per-minute and then goes at that rate. The
buckets live in this process: with several replicas each enforces the limit on its own share
of the traffic (a shared store is a later step; see docs/controlplane.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_BUCKETS = 100_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    """Token buckets keyed by API key id; `acquire` says how long to wait when empty."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._lock = threading.Lock()

    def acquire(self, key_id: int, per_minute: int) -> int | None:
        """Take one request from the key's bucket: None if allowed, else seconds to wait."""
        if per_minute <= 0:
            return 60
        rate = per_minute / 60.0
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(key_id)
            if bucket is None:
                if len(self._buckets) >= MAX_BUCKETS:
                    self._buckets.clear()  # bounded memory; a reset only forgives a burst
                bucket = self._buckets[key_id] = _Bucket(float(per_minute), now)
            bucket.tokens = min(float(per_minute), bucket.tokens + (now - bucket.stamp) * rate)
            bucket.stamp = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return None
            return max(1, math.ceil((1.0 - bucket.tokens) / rate))
