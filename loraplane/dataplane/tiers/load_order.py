"""Fair shares of the loader threads: whose adapter loads next.

The host tier's loader (`lora.loads.Loads`) has `limit` threads for every tenant's cold
loads. Served in arrival order, one tenant's slow or dead objects would hold them all and every
other tenant's loads would queue behind. The rule instead, per start:
- A tenant alone (no other tenant has a load to start) may use every thread.
- While others have loads to start, each tenant starts loads only below its share: `limit`
  over the tenants loading or waiting to (at least 1).
- Threads a tenant holds beyond its share (taken while it was alone) are lent: tenants below
  their share start that many loads beyond `limit`: while the tenants loading are no more than
  the threads, none waits below its share for another tenant's loads to end (with more, they
  take turns, one load each at a time). The loads in flight stay within 2 * `limit`.
- Among the tenants that may start one, the one with the fewest loads in flight goes first,
  then the one whose last load started longest ago (tenants take turns).

Pure functions over counts, tested on their own (`tests/dataplane/test_cold_loads.py`), and
free of torch: a simulated replica's tiers can follow the same rule.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def in_turn(queues: Iterable[Sequence[T]]) -> list[T]:
    """The items of every queue, one of each queue in turn, each queue in its own order."""
    return [
        item
        for turn in itertools.zip_longest(*queues, fillvalue=None)
        for item in turn
        if item is not None
    ]


def next_tenant(
    waiting: Iterable[str],
    loading: Mapping[str, int],
    last_started: Mapping[str, int],
    limit: int,
) -> str | None:
    """The tenant whose load starts now, or None: `waiting` are the tenants with a load to
    start, `loading` their (and others') loads in flight, `last_started` when each tenant's
    last load started (any increasing count; absent: never), `limit` the loader threads."""
    candidates = list(dict.fromkeys(waiting))
    if not candidates:
        return None
    active = set(candidates) | {t for t, n in loading.items() if n > 0}
    share = max(1, limit // len(active))
    in_flight = sum(loading.values())
    lent = sum(max(0, n - share) for n in loading.values())
    alone = len(candidates) == 1
    eligible = [
        t
        for t in candidates
        if (alone and in_flight < limit) or (loading.get(t, 0) < share and in_flight < limit + lent)
    ]
    if not eligible:
        return None
    return min(eligible, key=lambda t: (loading.get(t, 0), last_started.get(t, -1)))
