"""The device tier: adapters in the pool's slots, within the adapter memory.

Device slots are limited by memory: `budget_bytes` (the resolved `--lora-memory`) bounds the
bytes in the pool, and the slot count (`EngineConfig.lora_slots`) only bounds how many distinct
adapters one step may use. The scheduler admits a new adapter only while the running adapters
and it fit in the budget; idle adapters stay resident as a cache and are evicted least recently
used first, those that no waiting request needs before those that one does. Nothing used by a
running request is evicted, nor a pinned version. With adapters inside the KV cache
(lora/arena.py) an adapter takes a run of blocks, and sequences short of blocks reclaim idle
adapters' (`reclaim_blocks`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from loraplane.dataplane.lora.entry import Entry, TierStats
from loraplane.dataplane.lora.host_tier import HostTier
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.lora.registry import Registry
from loraplane.dataplane.lora.weights import LoadedAdapter
from loraplane.dataplane.sequence import LoRARef

log = logging.getLogger(__name__)


class DeviceTier:
    """Which version is in which slot of `pool`, and what goes when a slot or memory is
    needed. Its state is guarded by the registry's lock; the engine thread calls it."""

    def __init__(
        self, registry: Registry, host: HostTier, pool: LoRAPool, budget_bytes: int | None
    ) -> None:
        self._registry, self._host, self.pool = registry, host, pool
        self.budget_bytes = budget_bytes  # None: no byte budget (or the arena's blocks bound it)
        self.slots: dict[int, str] = {}  # slot -> ref.key
        self.stats = TierStats("gpu")

    def slot_of(self, key: str) -> int:
        """The slot holding adapter `key` (made resident for this step)."""
        slot = self._registry.entries[key].slot
        if slot is None:
            raise KeyError(f"adapter {key} is not in a device slot")
        return slot

    def make_resident(
        self, keys: Iterable[str], in_use: Iterable[str], wanted: Iterable[str] = ()
    ) -> None:
        """Put every adapter in `keys` (all in host memory) into a device slot, evicting
        least-recently-used adapters that are neither in `keys` nor `in_use`; those in
        `wanted` (of waiting requests) go only after every other idle one. Then trims the host
        tier, keeping the copies of all of those (the needed ones)."""
        keys = list(keys)
        in_use = set(keys) | set(in_use)  # the step's own adapters are in use too
        wanted = set(wanted)
        with self._registry.lock:
            clock = self._registry.tick()
            now = time.monotonic()
            for key in keys:
                entry = self._registry.entries[key]
                entry.last_used, entry.touched = clock, now
                if entry.slot is not None:
                    self.stats.hits += 1
                    continue
                if entry.host is None:
                    raise RuntimeError(f"adapter {key} is not in host memory")
                if not self._place(entry, in_use, wanted):
                    raise RuntimeError(
                        "the adapters of running requests fill the adapter memory: the"
                        " scheduler admitted more than fits"
                    )
            self._host.evict(in_use | wanted)

    def place(self, ref: LoRARef, in_use: Iterable[str], wanted: Iterable[str] = ()) -> bool:
        """Make `ref` (in host memory) resident now if it can be, evicting idle adapters as
        `make_resident` does; False when it cannot (with adapters in KV blocks: no run of
        blocks can be freed while sequences hold them). The scheduler places a request's
        adapter when it admits it, before the step's sequences take their blocks."""
        with self._registry.lock:
            entry = self._registry.entries.get(ref.key)
            if entry is None or entry.host is None:
                return False
            if entry.slot is not None:
                return True
            try:
                return self._place(entry, set(in_use) | {ref.key}, set(wanted))
            except Exception as e:  # this adapter's copy to the device failed: it alone fails
                self._host.fail(entry, f"{type(e).__name__}: {e}")
                log.warning("placing adapter %s on the device failed: %r", ref.key, e)
                return False

    def _place(self, entry: Entry, in_use: set[str], wanted: set[str]) -> bool:
        """Load `entry` into a slot, evicting idle residents (not in `in_use`; those in
        `wanted` last) until it fits: within the budget, and with an arena, into a run of
        blocks. With an arena the run is found first, counting idle adapters' blocks as free:
        only the adapters it overlaps are evicted, and none when no run can be made (the
        running adapters' share of the budget is the scheduler's to keep). Under the lock."""
        host = entry.host
        if host is None:
            raise RuntimeError(f"adapter {entry.ref.key} is not in host memory")
        start = time.perf_counter()
        victims = self._victims(in_use, wanted)  # the first to evict last
        if self.pool.arena is not None and not self._free_a_run(host, victims):
            return False
        budget = None if self.pool.arena is not None else self.budget_bytes
        while True:
            slot = self.pool.free_slot()
            fits = budget is None or self.pool.bytes_used + entry.device_bytes <= budget
            if slot is not None and fits:
                if not self._load_slot(slot, host):  # with an arena: no run after all
                    return False
                entry.slot = slot
                self.slots[slot] = entry.ref.key
                self.stats.loads += 1
                self.stats.load_ended(entry.ref.key, start)
                return True
            if not victims:
                return False
            self.free(victims.pop())
            self.stats.evictions += 1

    def _free_a_run(self, host: LoadedAdapter, victims: list[Entry]) -> bool:
        """Evict from `victims` (the first to evict last) the idle adapters whose blocks a run
        for `host` needs, removing them from the list; False, evicting none, when no run can
        be freed."""
        arena = self.pool.arena
        if arena is None:  # pragma: no cover - _place checks
            return True
        order = victims[::-1]
        runs = []
        for victim in order:
            placement = None if victim.slot is None else self.pool.placement(victim.slot)
            runs.append((0, 0) if placement is None else (placement.first, placement.num_blocks))
        needed = arena.runs_to_free(arena.blocks_for(host), runs)
        if needed is None:
            return False
        for i in needed:
            self.free(order[i])
            victims.remove(order[i])
            self.stats.evictions += 1
        return True

    def _load_slot(self, slot: int, adapter: LoadedAdapter) -> bool:
        try:
            return self.pool.load(slot, adapter)
        except Exception:
            self.stats.failures += 1
            raise

    def _victims(self, in_use: set[str], wanted: set[str]) -> list[Entry]:
        """Idle residents (not in `in_use`), the first to evict (not wanted, least recently
        used) last; pinned versions are never among them."""
        entries, pinned = self._registry.entries, self._registry.pinned
        idle = [entries[k] for k in self.slots.values() if k not in in_use and k not in pinned]
        return sorted(idle, key=lambda e: (e.ref.key not in wanted, -e.last_used))

    def reclaim_blocks(self, short: int, in_use: Iterable[str], wanted: Iterable[str]) -> None:
        """Sequences need `short` more KV blocks than are free: evict idle adapters from the
        arena (those no waiting request needs, least recently used, first) until enough are."""
        arena = self.pool.arena
        blocks = None if arena is None else arena.blocks
        if blocks is None:  # no arena, or a worker's (rank 0 reclaims)
            return
        with self._registry.lock:
            target = blocks.num_free_blocks + short
            victims = self._victims(set(in_use), set(wanted))
            while victims and blocks.num_free_blocks < target:
                self.free(victims.pop())
                self.stats.evictions += 1

    def drop_slot(self, key: str) -> None:
        """Free `key`'s device slot (its next use loads it again from the host copy): after a
        step failed for it, a damaged slot must not fail its next requests too."""
        with self._registry.lock:
            entry = self._registry.entries.get(key)
            if entry is not None and entry.slot is not None:
                self.free(entry)
                self.stats.evictions += 1

    def free(self, entry: Entry) -> None:
        """Free `entry`'s slot, if it has one (under the lock); counts no eviction."""
        if entry.slot is not None:
            self.pool.free(entry.slot)
            del self.slots[entry.slot]
            entry.slot = None

    def resident(self) -> list[LoRARef]:
        """Adapters in device slots now."""
        return [self._registry.entries[k].ref for k in list(self.slots.values())]

    def slot_keys(self) -> dict[int, str]:
        """Slot -> the key of the adapter in it, for every occupied slot."""
        with self._registry.lock:
            return dict(self.slots)

    @property
    def capacity(self) -> int:
        """How many adapters the device holds at once: the pool's slots, or fewer where the
        memory budget holds fewer adapters of the mean size of those resident now (all slots
        while none is)."""
        slots = self.pool.num_slots
        budget, resident = self.budget_bytes, len(self.slots)
        if budget is None or not resident or not self.pool.bytes_used:
            return slots
        return max(1, min(slots, budget * resident // self.pool.bytes_used))

    def bytes_of(self, ref: LoRARef) -> int:
        """Device bytes `ref` takes in the pool (0 until it is in host memory)."""
        entry = self._registry.entries.get(ref.key)
        return 0 if entry is None else entry.device_bytes

    def too_large(self, entry: Entry | None) -> str | None:
        """Why `entry` can never be placed (larger than the whole budget), or None (also for
        no entry, and while its size is unknown: before its first read)."""
        budget = self.budget_bytes
        if entry is not None and budget is not None and entry.device_bytes > budget:
            return (
                f"adapter {entry.ref.name} needs {entry.device_bytes} bytes of device memory,"
                f" more than the whole adapter memory budget ({budget} bytes, --lora-memory)"
            )
        return None
