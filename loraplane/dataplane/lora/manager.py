"""Which adapters the engine knows (host copies) and which sit in the device pool's slots.

Registration validates the adapter through the shared core and keeps a host copy; a step's
adapters are put in slots just before the step runs. A slot is reused least-recently-used
first, and never while a running sequence uses its adapter (the scheduler admits at most
`max_loras` distinct adapters among running sequences, so a free or evictable slot exists).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.limits import AdapterLimits
from loraplane.dataplane.lora.loader import LoadedAdapter, load_lora
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.sequence import LoRARef


@dataclass(slots=True)
class _Entry:
    ref: LoRARef
    adapter: LoadedAdapter
    slot: int | None = None
    last_used: int = 0


class LoRAManager:
    """Registry of adapter versions (by `LoRARef.key`) and their slots in a `LoRAPool`."""

    def __init__(self, pool: LoRAPool, base: BaseModelSpec, max_lora_rank: int) -> None:
        self.pool = pool
        self.base = base
        self.limits = AdapterLimits(max_rank=max_lora_rank)
        self._entries: dict[str, _Entry] = {}  # ref.key -> entry
        self._names: dict[tuple[str, str], str] = {}  # (tenant, name) -> newest ref.key
        self._slots: dict[int, str] = {}  # slot -> ref.key
        self._clock = 0
        self.loads_total = 0
        self.evictions_total = 0
        self.hits_total = 0

    def register(self, name: str, path: Path | str, tenant: str = "default") -> LoRARef:
        """Validate and load the adapter at `path` as (tenant, name); return its reference.

        Raises AdapterRejected (reason code in `.code`). The same content registered again
        returns the same reference; new content becomes the name's current version.
        """
        adapter = load_lora(path, self.base, self.limits)
        ref = LoRARef(name=name, tenant=tenant, digest=adapter.digest)
        self._entries.setdefault(ref.key, _Entry(ref, adapter))
        self._names[(tenant, name)] = ref.key
        return ref

    def lookup(self, name: str, tenant: str = "default") -> LoRARef | None:
        """The current version of (tenant, name), or None."""
        key = self._names.get((tenant, name))
        return None if key is None else self._entries[key].ref

    def unregister(self, name: str, tenant: str = "default") -> list[LoRARef]:
        """Forget every version of (tenant, name) and free their slots.

        The caller must make sure no scheduled or running request uses them.
        """
        self._names.pop((tenant, name), None)
        gone = [e for e in self._entries.values() if (e.ref.tenant, e.ref.name) == (tenant, name)]
        for entry in gone:
            if entry.slot is not None:
                self.pool.free(entry.slot)
                del self._slots[entry.slot]
            del self._entries[entry.ref.key]
        return [e.ref for e in gone]

    def is_registered(self, ref: LoRARef) -> bool:
        return ref.key in self._entries

    @property
    def registered(self) -> list[LoRARef]:
        return [e.ref for e in self._entries.values()]

    @property
    def resident(self) -> list[LoRARef]:
        """Adapters in device slots now."""
        return [self._entries[k].ref for k in self._slots.values()]

    def slot_of(self, key: str) -> int:
        """The slot holding adapter `key` (it must have been made resident for this step)."""
        slot = self._entries[key].slot
        if slot is None:
            raise KeyError(f"adapter {key} is not in a device slot")
        return slot

    def make_resident(self, keys: Iterable[str], in_use: Iterable[str]) -> None:
        """Put every adapter in `keys` into a slot, evicting least-recently-used adapters that
        are neither in `keys` nor in `in_use` (adapters of running sequences)."""
        self._clock += 1
        keep = set(keys) | set(in_use)
        for key in keys:
            entry = self._entries[key]
            entry.last_used = self._clock
            if entry.slot is not None:
                self.hits_total += 1
                continue
            slot = self._free_slot(keep)
            self.pool.load(slot, entry.adapter)
            entry.slot = slot
            self._slots[slot] = key
            self.loads_total += 1

    def _free_slot(self, keep: set[str]) -> int:
        free = self.pool.free_slots()
        if free:
            return free[0]
        victims = [e for k in self._slots.values() if k not in keep for e in [self._entries[k]]]
        if not victims:
            raise RuntimeError(
                f"all {self.pool.max_loras} adapter slots are in use by running requests"
            )
        victim = min(victims, key=lambda e: e.last_used)
        slot = victim.slot
        if slot is None:  # pragma: no cover - victims come from the resident set
            raise RuntimeError(f"adapter {victim.ref.key} has no slot")
        self.pool.free(slot)
        victim.slot = None
        del self._slots[slot]
        self.evictions_total += 1
        return slot
