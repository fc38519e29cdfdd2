"""Per-key request rate limits: a token bucket per API key, refilled continuously.

A key may burst up to its tenant's requests-per-minute and then goes at that rate. The
buckets live in this process: with several replicas each enforces the limit on its own share
of the traffic (a shared store is a later step; see docs/controlplane.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from loraplane.ratelimit import TokenBuckets


class RateLimiter:
    """Token buckets keyed by API key id (`loraplane.ratelimit.TokenBuckets`, the data plane's
    mechanism too); `acquire` says how long to wait when empty."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._buckets = TokenBuckets(clock)

    def acquire(self, key_id: int, per_minute: int) -> int | None:
        """Take one request from the key's bucket: None if allowed (or `per_minute` is 0:
        unlimited, as everywhere in loraplane), else whole seconds to wait."""
        wait = self._buckets.acquire(key_id, per_minute)
        return None if wait <= 0 else max(1, math.ceil(wait))
