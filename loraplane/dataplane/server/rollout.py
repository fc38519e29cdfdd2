"""Weighted rollouts on the data plane: one version per request, picked by weight, and every
version with weight loaded ahead of its first request.

The control plane's resolve answer for an unpinned name under a rollout carries the split
(every version, its weight and where to load it; docs/controlplane.md, "Weighted rollouts").
The catalog caches that answer as any other and asks `Picker.pick` for each request, so the
split holds per request, not per cache entry. A version gets requests on this replica only
once it is in host memory here: until then its share goes to the current version (the one the
answer names, the rollback target), and `Warmer` registers it and starts its load in the
background the moment the split is first seen. A canary therefore never meets its first
request cold, and the few requests that arrive during its load (milliseconds for an adapter
on local disk) are the split's only deviation.

A request may carry a sticky key (`X-LoRAplane-Rollout-Key`, else the OpenAI `user` field):
then its version follows from sha256(tenant, adapter, key), a point in [0, 1) laid over the
split's weights in version order, so the same key under the same weights always gets the same
version on every replica, and raising the newest version's weight moves keys to it without
moving any back. Without a key the pick is random. Either way the pick is made over the
split's own weights, and a request whose version is not warm here runs on the current one
instead: it is counted as diverted (`Picker.diverted`: the metric
`loraplane_adapter_version_diverted_total{tenant,adapter,version,reason}`, reason `loading`
or `failed`), so a canary whose loads keep failing shows as such, not as a quiet 0% share. A
sticky key can land on the current version during a canary's first load; it comes back to
its own version once that is warm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from loraplane.dataplane.sequence import LoRARef

if TYPE_CHECKING:
    from loraplane.dataplane.server.catalog import Resolved

log = logging.getLogger(__name__)

RECHECK_S = 0.05  # a version still loading is asked about again this much later at most
ROLLOUT_KEY_HEADER = "X-LoRAplane-Rollout-Key"  # a sticky key, before the body's `user`


def sticky_key(header: str | None, user: str | None) -> str | None:
    """A request's sticky rollout key: the header's, else the body's `user` (None: random)."""
    return header or user or None


def bucket(tenant: str, adapter: str, key: str) -> float:
    """The key's point in [0, 1): the same for the same tenant, adapter and key everywhere."""
    digest = hashlib.sha256(f"{tenant}\0{adapter}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True, slots=True)
class SplitVersion:
    """One version of a rollout: its weight and what loading it needs."""

    version: str
    weight: int
    digest: str
    path: str
    rank: int | None = None


class Readiness(Protocol):
    """Which versions of a split may take requests on this replica now."""

    async def ready(self, tenant: str, adapter: str, split: tuple[SplitVersion, ...]) -> set[str]:
        """The versions (of weight > 0) in host memory here; loads start for the others."""
        ...

    def failed(self, tenant: str, adapter: str, version: SplitVersion) -> str | None:
        """Why `version` cannot load here (its last load failed), or None (loading)."""
        ...


# a request diverted from its split's version to the current one: (tenant, adapter, the
# version it was meant for, why: "loading" or "failed")
Diverted = Callable[[str, str, str, str], None]


class Warmer:
    """Registers a rollout's versions with the engine and starts their loads into host memory
    before requests need them (engine command `warm_stored`), and remembers which are there.

    `command` is the runtime's engine command call. A version is asked about once when the
    split is first seen and then at most every RECHECK_S while it loads (a failed load is
    retried by the engine's own rule), so a split costs the request path nothing once warm.
    """

    def __init__(self, command: Callable[..., Awaitable[Any]]) -> None:
        self._command = command
        self._warm: set[str] = set()  # ref keys known in host memory
        self._asked: dict[str, float] = {}  # ref key -> when it was last asked about
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._failed: dict[str, str] = {}  # ref key -> why its last load failed (until warm)

    async def ready(self, tenant: str, adapter: str, split: tuple[SplitVersion, ...]) -> set[str]:
        """See Readiness.ready."""
        now = time.monotonic()
        ready: set[str] = set()
        asks: list[tuple[str, str, asyncio.Future[Any]]] = []
        for v in split:
            if v.weight <= 0:
                continue
            ref = LoRARef(adapter, tenant, v.digest)
            if ref.key in self._warm:
                ready.add(v.version)
                continue
            pending = self._pending.get(ref.key)
            if pending is None and now - self._asked.get(ref.key, -RECHECK_S) >= RECHECK_S:
                self._asked[ref.key] = now
                pending = asyncio.ensure_future(self._command("warm_stored", ref, v.path))
                self._pending[ref.key] = pending
                pending.add_done_callback(functools.partial(self._done, ref.key))
            if pending is not None:
                asks.append((v.version, ref.key, pending))
        for version, key, pending in asks:
            try:
                answer = await asyncio.shield(pending)
            except Exception as e:  # a bad path or a dead engine: the version waits, requests flow
                answer = f"{type(e).__name__}: {e}"
            if isinstance(answer, str):  # its load failed: said once per reason, asked again
                if self._failed.get(key) != answer:
                    log.warning("rollout %s/%s v%s cannot load here (its share runs on the "
                                "current version): %s", tenant, adapter, version,
                                answer)  # fmt: skip
                self._failed[key] = answer
            elif answer:
                ready.add(version)
                self._warm.add(key)
                self._failed.pop(key, None)
            else:
                self._failed.pop(key, None)
        return ready

    def failed(self, tenant: str, adapter: str, version: SplitVersion) -> str | None:
        """See Readiness.failed."""
        return self._failed.get(LoRARef(adapter, tenant, version.digest).key)

    def _done(self, key: str, _: asyncio.Future[Any]) -> None:
        self._pending.pop(key, None)

    def forget(self, ref_key: str) -> None:
        """`ref_key` left host memory (unloaded): ask about it again next time."""
        self._warm.discard(ref_key)
        self._asked.pop(ref_key, None)


class Picker:
    """Picks a rollout's version for each request by weight, among the versions ready here.

    `rng` is seeded in tests (a reproducible split); the weights of versions not yet ready go
    to the answer's current version."""

    def __init__(
        self,
        readiness: Readiness | None = None,
        rng: random.Random | None = None,
        diverted: Diverted | None = None,
    ) -> None:
        self.readiness = readiness
        self.diverted = diverted
        self._rng = rng or random.Random()  # noqa: S311 - a traffic split, not a secret

    async def pick(self, resolved: Resolved, key: str | None = None) -> Resolved:
        """`resolved` (a catalog `Resolved` with a split) narrowed to one version of it: by
        the sticky `key`'s bucket when given, at random otherwise, over the split's weights;
        a version not warm here gives way to the current one (counted by `diverted`)."""
        split: tuple[SplitVersion, ...] = resolved.rollout
        tenant, adapter = resolved.tenant, resolved.adapter or ""
        # asked on every request, whichever version it gets: the loads of every version with
        # weight start the moment the split is first seen, before any request picks them
        ready = None
        if self.readiness is not None:
            ready = await self.readiness.ready(tenant, adapter, split)
        chosen = _by_weight(split, bucket(tenant, adapter, key) if key else self._rng.random())
        current = dataclasses.replace(resolved, rollout=())
        if chosen is None or chosen.version == resolved.version:
            return current
        if ready is not None and self.readiness is not None and chosen.version not in ready:
            if self.diverted is not None:
                why = "failed" if self.readiness.failed(tenant, adapter, chosen) else "loading"
                self.diverted(tenant, adapter, chosen.version, why)
            return current
        return dataclasses.replace(
            resolved, version=chosen.version, digest=chosen.digest, path=chosen.path,
            rank=chosen.rank, rollout=(),
        )  # fmt: skip


def _by_weight(split: tuple[SplitVersion, ...], at: float) -> SplitVersion | None:
    """The version of `split` whose share of the weights holds the point `at` in [0, 1)
    (None: no weight at all)."""
    total = sum(max(v.weight, 0) for v in split)
    if total <= 0:
        return None
    point = at * total
    for v in split:
        if v.weight > 0:
            point -= v.weight
            if point < 0:
                return v
    return next(v for v in reversed(split) if v.weight > 0)
