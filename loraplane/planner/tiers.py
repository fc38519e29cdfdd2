"""A simulated replica's adapter tiers: what the real `Scheduler` asks of `LoRAManager`.

`SimTiers` implements the scheduler's `Adapters` protocol (`ready`, `device_bytes`,
`budget_bytes`, `place`) over simulated time, and the engine-side housekeeping around it:
- host tier: `max_cpu_loras` copies, and with `max_cpu_lora_bytes` only as many as those
  bytes hold (every simulated copy weighs the same, so the byte limit is a count:
  `host_copies`), least recently used first out, never one on the device, in the step,
  running or wanted by a waiting request (`HostTier.evict`); a copy arrives `load_s` after
  its load starts, on `loads_in_flight` loader threads that go on down the prefetch list (the
  waiting requests' first `max_cpu_loras / 2` distinct adapters, `LoRAManager.prefetch`);
- device pool: as many adapters as the slots and the adapter memory hold; placing one evicts
  idle residents, those no waiting request wants first, least recently used first
  (`DeviceTier._victims`). A step's adapters become the most recently used
  (`LoRAManager.make_resident`).

Under a byte limit (`host_copies`) loads ahead of need follow the engine's room rule
(`lora/loads.py`): each tenant's first adapter in the prefetch list loads whatever the room;
any other starts only while the copies that must stay (on the device, or wanted by a waiting
request) and the loads in flight leave room for one more, and a copy loaded ahead that finds
no room when it arrives (nothing left to evict) is dropped.

Simplification: with adapters inside the KV cache the engine may keep idle adapters in blocks
no sequence holds; here the pool keeps them only within the adapter memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from loraplane.dataplane.sequence import LoRARef


class SimTiers:
    """Host and device adapter tiers of one simulated replica, keyed by `LoRARef.key`."""

    def __init__(self, slots: int, budget_bytes: int, device_bytes: int, max_cpu_loras: int,
                 load_s: float, loads_in_flight: int,
                 host_copies: int | None = None) -> None:  # fmt: skip
        if device_bytes < 1 or budget_bytes < device_bytes:
            raise ValueError(
                f"the adapter memory ({budget_bytes} bytes) must hold one adapter"
                f" ({device_bytes} bytes)"
            )
        self._device_bytes = device_bytes
        self._budget = budget_bytes
        self.capacity = max(1, min(slots, budget_bytes // device_bytes))  # adapters on device
        self.max_cpu_loras = max_cpu_loras
        # copies kept at most: the count, and what the byte limit holds (None: no byte limit)
        self.host_limit = max_cpu_loras if host_copies is None else min(max_cpu_loras, host_copies)
        self.prefetch_depth = max(1, max_cpu_loras // 2)  # the engine's: from the count
        self.load_s = load_s
        self.loads_in_flight = loads_in_flight
        self.host: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.device: OrderedDict[str, None] = OrderedDict()
        self.loading: list[tuple[float, str]] = []  # (end, key), at most loads_in_flight
        self.queue: list[str] = []  # the prefetch list
        # under a byte limit: the waiting requests' adapters (their copies stay) and each
        # tenant's first in the list (loaded whatever the room)
        self.byte_limited = host_copies is not None
        self.wanted: set[str] = set()
        self.heads: set[str] = set()
        self.loads = 0  # loads into host memory started
        self.placed = 0  # adapters made resident since the caller last reset it

    # -- the scheduler's Adapters protocol ---------------------------------------------------

    def ready(self, ref: LoRARef) -> bool:
        """In host memory (it may run in the next step)."""
        return ref.key in self.host

    def device_bytes(self, ref: LoRARef) -> int:
        """Every simulated adapter takes the profile's device bytes."""
        return self._device_bytes

    @property
    def budget_bytes(self) -> int | None:
        """The adapter memory."""
        return self._budget

    def pins(self) -> list[LoRARef]:
        """No pinned versions in the simulation (their slots and memory are taken off the
        replica's: `ReplicaSettings.from_plan`)."""
        return []

    def place(self, ref: LoRARef, in_use: Iterable[str], wanted: Iterable[str]) -> bool:
        """Make `ref` resident, evicting idle residents (never those in `in_use`; those in
        `wanted` last); False when every resident is in use."""
        key = ref.key
        if key in self.device:
            return True
        if key not in self.host:
            return False
        if len(self.device) >= self.capacity:
            in_use = {*in_use, key}
            wanted = set(wanted)
            idle = [k for k in self.device if k not in in_use]  # least recently used first
            idle.sort(key=lambda k: k in wanted)  # stable: the unwanted first, in LRU order
            while len(self.device) >= self.capacity:
                if not idle:
                    return False
                del self.device[idle.pop(0)]
        self.device[key] = None
        self.placed += 1
        return True

    # -- the engine's side ---------------------------------------------------------------------

    def warm(self, keys: Iterable[str]) -> None:
        """Put copies of `keys` in host memory now (a replica that served them before)."""
        for key in keys:
            self.host[key] = None
            self.host.move_to_end(key)

    def touch(self, keys: Iterable[str]) -> None:
        """A step ran `keys`: they become the most recently used, in the order they had (a
        set's order would change with each process's string hashing)."""
        keys = set(keys)
        for tier in (self.host, self.device):
            for key in [k for k in tier if k in keys]:
                tier.move_to_end(key)

    def trim_host(self, in_use: set[str]) -> None:
        """Evict host copies beyond `host_limit` (`max_cpu_loras`, and the byte limit's
        copies), least recently used first, never one on the device or in `in_use` (the
        step's, the running and the waiting requests' adapters)."""
        excess = len(self.host) - self.host_limit
        if excess <= 0:
            return
        for key in [k for k in self.host if k not in self.device and k not in in_use][:excess]:
            del self.host[key]

    def prefetch(self, refs: Iterable[LoRARef], now: float) -> None:
        """The new prefetch list: the first `prefetch_depth` of `refs` (the waiting requests'
        adapters, the oldest request's first); loads start on free loader threads."""
        queue: list[str] = []
        wanted: set[str] = set()
        tenants: set[str] = set()
        heads: set[str] = set()
        for ref in refs:
            wanted.add(ref.key)
            if len(queue) < self.prefetch_depth:
                queue.append(ref.key)
                if ref.tenant not in tenants:
                    tenants.add(ref.tenant)
                    heads.add(ref.key)
        self.queue, self.wanted, self.heads = queue, wanted, heads
        self._start_loads(now)

    def pending(self) -> set[str]:
        """Adapters loading or queued to load (`LoRAManager.pending`); under a byte limit not
        those a lack of room holds back."""
        pending = {k for _, k in self.loading}
        held_back = self.byte_limited and self._room() < 1
        for key in self.queue:
            if key not in self.host and not (held_back and key not in self.heads):
                pending.add(key)
        return pending

    def _room(self) -> int:
        """Copies the byte limit leaves beside those that must stay (on the device or wanted
        by a waiting request) and the loads in flight (`HostTier.room`)."""
        fixed = sum(1 for k in self.host if k in self.device or k in self.wanted)
        return self.host_limit - fixed - len(self.loading)

    def _start_loads(self, now: float) -> None:
        busy = {k for _, k in self.loading}
        for key in self.queue:
            if len(self.loading) >= self.loads_in_flight:
                return
            if key in self.host or key in busy:
                continue
            if self.byte_limited and key not in self.heads and self._room() < 1:
                continue  # loaded ahead only into room
            self.loading.append((now + self.load_s, key))
            busy.add(key)
            self.loads += 1

    def _keep(self, key: str) -> bool:
        """Whether an arriving copy stays: always without a byte limit or for a tenant's
        first adapter; else once a copy that may go (not on the device, not wanted) makes room,
        the least recently used first (`HostTier.make_room`)."""
        if not self.byte_limited or key in self.heads or len(self.host) < self.host_limit:
            return True
        for victim in self.host:
            if victim not in self.device and victim not in self.wanted:
                del self.host[victim]
                return True
        return False

    def advance(self, now: float) -> None:
        """Finish the loads that end by `now`; each loader thread goes on down the list."""
        while self.loading:
            end, key = min(self.loading)
            if end > now:
                return
            self.loading.remove((end, key))
            if self._keep(key):
                self.host[key] = None
                self.host.move_to_end(key)
            self._start_loads(end)

    def next_load_end(self) -> float | None:
        """When the next load in flight ends (None: none is)."""
        return min(self.loading)[0] if self.loading else None
