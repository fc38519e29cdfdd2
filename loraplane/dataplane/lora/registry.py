"""The registry of adapter versions: each by its key and the current one by (tenant, name),
where each one's files are (a folder on this machine, or the disk tier's copy of a stored
version), and which versions are pinned.

It holds what the manager's parts share: the entries, the clock of their uses, and the one
lock (`Registry.lock`) that every part takes, from the engine thread and the loader threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import IntegrityError, StoreError
from loraplane.adapters.limits import AdapterLimits
from loraplane.dataplane.lora.entry import Entry, State
from loraplane.dataplane.lora.loader import LoadedAdapter, load_lora
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import DiskTier


class Registry:
    """Adapter versions the engine knows (by `LoRARef.key`), their sources, and the pins.

    `lock` (reentrant) guards the entries and the state of every part of the manager (host
    tier, loads, device tier, pins): each part takes it, and a part's method named as called
    "under the lock" expects its caller to hold it. `pinned` is changed by the pins
    (pins.py); the tiers read it, since no eviction takes a pinned version.
    """

    def __init__(self, base: BaseModelSpec, limits: AdapterLimits, disk: DiskTier | None) -> None:
        self.base, self.limits, self.disk = base, limits, disk
        self.lock = threading.RLock()
        self.entries: dict[str, Entry] = {}  # ref.key -> entry
        self.names: dict[tuple[str, str], str] = {}  # (tenant, name) -> newest ref.key
        # ref.key -> whether its size was checked against the pins' cap (known once in host
        # memory)
        self.pinned: dict[str, bool] = {}
        self.clock = 0  # counts uses: an entry's `last_used` orders the LRU tiers

    def tick(self) -> int:
        """The clock, advanced by one use (under the lock)."""
        self.clock += 1
        return self.clock

    # -- versions ---------------------------------------------------------------------------

    def add(self, ref: LoRARef, local_path: Path) -> Entry:
        """The entry of static version `ref` read from `local_path`, recorded now if new
        (under the lock); `make_current` makes it the version its name serves."""
        return self.entries.setdefault(ref.key, Entry(ref, local_path=local_path))

    def make_current(self, ref: LoRARef) -> None:
        """Serve `ref` (registered) for its (tenant, name) from now on (under the lock)."""
        self.names[(ref.tenant, ref.name)] = ref.key

    def register_stored(self, ref: LoRARef, store_path: str) -> LoRARef:
        """Record a stored version (read from the disk tier when a request first needs it)."""
        if self.disk is None:
            raise ValueError("no disk tier configured: stored adapters cannot be loaded")
        with self.lock:
            entry = self.entries.setdefault(ref.key, Entry(ref, store_path=store_path))
            entry.touched = time.monotonic()
            self.make_current(ref)
        return ref

    def lookup(self, name: str, tenant: str = "default") -> LoRARef | None:
        """The current version of (tenant, name), or None."""
        key = self.names.get((tenant, name))
        return None if key is None else self.entries[key].ref

    def is_registered(self, ref: LoRARef) -> bool:
        """Whether `ref` is known; a hit counts as a use (it is not forgotten as idle now)."""
        entry = self.entries.get(ref.key)
        if entry is None:
            return False
        entry.touched = time.monotonic()
        return True

    def refs(self) -> list[LoRARef]:
        """Every registered version."""
        return [e.ref for e in list(self.entries.values())]

    def remove(self, name: str, tenant: str) -> list[Entry]:
        """Forget every version of (tenant, name), pinned or not, and return their entries
        (under the lock): the caller frees their host copies and slots."""
        self.names.pop((tenant, name), None)
        gone = [e for e in self.entries.values() if (e.ref.tenant, e.ref.name) == (tenant, name)]
        for entry in gone:
            self.pinned.pop(entry.ref.key, None)
            del self.entries[entry.ref.key]
        return gone

    def forget_idle(self, idle_s: float, needed: Iterable[str]) -> list[Entry]:
        """Forget the stored versions that nothing has used for `idle_s` seconds, that hold
        no host copy or slot, are not pinned and are not `needed` by a request; their
        entries. A static version is never forgotten: it could not be registered again."""
        needed = set(needed)
        horizon = time.monotonic() - idle_s
        with self.lock:
            idle = [
                e
                for e in self.entries.values()
                if e.store_path is not None
                and e.host is None
                and e.slot is None
                and e.state in (State.COLD, State.FAILED)
                and e.touched < horizon
                and e.ref.key not in needed
                and e.ref.key not in self.pinned
            ]
            for entry in idle:
                del self.entries[entry.ref.key]
                name = (entry.ref.tenant, entry.ref.name)
                if self.names.get(name) == entry.ref.key:
                    del self.names[name]
        return idle

    # -- sources ----------------------------------------------------------------------------

    def validate(self, path: Path | str) -> LoadedAdapter:
        """Read and validate a static adapter's files now (AdapterRejected if refused)."""
        return load_lora(path, self.base, self.limits)

    def read(self, entry: Entry) -> LoadedAdapter:
        """Read `entry`'s files (on a loader thread, not under the lock), checking its digest;
        a disk-tier copy that fails the check is fetched again once."""
        ref = entry.ref
        if entry.local_path is not None:
            return load_lora(entry.local_path, self.base, self.limits, ref.digest)
        if self.disk is None or entry.store_path is None:  # pragma: no cover - register_stored
            raise StoreError(f"adapter {ref.key} has no source")
        for attempt in (1, 2):
            try:
                with self.disk.reading(entry.store_path, ref.digest) as folder:
                    return load_lora(folder, self.base, self.limits, ref.digest)
            except IntegrityError:
                self.disk.discard(ref.digest)  # a corrupted local copy: fetch it again
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover
