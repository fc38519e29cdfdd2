"""The host tier: adapters in host memory, in the pool's host form, at most `max_cpu_loras` of
them and, when set, at most `max_cpu_lora_bytes` bytes of them; the least recently used copy
goes first, never one in a device slot, in use or pinned. A version larger than the whole byte
limit can never be kept: its load fails (`oversize`), failing only the requests that need it,
and while the limit stays below its weight it is refused without another read (`too_heavy`).
Static adapters are read and kept at once (`register_static`).

Under the byte limit, loads ahead of need (loads.py's prefetch) are planned by what each would
add (`expected_bytes`, the copy's weight when it was last held) against the room the copies
that must stay leave (`room`); a copy read ahead is kept only once the copies that may go make
room for it (`make_room`), so such loads never take the tier over the limit.

Copies arrive from the loader threads (loads.py) and from static registration; a version whose
load or placement failed loses its copy (the copy may be what is wrong) and is marked FAILED.
Under tensor parallelism, rank 0's copy is its own part, and the other ranks' parts (`peers`,
converted as the pool holds them) are kept beside it, dropped with it: rank 0 ships them to the
workers when the version takes a slot (parallel/group.py), so no worker reads adapter files.

What the tier weighs (`bytes`, `Entry.host_bytes`): every byte it keeps for a version, its own
copy and, under tensor parallelism, the other ranks' parts beside it. The ranks' parts are
equal in size, so on rank 0 a version of an N-rank replica takes N times one rank's part
(a column-parallel module's A and a row-parallel one's B are whole on every rank): about N
times what the same version takes in one rank's device pool. `max_cpu_loras` counts versions,
each with all its parts, so evicting one frees all of them at once; `max_cpu_lora_bytes` weighs
them the same way (`bytes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Protocol

from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.dataplane.lora.entry import Entry, State, TierStats
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.lora.registry import Registry
from loraplane.dataplane.lora.scrub import without_paths
from loraplane.dataplane.lora.weights import LoadedAdapter
from loraplane.dataplane.sequence import LoRARef


class HostPart(Protocol):
    """Another rank's part of a version, as rank 0 keeps it (parallel/ship.PackedPart)."""

    @property
    def nbytes(self) -> int:
        """Host bytes it holds."""
        ...


class HostTier:
    """Host copies of adapter versions, keyed by `LoRARef.key`, under the registry's lock.

    Per-step work must not grow with what is registered: the copies are kept in `hosted`,
    apart from the registry, and only they are scanned.
    """

    def __init__(
        self,
        registry: Registry,
        pool: LoRAPool,
        max_cpu_loras: int | None,
        shard: Callable[[LoadedAdapter], LoadedAdapter] | None,
        peers: Callable[[LoadedAdapter], tuple[HostPart, ...]] | None = None,
        max_cpu_lora_bytes: int | None = None,
    ) -> None:
        self._registry, self._pool = registry, pool
        # a tensor-parallel rank's part of each adapter read (parallel/shard.py), validated
        # against the whole base model first; the pool holds that part
        self._shard = shard
        # rank 0 under tensor parallelism: the other ranks' parts of each adapter read
        self._peers = peers
        self._peer_parts: dict[str, tuple[HostPart, ...]] = {}  # ref.key -> rank 1..N-1's
        self.max_cpu_loras = max_cpu_loras or pool.num_slots
        if self.max_cpu_loras < pool.num_slots:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= the pool's slots "
                f"({pool.num_slots})"
            )
        # host bytes the copies may take (None: no byte limit); the copies in a device slot,
        # in use or pinned may hold the tier over it until they go, as with the count
        self.max_cpu_lora_bytes = max_cpu_lora_bytes
        self.hosted: dict[str, Entry] = {}  # ref.key -> entry with a host copy
        self.bytes = 0  # host bytes of every copy in `hosted`, the other ranks' parts included
        self.stats = TierStats("cpu")

    def host_form(self, adapter: LoadedAdapter) -> LoadedAdapter:
        """`adapter` as the pool holds it (this rank's part of it, with tensor parallelism)."""
        return self._pool.host_form(adapter if self._shard is None else self._shard(adapter))

    def peer_forms(self, adapter: LoadedAdapter) -> tuple[HostPart, ...]:
        """The other ranks' parts of `adapter` (validated; `host_form` first, which refuses
        DoRA), as rank 0 ships them (parallel/ship.py: packed in the pools' host form); ()
        without tensor parallelism, or on a worker."""
        return () if self._peers is None else self._peers(adapter)

    def peer_parts(self, key: str) -> tuple[HostPart, ...]:
        """Ranks 1..N-1's parts of version `key` (in host memory: KeyError if not), in rank
        order: what rank 0 ships the workers when `key` takes a slot."""
        with self._registry.lock:
            return self._peer_parts[key]

    def register_static(self, name: str, path: Path | str, tenant: str) -> LoRARef:
        """Validate and read static adapter `name` from `path` now and keep its copy, the
        current version of (tenant, name); its ref (the same for the same content).
        AdapterRejected if refused, TooLarge (nothing recorded) when it weighs more than the
        whole byte limit."""
        adapter = self._registry.validate(path)
        ref = LoRARef(name=name, tenant=tenant, digest=adapter.digest)
        host = self.host_form(adapter)
        peers = self.peer_forms(adapter)
        oversize = self.oversize(name, host, peers)
        if oversize is not None:  # refused before it is recorded: it could never be served
            raise AdapterRejected(ReasonCode.TOO_LARGE, oversize)
        with self._registry.lock:
            entry = self._registry.add(ref, Path(path))
            if entry.host is None:
                self.add(entry, host, peers)
            self._registry.make_current(ref)
            # registering thousands of static adapters must not hold them all in memory: the
            # host tier keeps max_cpu_loras; the others are read again from their folder
            self.evict()
        return ref

    @staticmethod
    def weigh(adapter: LoadedAdapter, peers: tuple[HostPart, ...] = ()) -> int:
        """Host bytes `adapter` (host form) and `peers` take together, as the tier counts."""
        return adapter.nbytes + sum(part.nbytes for part in peers)

    def oversize(
        self, name: str, adapter: LoadedAdapter, peers: tuple[HostPart, ...] = ()
    ) -> str | None:
        """Why `adapter` (host form, of adapter `name`) and `peers` can never be kept: they
        weigh more than the whole byte limit (`max_cpu_lora_bytes`); else None."""
        return self._over_limit(name, self.weigh(adapter, peers), bool(peers))

    def too_heavy(self, key: str) -> str | None:
        """Why version `key` is refused without reading it again: it is registered, not in
        host memory, and its copy, as last weighed (`Entry.last_host_bytes`), is more than
        the whole byte limit; else None. So a version too heavy for the limit is read once,
        not once per request, for as long as the limit stays below its weight."""
        entry = self._registry.entries.get(key)
        if entry is None or entry.host is not None or entry.last_host_bytes is None:
            return None
        return self._over_limit(entry.ref.name, entry.last_host_bytes, self._peers is not None)

    def _over_limit(self, name: str, weight: int, ranks: bool) -> str | None:
        limit = self.max_cpu_lora_bytes
        if limit is None or weight <= limit:
            return None
        parts = " (every tensor-parallel rank's part)" if ranks else ""
        return (
            f"adapter {name} needs {weight} bytes of host memory{parts}, more than"
            f" the whole host adapter limit ({limit} bytes, --max-cpu-lora-bytes)"
        )

    def expected_bytes(self, entry: Entry) -> int:
        """The host bytes loading `entry` is expected to add: its copy's as last weighed, else
        the mean copy the tier holds now (0 while it holds none). Loads ahead of need are
        planned by it; what a load read is weighed again before it is kept (`make_room`)."""
        if entry.last_host_bytes is not None:
            return entry.last_host_bytes
        return self.bytes // len(self.hosted) if self.hosted else 0

    def room(self, keep: Collection[str]) -> int | None:
        """The bytes the byte limit leaves beside the copies eviction cannot take (in a device
        slot, in `keep`, pinned), under the lock; None without a byte limit."""
        limit = self.max_cpu_lora_bytes
        if limit is None:
            return None
        fixed = sum(e.host_bytes for e in self.hosted.values() if not self._evictable(e, keep))
        return limit - fixed

    def make_room(self, weight: int, keep: Collection[str]) -> bool:
        """Evict the least recently used copies that may go (`evict`'s rule, those in `keep`
        kept) until `weight` more bytes fit within the byte limit (under the lock); False,
        evicting none, when they cannot fit beside the copies that must stay."""
        limit, room = self.max_cpu_lora_bytes, self.room(keep)
        if limit is None or room is None:
            return True
        if weight > room:
            return False
        for victim in sorted(self.hosted.values(), key=lambda e: e.last_used):
            if self.bytes + weight <= limit:
                break
            if self._evictable(victim, keep):
                self._evict(victim)
        return True

    def add(self, entry: Entry, adapter: LoadedAdapter, peers: tuple[HostPart, ...] = ()) -> None:
        """Keep `adapter` (in host form) as `entry`'s host copy, the most recently used, and
        `peers` (`peer_forms`) beside it (under the lock), weighed together (`bytes`). Evicts
        nothing: this may run on a loader thread while the engine thread is between `ready`
        and `make_resident`, so a loader makes room first only by `make_room`, which spares
        the copies waiting requests need; the engine thread trims the tier in
        `make_resident` (device_tier.py)."""
        self._forget(entry)  # a copy it held before (a static version registered again)
        if self._peers is not None:
            self._peer_parts[entry.ref.key] = peers
        entry.host_bytes = entry.last_host_bytes = self.weigh(adapter, peers)
        self.bytes += entry.host_bytes
        entry.host, entry.state, entry.error = adapter, State.HOST, None
        entry.device_bytes = self._pool.bytes_needed(adapter)
        entry.touched = time.monotonic()
        self.hosted[entry.ref.key] = entry
        entry.last_used = self._registry.tick()
        self.stats.loads += 1

    def fail(self, entry: Entry, message: str) -> None:
        """Mark `entry` FAILED with `message` (under the lock): its waiting requests fail with
        it, and it loads again from its source after the retry window."""
        entry.state, entry.error = State.FAILED, without_paths(message)
        entry.failed_at = time.monotonic()
        if entry.host is not None:  # the host copy may be what is wrong: read it again
            self.drop(entry)

    def drop(self, entry: Entry) -> None:
        """Forget `entry`'s host copy, if any (under the lock)."""
        self._forget(entry)
        entry.host = None

    def _forget(self, entry: Entry) -> None:
        """Take `entry`'s copy and parts out of the tier and its bytes (if it holds them)."""
        if self.hosted.pop(entry.ref.key, None) is not None:
            self.bytes -= entry.host_bytes
        entry.host_bytes = 0
        self._peer_parts.pop(entry.ref.key, None)

    def over(self) -> bool:
        """Whether the tier holds more copies than `max_cpu_loras` or more bytes than
        `max_cpu_lora_bytes`."""
        limit = self.max_cpu_lora_bytes
        return len(self.hosted) > self.max_cpu_loras or (limit is not None and self.bytes > limit)

    def evict(self, needed: Iterable[str] = ()) -> None:
        """Drop the least recently used copies (under the lock) until both the count
        (`max_cpu_loras`) and the bytes (`max_cpu_lora_bytes`) are within their limits, none
        in a device slot, in `needed` (in use or wanted) or pinned: the tier may stay over
        its limits until they go."""
        if not self.over():
            return
        needed = set(needed)
        for victim in sorted(self.hosted.values(), key=lambda e: e.last_used):
            if not self.over():
                break
            if self._evictable(victim, needed):
                self._evict(victim)

    def _evictable(self, entry: Entry, keep: Collection[str]) -> bool:
        """Whether eviction may take `entry`'s copy: not in a device slot, in `keep` or pinned."""
        key = entry.ref.key
        return entry.slot is None and key not in keep and key not in self._registry.pinned

    def _evict(self, victim: Entry) -> None:
        self._forget(victim)
        victim.host, victim.state = None, State.COLD
        self.stats.evictions += 1

    def copy(self, ref: LoRARef) -> LoadedAdapter:
        """The adapter's weights in host memory (KeyError if it is not loaded there)."""
        host = self._registry.entries[ref.key].host
        if host is None:
            raise KeyError(f"adapter {ref.key} is not in host memory")
        return host

    def holds(self, ref: LoRARef) -> bool:
        """Whether `ref` is in host memory now."""
        entry = self._registry.entries.get(ref.key)
        return entry is not None and entry.state is State.HOST

    def refs(self) -> list[LoRARef]:
        """Adapters in host memory now."""
        return [e.ref for e in list(self._registry.entries.values()) if e.host is not None]
