"""Token buckets, the one rate-limit mechanism of the control plane and the data plane.

Each named bucket holds up to `limit` tokens and refills continuously at `limit` per minute.
`wait_for` says how long until `amount` is there, `take` removes it (the level may go below
zero: a charge after the fact, such as generated tokens, makes the next request wait).
A limit of 0 or less means unlimited, everywhere. Buckets that have refilled completely are
forgotten, so idle callers cost no memory; thread-safe. No torch, no web framework: both
services import it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

PRUNE_EVERY = 1024  # refills between sweeps of full buckets


@dataclass(slots=True)
class _Bucket:
    level: float
    stamp: float
    limit: int


class TokenBuckets:
    """Named buckets of capacity `limit`, refilled at `limit` per minute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[Hashable, _Bucket] = {}
        self._refills = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def wait_for(self, key: Hashable, limit: int, amount: float) -> float:
        """Seconds until `amount` (capped at `limit`) is available; 0 when it is now."""
        if limit <= 0:
            return 0.0
        with self._lock:
            bucket = self._refill(key, limit)
            need = min(amount, float(limit)) - bucket.level
        return 0.0 if need <= 0 else need * 60.0 / limit

    def take(self, key: Hashable, limit: int, amount: float) -> None:
        """Remove `amount` (the level may go below zero)."""
        if limit > 0:
            with self._lock:
                self._refill(key, limit).level -= amount

    def acquire(self, key: Hashable, limit: int, amount: float = 1.0) -> float:
        """Take `amount` if it is there now and return 0; else take nothing and return the
        seconds to wait."""
        if limit <= 0:
            return 0.0
        with self._lock:
            bucket = self._refill(key, limit)
            need = min(amount, float(limit)) - bucket.level
            if need <= 0:
                bucket.level -= amount
                return 0.0
        return need * 60.0 / limit

    def _refill(self, key: Hashable, limit: int) -> _Bucket:
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
