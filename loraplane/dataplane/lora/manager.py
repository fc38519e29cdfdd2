"""Adapter versions the engine knows, and where each one is: disk, host memory, device slot.

`LoRAManager` is the one object the engine, the scheduler (its `Adapters` protocol), the
model runner and the server hold; it hands each call to the part that does that job:
- the registry (registry.py): versions by key and by (tenant, name), their files, the lock;
- the host tier (host_tier.py): host copies, an LRU of `max_cpu_loras` (and of
  `max_cpu_lora_bytes` bytes, when set);
- the loads (loads.py): loader threads filling the host tier, the prefetch list, retries;
- the device tier (device_tier.py): slots within the adapter memory, eviction, KV reclaim;
- the pins (pins.py): versions kept resident, within their cap.

Static adapters are read when registered (`register`: a bad one fails at start), stored ones
when a request first needs them (`register_stored`). The parts share the registry's reentrant
lock, taken by the engine thread and the loader threads and held through multi-part calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.limits import AdapterLimits
from loraplane.dataplane.lora.device_tier import DeviceTier
from loraplane.dataplane.lora.entry import State, TierStats
from loraplane.dataplane.lora.host_tier import HostPart, HostTier
from loraplane.dataplane.lora.loads import Loads
from loraplane.dataplane.lora.pins import PIN_FRACTION, Pins
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.lora.registry import Registry
from loraplane.dataplane.lora.weights import LoadedAdapter
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import DiskTier

__all__ = ["PIN_FRACTION", "LoRAManager", "State", "TierStats"]


class LoRAManager:
    """Registry of adapter versions (by `LoRARef.key`) across the host and device tiers."""

    def __init__(
        self,
        pool: LoRAPool,
        base: BaseModelSpec,
        max_lora_rank: int,
        max_cpu_loras: int | None = None,
        disk: DiskTier | None = None,
        device_budget_bytes: int | None = None,
        prefetch: bool = True,
        retry_after_s: float = 5.0,
        max_loads_in_flight: int = 2,
        prefetch_depth: int | None = None,
        shard: Callable[[LoadedAdapter], LoadedAdapter] | None = None,
        peers: Callable[[LoadedAdapter], tuple[HostPart, ...]] | None = None,
        max_cpu_lora_bytes: int | None = None,
    ) -> None:
        self.pool, self.base, self.disk = pool, base, disk  # shared with the parts
        self.limits = AdapterLimits(max_rank=max_lora_rank)
        self.registry = Registry(base, self.limits, disk)
        # under TP: `shard` cuts this rank's part of each adapter, `peers` the others' (rank 0)
        self.host = HostTier(self.registry, pool, max_cpu_loras, shard, peers, max_cpu_lora_bytes)
        self.loads = Loads(self.registry, self.host, prefetch, retry_after_s,
                           max_loads_in_flight, prefetch_depth)  # fmt: skip
        self.device = DeviceTier(self.registry, self.host, pool, device_budget_bytes)
        self._pins = Pins(self.registry, self.loads, self.device)
        self.host_stats, self.device_stats = self.host.stats, self.device.stats
        self.pin_refusals = self._pins.refusals  # ref.key -> why its pin was dropped at load

    # -- settings, kept by the part that uses them ------------------------------------------

    @property
    def max_cpu_loras(self) -> int:
        """Host copies kept at most (more while in use or pinned)."""
        return self.host.max_cpu_loras

    @max_cpu_loras.setter
    def max_cpu_loras(self, value: int) -> None:
        self.host.max_cpu_loras = value

    @property
    def max_cpu_lora_bytes(self) -> int | None:
        """Host bytes the host copies may take at most (None: no byte limit)."""
        return self.host.max_cpu_lora_bytes

    @max_cpu_lora_bytes.setter
    def max_cpu_lora_bytes(self, value: int | None) -> None:
        self.host.max_cpu_lora_bytes = value

    @property
    def device_budget_bytes(self) -> int | None:
        """The adapter memory (`--lora-memory`): device bytes the slots may take."""
        return self.device.budget_bytes

    @device_budget_bytes.setter
    def device_budget_bytes(self, value: int | None) -> None:
        self.device.budget_bytes = value

    @property
    def prefetch_enabled(self) -> bool:
        """Whether loads run ahead in the background (else `ready` loads and waits)."""
        return self.loads.prefetch_enabled

    @prefetch_enabled.setter
    def prefetch_enabled(self, value: bool) -> None:
        self.loads.prefetch_enabled = value

    @property
    def retry_after_s(self) -> float:
        """Seconds a version whose load failed waits before it loads again."""
        return self.loads.retry_after_s

    @retry_after_s.setter
    def retry_after_s(self, value: float) -> None:
        self.loads.retry_after_s = value

    @property
    def max_loads_in_flight(self) -> int:
        """Loads that run at once (loader threads)."""
        return self.loads.max_loads_in_flight

    @max_loads_in_flight.setter
    def max_loads_in_flight(self, value: int) -> None:
        self.loads.max_loads_in_flight = value

    @property
    def prefetch_depth(self) -> int:
        """Adapters of the prefetch list loaded ahead at most."""
        return self.loads.prefetch_depth

    @prefetch_depth.setter
    def prefetch_depth(self, value: int) -> None:
        self.loads.prefetch_depth = value

    @property
    def pin_fraction(self) -> float:
        """The share of the adapter memory and of the slots that pins may take."""
        return self._pins.fraction

    @pin_fraction.setter
    def pin_fraction(self, value: float) -> None:
        self._pins.fraction = value

    # -- registry ---------------------------------------------------------------------------

    def register(self, name: str, path: Path | str, tenant: str = "default") -> LoRARef:
        """Validate and read a static adapter now (AdapterRejected if refused, TooLarge when
        it weighs more than the whole host byte limit); return its ref (host_tier.py).

        The same content again returns the same ref; new content becomes the current version.
        """
        return self.host.register_static(name, path, tenant)

    def register_stored(self, ref: LoRARef, store_path: str) -> LoRARef:
        """Record a stored version (read from the disk tier when a request first needs it)."""
        return self.registry.register_stored(ref, store_path)

    def lookup(self, name: str, tenant: str = "default") -> LoRARef | None:
        """The current version of (tenant, name), or None."""
        return self.registry.lookup(name, tenant)

    def unregister(self, name: str, tenant: str = "default") -> list[LoRARef]:
        """Forget every version of (tenant, name), freeing host and device memory.

        The caller makes sure no scheduled or running request uses them.
        """
        with self.registry.lock:
            gone = self.registry.remove(name, tenant)
            for entry in gone:
                self.device.free(entry)
                self.host.drop(entry)
        return [e.ref for e in gone]

    def forget_idle(self, idle_s: float, needed: Iterable[str] = ()) -> list[LoRARef]:
        """Forget stored versions (catalog mode) that nothing has used for `idle_s` seconds,
        that hold no host copy or slot and are not `needed` by a request: the registry must
        not grow with every version ever served. The next request registers one again."""
        return [e.ref for e in self.registry.forget_idle(idle_s, needed)]

    def is_registered(self, ref: LoRARef) -> bool:
        """Whether `ref` is known; a hit counts as a use (it is not forgotten as idle now)."""
        return self.registry.is_registered(ref)

    @property
    def registered(self) -> list[LoRARef]:
        """Every registered version."""
        return self.registry.refs()

    def peer_parts(self, key: str) -> tuple[HostPart, ...]:
        """The other tensor-parallel ranks' parts of version `key`, in rank order (KeyError
        when it is not in host memory): what rank 0 ships the workers as `key` takes a slot."""
        return self.host.peer_parts(key)

    # -- pins -------------------------------------------------------------------------------

    @property
    def pin_cap_bytes(self) -> int | None:
        """Device bytes all pinned versions together may take (None: no byte budget)."""
        return self._pins.cap_bytes

    @property
    def pin_cap_slots(self) -> int:
        """How many versions may be pinned at once: a fraction of the slots, at least one."""
        return self._pins.cap_slots

    @property
    def pinned(self) -> list[LoRARef]:
        """The pinned versions, loaded or not."""
        return self._pins.pinned()

    def pinned_bytes(self, tenant: str | None = None) -> int:
        """Device bytes of the pinned versions (of `tenant`; 0 for those not loaded yet)."""
        return self._pins.pinned_bytes(tenant)

    def pin(self, ref: LoRARef) -> str:
        """Keep `ref` (registered) resident from now on; its `pin_state` (pins.py: KeyError
        when not registered, PinRefused beyond the pins' cap)."""
        return self._pins.pin(ref)

    def unpin(self, ref: LoRARef) -> bool:
        """Let `ref` be evicted again like any idle version; False when it was not pinned."""
        return self._pins.unpin(ref)

    def pin_state(self, ref: LoRARef) -> str:
        """'resident', 'host', 'loading', 'failed: <why>', 'refused: <why>' or 'unpinned'."""
        return self._pins.state(ref)

    def pins(self) -> list[LoRARef]:
        """The pinned versions in host memory, for the scheduler to keep on the device each
        step (a load starts for each pinned one that is not)."""
        return self._pins.ready()

    # -- host tier and its loads ------------------------------------------------------------

    def ready(self, ref: LoRARef) -> bool:
        """True when `ref` can run in the next step (in host memory); with prefetch off, a
        cold adapter is loaded right now (stalling the step)."""
        return self.loads.ready(ref)

    def in_host_memory(self, ref: LoRARef) -> bool:
        """Whether `ref` is in host memory now (never starts a load, unlike `ready`)."""
        return self.host.holds(ref)

    def host_copy(self, ref: LoRARef) -> LoadedAdapter:
        """The adapter's weights in host memory (KeyError if it is not loaded there)."""
        return self.host.copy(ref)

    @property
    def in_host(self) -> list[LoRARef]:
        """Adapters in host memory now."""
        return self.host.refs()

    def prefetch(self, refs: Iterable[LoRARef]) -> int:
        """Load the adapters that waiting requests need in the background, the oldest
        request's first, fairly across tenants (loads.py); the loads started now."""
        return self.loads.prefetch(refs)

    def pending(self) -> set[str]:
        """Keys of the adapters being loaded now or queued to load (the prefetch list)."""
        return self.loads.pending()

    def wait_for(self, refs: Iterable[LoRARef], timeout: float) -> bool:
        """Block until none of `refs` is loading or queued, at most `timeout` s (False then)."""
        return self.loads.wait_for(refs, timeout)

    def wait_for_load(self, timeout: float) -> bool:
        """Block until a background load ends, at most `timeout` s; False when none runs."""
        return self.loads.wait_for_load(timeout)

    def failure(self, ref: LoRARef) -> str | None:
        """Why `ref` cannot run now (its last load failed recently, it is heavier than the
        whole host byte limit, or larger than the whole adapter memory budget), or None."""
        entry = self.registry.entries.get(ref.key)
        if entry is None:
            return f"adapter {ref.name} is not registered"
        return self.loads.failure(entry) or self.device.too_large(entry)

    def refusal(self, ref: LoRARef) -> str | None:
        """Why `ref` can never run here as set up (a client's error, `TooLarge`): heavier than
        the whole host byte limit, or larger than the whole adapter memory; else None."""
        entry = self.registry.entries.get(ref.key)
        return self.host.too_heavy(ref.key) or self.device.too_large(entry)

    # -- device tier ------------------------------------------------------------------------

    def device_bytes(self, ref: LoRARef) -> int:
        """Device bytes `ref` takes in the pool (0 until it is in host memory)."""
        return self.device.bytes_of(ref)

    @property
    def budget_bytes(self) -> int | None:
        """The adapter memory budget of the device pool (None: unlimited)."""
        return self.device.budget_bytes

    @property
    def capacity(self) -> int:
        """How many adapters the device holds at once (device_tier.py). The model-server
        protocol's `max_lora`: an inference gateway scores a replica with fewer adapters than
        this as having room for another."""
        return self.device.capacity

    @property
    def resident(self) -> list[LoRARef]:
        """Adapters in device slots now."""
        return self.device.resident()

    def slot_of(self, key: str) -> int:
        """The slot holding adapter `key` (made resident for this step)."""
        return self.device.slot_of(key)

    def slot_keys(self) -> dict[int, str]:
        """Slot -> the key of the adapter in it, for every occupied slot."""
        return self.device.slot_keys()

    def make_resident(
        self, keys: Iterable[str], in_use: Iterable[str], wanted: Iterable[str] = ()
    ) -> None:
        """Put every adapter in `keys` (all in host memory) into a device slot, evicting idle
        ones (never those in `in_use`; those in `wanted` last), then trim the host tier."""
        self.device.make_resident(keys, in_use, wanted)

    def place(self, ref: LoRARef, in_use: Iterable[str], wanted: Iterable[str] = ()) -> bool:
        """Make `ref` (in host memory) resident now, evicting idle adapters as `make_resident`
        does; False when it cannot (its device copy failed, or no run of KV blocks frees)."""
        return self.device.place(ref, in_use, wanted)

    def reclaim_blocks(self, short: int, in_use: Iterable[str], wanted: Iterable[str]) -> None:
        """Evict idle adapters from the arena until `short` more KV blocks are free."""
        self.device.reclaim_blocks(short, in_use, wanted)

    def drop_slot(self, key: str) -> None:
        """Free `key`'s device slot (its next use loads it again from the host copy)."""
        self.device.drop_slot(key)

    # compatibility names used by metrics (device tier)
    @property
    def loads_total(self) -> int:
        return self.device_stats.loads

    @property
    def evictions_total(self) -> int:
        return self.device_stats.evictions

    @property
    def hits_total(self) -> int:
        return self.device_stats.hits

    def close(self) -> None:
        """Stop the background loader threads."""
        self.loads.close()
