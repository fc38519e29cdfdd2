"""Adapter versions the engine knows, and where each one is: disk, host memory, device slot.

Registration records a version: eagerly for static adapters (`register`: validated and read
now, so a bad one fails at start) and lazily for stored ones (`register_stored`: read when a
request needs it). Host copies live in an LRU of `max_cpu_loras`; device slots are limited by
memory: `device_budget_bytes` (the resolved `--lora-memory`) bounds the bytes in the pool, and
the slot count (`EngineConfig.lora_slots`) only bounds how many distinct adapters one step may
use. The scheduler admits a new adapter only while the running adapters and it fit in the
budget (`device_bytes`, `budget_bytes`); idle adapters stay resident as a cache and are evicted
least recently used first, those that no waiting request needs before those that one does.
Nothing used by a running request is evicted.

Loads from disk into host memory run on background threads, off the engine's critical path:
the engine hands `prefetch` the waiting requests' adapters each step, oldest request first
(the waiting queue is the prefetch list), `max_loads_in_flight` at a time, each loader thread
taking the next one as it finishes, so the requests next in line get their adapters first while
the current batch runs. Fair across tenants: the list keeps `prefetch_depth` adapters taken
from the tenants in turn (each tenant's in its own order; one of each, when more tenants wait)
and the loader threads are shared as `tiers/load_order.py` says, so one tenant's slow or dead
objects delay only its own loads. The
scheduler admits a request once `ready` says its adapter is in host memory. A load that fails
(any exception: digest mismatch, store unreachable after retries, a bad path) marks the
version failed for `retry_after_s`: the engine fails only the requests that need it, and the
next request after that window tries again. An adapter larger than the whole budget fails
the same way.

Pinned versions (`pin`, docs/dataplane.md "Pinned adapters") never go cold: once in host
memory they are never evicted from it, the scheduler places them on the device each step and
counts them in the budget and in their tenant's adapter memory, and no eviction (budget, host
tier, KV reclaim, forgetting idle versions) takes them. Pins may take at most `pin_fraction`
of the adapter memory (and of the slots): more is refused (`PinRefused`, naming the numbers).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, IntegrityError, ReasonCode, StoreError
from loraplane.adapters.limits import AdapterLimits
from loraplane.dataplane.lora.loader import LoadedAdapter, load_lora
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.step_observer import AdapterLoad, Tier
from loraplane.dataplane.tiers.disk import DiskTier
from loraplane.dataplane.tiers.load_order import in_turn, next_tenant

log = logging.getLogger(__name__)


_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/:'\"]+/)+([^\s/:'\"]+)")
# s3://bucket/key, and the endpoint URLs botocore names in its errors
_URL = re.compile(r"\b[a-zA-Z][\w+.-]*://[^\s'\"]*[^\s'\".,;:)]")


def _last_component(match: re.Match[str]) -> str:
    path = match.group(0).partition("://")[2].partition("/")[2]
    return path.rstrip("/").rpartition("/")[2] or "the store"


def without_paths(message: str) -> str:
    """`message` with each absolute path and URL cut to its last component: a load failure is
    told to the tenant's clients, and where this replica keeps its files (folders, buckets,
    store endpoints) is none of their business."""
    return _PATH.sub(r"\1", _URL.sub(_last_component, message))


NICE_ENV = "LORAPLANE_LOADER_NICE"


def loader_nice() -> int:
    """The loader threads' nice value, from LORAPLANE_LOADER_NICE (default 19; 0 leaves them
    at the engine's priority). ValueError naming the variable when it is not 0..19."""
    text = os.environ.get(NICE_ENV, "19").strip()
    if not text.isdigit() or not 0 <= int(text) <= 19:
        raise ValueError(f"{NICE_ENV} must be an integer in 0..19, got {text!r}")
    return int(text)


def _lower_priority(nice: int) -> None:
    """Loader threads run at a low CPU priority: they fill the CPU time the step leaves idle
    instead of taking cores from its compute threads (on a CPU device an OpenMP barrier waits
    for a descheduled thread), while a GPU step leaves the CPU to them anyway. Linux only."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class PinRefused(Exception):
    """A pin that would not fit: pinned adapters would take more than their cap of the
    adapter memory or of the slots. `str()` names the numbers."""


PIN_FRACTION = 0.5  # of the adapter memory and of the slots, at most, pinned


class State(enum.Enum):
    COLD = "cold"  # registered; bytes on disk or in the store only
    LOADING = "loading"  # being read into host memory in the background
    HOST = "host"  # in host memory (and maybe in a device slot)
    FAILED = "failed"  # the last load failed; `error` says why


@dataclass(slots=True)
class _Entry:
    ref: LoRARef
    local_path: Path | None = None  # static adapters: a folder or archive on this machine
    store_path: str | None = None  # stored versions: their folder in the object store
    state: State = State.COLD
    host: LoadedAdapter | None = None
    slot: int | None = None
    last_used: int = 0
    error: str | None = None
    failed_at: float = 0.0
    device_bytes: int = 0  # bytes it takes in the device pool (known once in host memory)
    touched: float = field(default_factory=time.monotonic)  # last registered or used
    future: Future[None] | None = field(default=None, repr=False)


@dataclass(slots=True)
class TierStats:
    """Counters per tier, for `loraplane_adapter_*` metrics; each load's time goes to
    `report`, the engine's step observers (step_observer.py), which hand it on in a record."""

    tier: Tier
    loads: int = 0
    failures: int = 0
    hits: int = 0
    evictions: int = 0
    report: Callable[[AdapterLoad], None] | None = None

    def load_ended(self, key: str, start: float) -> None:
        """A load of version `key` that began at `start` (perf_counter) ended now."""
        if self.report is not None:
            self.report(AdapterLoad(self.tier, key, time.perf_counter() - start))


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
    ) -> None:
        self.pool = pool
        self.base = base
        # a tensor-parallel rank's part of each adapter read (parallel/shard.py), validated
        # against the whole `base` first; the pool holds that part
        self._shard = shard
        self.limits = AdapterLimits(max_rank=max_lora_rank)
        self.max_cpu_loras = max_cpu_loras or pool.max_loras
        if self.max_cpu_loras < pool.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({pool.max_loras})"
            )
        self.disk = disk
        self.device_budget_bytes = device_budget_bytes
        self.prefetch_enabled = prefetch
        self.retry_after_s = retry_after_s
        self.max_loads_in_flight = max_loads_in_flight
        # adapters loaded ahead at most: half the host tier, so a prefetched copy is not
        # evicted by later prefetches before its request runs
        self.prefetch_depth = prefetch_depth or max(1, self.max_cpu_loras // 2)
        self._queue: list[_Entry] = []  # the latest prefetch list, in load order
        self.host_stats, self.device_stats = TierStats("cpu"), TierStats("gpu")
        self._entries: dict[str, _Entry] = {}  # ref.key -> entry
        # per-step work must not grow with what is registered: the host copies and the loads
        # in flight are kept apart from the registry
        self._hosted: dict[str, _Entry] = {}  # ref.key -> entry with a host copy
        self._loading: set[str] = set()  # ref.keys being loaded
        self._names: dict[tuple[str, str], str] = {}  # (tenant, name) -> newest ref.key
        self._slots: dict[int, str] = {}  # slot -> ref.key
        # ref.key -> whether its size was checked against the cap (known once in host memory)
        self._pins: dict[str, bool] = {}
        self.pin_refusals: dict[str, str] = {}  # ref.key -> why its pin was dropped at load
        self.pin_fraction = PIN_FRACTION
        self._lock = threading.RLock()
        self._load_ended = threading.Condition(self._lock)  # notified as each load ends
        self._loads_in_flight = 0
        self._tenant_loads: Counter[str] = Counter()  # tenant -> its loads in flight
        self._served: dict[str, int] = {}  # tenant -> when its last load started (a counter)
        self._starts = 0
        self._closed = False
        self._clock = 0
        nice = loader_nice()
        self._pool = ThreadPoolExecutor(  # room for the threads lent beyond the limit
            max_workers=2 * max_loads_in_flight,
            thread_name_prefix="lora-load",
            initializer=functools.partial(_lower_priority, nice) if nice else None,
        )

    # -- registry ---------------------------------------------------------------------------

    def register(self, name: str, path: Path | str, tenant: str = "default") -> LoRARef:
        """Validate and read a static adapter now (AdapterRejected if refused); return its ref.

        The same content again returns the same ref; new content becomes the current version.
        """
        adapter = load_lora(path, self.base, self.limits)
        ref = LoRARef(name=name, tenant=tenant, digest=adapter.digest)
        with self._lock:
            entry = self._entries.setdefault(ref.key, _Entry(ref, local_path=Path(path)))
            if entry.host is None:
                self._to_host(entry, self._host_form(adapter))
            self._names[(tenant, name)] = ref.key
            # registering thousands of static adapters must not hold them all in memory: the
            # host tier keeps max_cpu_loras; the others are read again from their folder
            self._evict_host()
        return ref

    def register_stored(self, ref: LoRARef, store_path: str) -> LoRARef:
        """Record a stored version (read from the disk tier when a request first needs it)."""
        if self.disk is None:
            raise ValueError("no disk tier configured: stored adapters cannot be loaded")
        with self._lock:
            entry = self._entries.setdefault(ref.key, _Entry(ref, store_path=store_path))
            entry.touched = time.monotonic()
            self._names[(ref.tenant, ref.name)] = ref.key
        return ref

    def lookup(self, name: str, tenant: str = "default") -> LoRARef | None:
        """The current version of (tenant, name), or None."""
        key = self._names.get((tenant, name))
        return None if key is None else self._entries[key].ref

    def unregister(self, name: str, tenant: str = "default") -> list[LoRARef]:
        """Forget every version of (tenant, name), freeing host and device memory.

        The caller makes sure no scheduled or running request uses them.
        """
        with self._lock:
            self._names.pop((tenant, name), None)
            gone = [
                e for e in self._entries.values() if (e.ref.tenant, e.ref.name) == (tenant, name)
            ]
            for entry in gone:
                self._pins.pop(entry.ref.key, None)
                self._drop_slot(entry)
                entry.host = None
                self._hosted.pop(entry.ref.key, None)
                del self._entries[entry.ref.key]
        return [e.ref for e in gone]

    # -- pins -------------------------------------------------------------------------------

    @property
    def pin_cap_bytes(self) -> int | None:
        """Device bytes all pinned versions together may take (None: no byte budget)."""
        budget = self.device_budget_bytes
        return None if budget is None else int(budget * self.pin_fraction)

    @property
    def pin_cap_slots(self) -> int:
        """How many versions may be pinned at once: a fraction of the slots, at least one."""
        return max(1, int(self.pool.max_loras * self.pin_fraction))

    @property
    def pinned(self) -> list[LoRARef]:
        """The pinned versions, loaded or not."""
        with self._lock:
            return [self._entries[k].ref for k in sorted(self._pins)]

    def pinned_bytes(self, tenant: str | None = None) -> int:
        """Device bytes of the pinned versions (of `tenant`; 0 for those not loaded yet)."""
        with self._lock:
            entries = [self._entries[k] for k in self._pins]
        return sum(e.device_bytes for e in entries if tenant is None or e.ref.tenant == tenant)

    def pin(self, ref: LoRARef) -> str:
        """Keep `ref` (registered) resident from now on; its `pin_state`. A version not in
        host memory starts loading now; the scheduler places it on the device once it is.
        KeyError when `ref` is not registered; PinRefused when the pins would take more than
        their cap of the slots or (size known) of the adapter memory. A version whose size is
        learnt at load and does not fit is unpinned then, the reason in `pin_refusals`."""
        with self._lock:
            entry = self._entries.get(ref.key)
            if entry is None:
                raise KeyError(f"adapter {ref.key} is not registered")
            if ref.key not in self._pins:
                self._check_pin(entry)
                self._pins[ref.key] = entry.host is not None
                self.pin_refusals.pop(ref.key, None)
                self._load_pin(entry)
            return self._pin_state(entry)

    def unpin(self, ref: LoRARef) -> bool:
        """Let `ref` be evicted again like any idle version; False when it was not pinned."""
        with self._lock:
            return self._pins.pop(ref.key, None) is not None

    def pin_state(self, ref: LoRARef) -> str:
        """'resident' (in a device slot), 'host' (placed in the next step), 'loading',
        'failed: <why>' (loaded again after the retry window), 'refused: <why>' or
        'unpinned'."""
        with self._lock:
            refused = self.pin_refusals.get(ref.key)
            if refused is not None:
                return f"refused: {refused}"
            entry = self._entries.get(ref.key)
            if entry is None or ref.key not in self._pins:
                return "unpinned"
            return self._pin_state(entry)

    def _pin_state(self, entry: _Entry) -> str:
        if entry.slot is not None:
            return "resident"
        if entry.state is State.FAILED:
            return f"failed: {entry.error}"
        return "host" if entry.host is not None else "loading"

    def _check_pin(self, entry: _Entry) -> None:
        """PinRefused unless `entry` fits beside the other pins (under the lock)."""
        name = entry.ref.name
        others = [self._entries[k] for k in self._pins if k != entry.ref.key]
        slots = self.pin_cap_slots
        if len(others) + 1 > slots:
            raise PinRefused(
                f"pinning {name} would pin {len(others) + 1} adapters on this replica, more"
                f" than its cap of {slots} ({self.pin_fraction:.0%} of its"
                f" {self.pool.max_loras} adapter slots)"
            )
        cap = self.pin_cap_bytes
        if cap is None or entry.host is None:
            return
        used = sum(e.device_bytes for e in others)
        if used + entry.device_bytes > cap:
            raise PinRefused(
                f"pinning {name} needs {entry.device_bytes} bytes of adapter memory beside the"
                f" {used} bytes pinned already, more than the {cap} bytes pins may take"
                f" ({self.pin_fraction:.0%} of the {self.device_budget_bytes}-byte adapter"
                " memory, --lora-memory)"
            )

    def _load_pin(self, entry: _Entry) -> None:
        """Start loading pinned `entry` if it is cold (or failed, past the retry window)."""
        if entry.state is State.FAILED:
            if time.monotonic() - entry.failed_at < self.retry_after_s:
                return
            entry.state = State.COLD
        if entry.state is State.COLD and not self._closed:
            self._begin_load(entry)

    def pins(self) -> list[LoRARef]:
        """The pinned versions in host memory, for the scheduler to keep on the device each
        step; a load starts for each pinned one that is not (a first load, or a retry). One
        whose size, learnt at load, does not fit beside the other pins is unpinned with the
        reason in `pin_refusals`."""
        if not self._pins:
            return []
        ready: list[LoRARef] = []
        with self._lock:
            for key, checked in sorted(self._pins.items()):
                entry = self._entries[key]
                if entry.host is None:
                    self._load_pin(entry)
                    continue
                if not checked:
                    try:
                        self._check_pin(entry)
                    except PinRefused as e:
                        del self._pins[key]
                        self.pin_refusals[key] = str(e)
                        log.warning("pin of %s dropped: %s", key, e)
                        continue
                    self._pins[key] = True
                ready.append(entry.ref)
        return ready

    def is_registered(self, ref: LoRARef) -> bool:
        """Whether `ref` is known; a hit counts as a use (it is not forgotten as idle now)."""
        entry = self._entries.get(ref.key)
        if entry is None:
            return False
        entry.touched = time.monotonic()
        return True

    @property
    def registered(self) -> list[LoRARef]:
        return [e.ref for e in list(self._entries.values())]

    @property
    def resident(self) -> list[LoRARef]:
        """Adapters in device slots now."""
        return [self._entries[k].ref for k in list(self._slots.values())]

    def host_copy(self, ref: LoRARef) -> LoadedAdapter:
        """The adapter's weights in host memory (KeyError if it is not loaded there)."""
        host = self._entries[ref.key].host
        if host is None:
            raise KeyError(f"adapter {ref.key} is not in host memory")
        return host

    @property
    def in_host(self) -> list[LoRARef]:
        """Adapters in host memory now."""
        return [e.ref for e in list(self._entries.values()) if e.host is not None]

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

    # -- host tier ----------------------------------------------------------------------------

    def ready(self, ref: LoRARef) -> bool:
        """True when `ref` can run in the next step (in host memory). With prefetch off, a
        cold adapter is loaded right now (stalling the step); with prefetch on, loads start
        only in `prefetch`, in the order the engine gives."""
        entry = self._entries.get(ref.key)
        if entry is None:
            return False
        if entry.state is State.HOST:
            return True
        if not self.prefetch_enabled:
            self._load_now(entry)
        return entry.host is not None  # loaded now (prefetch off), or by a racing load

    def in_host_memory(self, ref: LoRARef) -> bool:
        """Whether `ref` is in host memory now (never starts a load, unlike `ready`)."""
        entry = self._entries.get(ref.key)
        return entry is not None and entry.state is State.HOST

    def prefetch(self, refs: Iterable[LoRARef]) -> int:
        """Load the adapters that waiting requests need in the background, in the order given
        (the engine passes the oldest request's first) within each tenant and taking tenants
        in turn: `prefetch_depth` of them (or one of each tenant's, when more tenants wait),
        `max_loads_in_flight` at a time, fairly across tenants (see the module's docstring).
        Replaces the previous list; returns the loads started now (each loader thread goes on
        with the next adapter as it finishes)."""
        if not self.prefetch_enabled:
            return 0
        started = 0
        with self._lock:
            by_tenant: dict[str, list[_Entry]] = {}
            for ref in refs:
                entry = self._entries.get(ref.key)
                if entry is not None:
                    mine = by_tenant.setdefault(ref.tenant, [])
                    if len(mine) < self.prefetch_depth:  # more of one could never be kept
                        mine.append(entry)
            queue = in_turn(by_tenant.values())
            # every waiting tenant has a place: another tenant's loads, however slow, never
            # fill the list
            self._queue = queue[: max(self.prefetch_depth, len(by_tenant))]
            # the turns of tenants that neither wait nor load are forgotten: the map stays small
            self._served = {
                t: n for t, n in self._served.items() if t in by_tenant or self._tenant_loads[t]
            }
            while (entry := self._next_load()) is not None:
                self._begin_load(entry)
                started += 1
        return started

    def _next_load(self) -> _Entry | None:
        """The adapter of the prefetch list to load now, or None (under the lock): the first
        one needing a load of the tenant `load_order.next_tenant` picks."""
        now = time.monotonic()
        first: dict[str, _Entry] = {}  # tenant -> its first adapter needing a load
        for entry in self._queue:
            tenant = entry.ref.tenant
            if tenant not in first and (
                entry.state is State.COLD
                or (entry.state is State.FAILED and now - entry.failed_at >= self.retry_after_s)
            ):
                first[tenant] = entry
        chosen = next_tenant(first, self._tenant_loads, self._served, self.max_loads_in_flight)
        return None if chosen is None else first[chosen]

    def _begin_load(self, entry: _Entry) -> None:
        entry.state = State.LOADING
        self._loading.add(entry.ref.key)
        self._loads_in_flight += 1
        self._tenant_loads[entry.ref.tenant] += 1
        self._starts += 1
        self._served[entry.ref.tenant] = self._starts
        entry.future = self._pool.submit(self._load, entry)

    def pending(self) -> set[str]:
        """Keys of the adapters being loaded now or queued to load (the prefetch list)."""
        with self._lock:
            return self._pending()

    def _pending(self) -> set[str]:
        return self._loading | {e.ref.key for e in self._queue if e.state is State.COLD}

    def wait_for(self, refs: Iterable[LoRARef], timeout: float) -> None:
        """Block until none of `refs` is loading or queued to load, for at most `timeout`
        seconds."""
        keys = {r.key for r in refs}
        deadline = time.monotonic() + timeout
        with self._load_ended:
            while True:
                if not keys & self._pending():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._load_ended.wait(left)

    def device_bytes(self, ref: LoRARef) -> int:
        """Device bytes `ref` takes in the pool (0 until it is in host memory)."""
        entry = self._entries.get(ref.key)
        return 0 if entry is None else entry.device_bytes

    @property
    def capacity(self) -> int:
        """How many adapters the device holds at once: the pool's slots, or fewer where the
        memory budget holds fewer adapters of the mean size of those resident now (all slots
        while none is). The model-server protocol's `max_lora`: an inference gateway scores a
        replica with fewer adapters than this as having room for another."""
        slots = self.pool.max_loras
        budget, resident = self.device_budget_bytes, len(self._slots)
        if budget is None or not resident or not self.pool.bytes_used:
            return slots
        return max(1, min(slots, budget * resident // self.pool.bytes_used))

    @property
    def budget_bytes(self) -> int | None:
        """The adapter memory budget of the device pool (None: unlimited)."""
        return self.device_budget_bytes

    def failure(self, ref: LoRARef) -> str | None:
        """Why `ref` cannot run now (its last load failed recently, or it is larger than the
        whole adapter memory budget), or None."""
        entry = self._entries.get(ref.key)
        if entry is None:
            return f"adapter {ref.name} is not registered"
        if entry.state is State.FAILED and time.monotonic() - entry.failed_at < self.retry_after_s:
            return entry.error
        budget = self.device_budget_bytes
        if budget is not None and entry.device_bytes > budget:
            return (
                f"adapter {ref.name} needs {entry.device_bytes} bytes of device memory, more"
                f" than the whole adapter memory budget ({budget} bytes, --lora-memory)"
            )
        return None

    def _load_now(self, entry: _Entry) -> None:
        """Load `entry` and wait for it (prefetch off), unless it failed too recently."""
        with self._lock:
            if entry.state is State.FAILED:
                if time.monotonic() - entry.failed_at < self.retry_after_s:
                    return
                entry.state = State.COLD
            if entry.state is State.COLD:
                self._begin_load(entry)
            future = entry.future
        if future is not None:
            future.result()

    def _load(self, entry: _Entry) -> None:
        try:
            self._load_once(entry)
        finally:
            with self._load_ended:
                self._loads_in_flight -= 1
                self._tenant_loads[entry.ref.tenant] -= 1
                if self._tenant_loads[entry.ref.tenant] <= 0:
                    del self._tenant_loads[entry.ref.tenant]
                self._loading.discard(entry.ref.key)
                self._load_ended.notify_all()
                if self.prefetch_enabled and not self._closed:
                    following = self._next_load()  # go on down the prefetch list
                    if following is not None:
                        self._begin_load(following)

    def _load_once(self, entry: _Entry) -> None:
        start = time.perf_counter()
        try:
            adapter = self._host_form(self._read(entry))
        except Exception as e:  # whatever the cause, the version fails, never stays LOADING
            message = (
                str(e)
                if isinstance(e, AdapterRejected | StoreError | OSError)
                else (f"{type(e).__name__}: {e}")
            )
            with self._lock:
                self._fail_entry(entry, message)
                self.host_stats.failures += 1
            log.warning("loading adapter %s failed: %s", entry.ref.key, message)
            return
        with self._lock:
            if entry.ref.key in self._entries:  # not unregistered meanwhile
                self._to_host(entry, adapter)
                self.host_stats.load_ended(entry.ref.key, start)

    def _fail_entry(self, entry: _Entry, message: str) -> None:
        """Mark `entry` FAILED with `message` (under the lock): its waiting requests fail with
        it, and it loads again from its source after the retry window."""
        entry.state, entry.error = State.FAILED, without_paths(message)
        entry.failed_at = time.monotonic()
        if entry.host is not None:  # the host copy may be what is wrong: read it again
            entry.host = None
            self._hosted.pop(entry.ref.key, None)

    def wait_for_load(self, timeout: float) -> bool:
        """Block until a background load ends, for at most `timeout` seconds; False at once
        when none is in flight. The engine calls it when every waiting request waits for an
        adapter: spinning empty steps would only take the CPU (and the GIL) from the loads."""
        with self._load_ended:
            if self._loads_in_flight == 0:
                return False
            self._load_ended.wait(timeout)
            return True

    def _read(self, entry: _Entry) -> LoadedAdapter:
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

    def _host_form(self, adapter: LoadedAdapter) -> LoadedAdapter:
        if self._shard is not None and adapter.is_dora:
            raise AdapterRejected(
                ReasonCode.DORA_NOT_SUPPORTED,
                "DoRA adapters are not served with tensor parallelism (tensor_parallel_size > "
                "1): DoRA's norm ||W + s B A|| runs over a whole row of the base weight, which "
                "is split over the ranks; serve it on a replica without tensor parallelism",
            )
        return self.pool.host_form(adapter if self._shard is None else self._shard(adapter))

    @contextlib.contextmanager
    def local_copy(self, key: str) -> Iterator[tuple[Path, str]]:
        """The folder (or archive) of adapter `key`'s files on this machine and its digest,
        the files kept there while the block runs (a stored version's disk-tier copy, fetched
        again if it was evicted): what tensor-parallel workers read their part from."""
        entry = self._entries[key]
        digest = entry.ref.digest
        if entry.local_path is not None:
            yield entry.local_path, digest
            return
        if self.disk is None or entry.store_path is None:  # pragma: no cover - register_stored
            raise StoreError(f"adapter {key} has no source")
        with self.disk.reading(entry.store_path, digest) as folder:
            yield folder, digest

    def slot_keys(self) -> dict[int, str]:
        """Slot -> the key of the adapter in it, for every occupied slot."""
        with self._lock:
            return dict(self._slots)

    def _to_host(self, entry: _Entry, adapter: LoadedAdapter) -> None:
        entry.host, entry.state, entry.error = adapter, State.HOST, None
        entry.device_bytes = self.pool.bytes_needed(adapter)
        entry.touched = time.monotonic()
        self._hosted[entry.ref.key] = entry
        self._clock += 1
        entry.last_used = self._clock
        self.host_stats.loads += 1
        # No eviction here: this may run on a loader thread while the engine thread is between
        # `ready` and `make_resident`; the engine thread trims the host tier in make_resident.

    def _evict_host(self, in_use: Iterable[str] = ()) -> None:
        excess = len(self._hosted) - self.max_cpu_loras
        if excess <= 0:
            return
        in_use = set(in_use)
        for victim in sorted(self._hosted.values(), key=lambda e: e.last_used):
            if excess <= 0:
                break
            if victim.slot is not None or victim.ref.key in in_use or victim.ref.key in self._pins:
                continue
            victim.host, victim.state = None, State.COLD
            del self._hosted[victim.ref.key]
            self.host_stats.evictions += 1
            excess -= 1

    def forget_idle(self, idle_s: float, keep: Iterable[str] = ()) -> list[LoRARef]:
        """Forget stored versions (catalog mode) that nothing has used for `idle_s` seconds,
        that hold no host copy or slot and that no request in `keep` needs: the registry must
        not grow with every version ever served. The next request registers one again."""
        keep = set(keep)
        horizon = time.monotonic() - idle_s
        with self._lock:
            idle = [
                e
                for e in self._entries.values()
                if e.store_path is not None
                and e.host is None
                and e.slot is None
                and e.state in (State.COLD, State.FAILED)
                and e.touched < horizon
                and e.ref.key not in keep
                and e.ref.key not in self._pins
            ]
            for entry in idle:
                del self._entries[entry.ref.key]
                name = (entry.ref.tenant, entry.ref.name)
                if self._names.get(name) == entry.ref.key:
                    del self._names[name]
            if idle:
                self._queue = [e for e in self._queue if e.ref.key in self._entries]
        return [e.ref for e in idle]

    # -- device tier --------------------------------------------------------------------------

    def slot_of(self, key: str) -> int:
        """The slot holding adapter `key` (made resident for this step)."""
        slot = self._entries[key].slot
        if slot is None:
            raise KeyError(f"adapter {key} is not in a device slot")
        return slot

    def make_resident(
        self, keys: Iterable[str], in_use: Iterable[str], wanted: Iterable[str] = ()
    ) -> None:
        """Put every adapter in `keys` (all in host memory) into a device slot, evicting
        least-recently-used adapters that are neither in `keys` nor `in_use`; those in
        `wanted` (needed by waiting requests) go only after every other idle one."""
        keys = list(keys)
        keep = set(keys) | set(in_use)
        wanted = set(wanted)
        with self._lock:
            self._clock += 1
            now = time.monotonic()
            for key in keys:
                entry = self._entries[key]
                entry.last_used, entry.touched = self._clock, now
                if entry.slot is not None:
                    self.device_stats.hits += 1
                    continue
                if entry.host is None:
                    raise RuntimeError(f"adapter {key} is not in host memory")
                if not self._place(entry, keep, wanted):
                    raise RuntimeError(
                        "the adapters of running requests fill the adapter memory: the"
                        " scheduler admitted more than fits"
                    )
            self._evict_host(keep | wanted)

    def place(self, ref: LoRARef, in_use: Iterable[str], wanted: Iterable[str] = ()) -> bool:
        """Make `ref` (in host memory) resident now if it can be, evicting idle adapters as
        `make_resident` does; False when it cannot (with adapters in KV blocks: no run of
        blocks can be freed while sequences hold them). The scheduler places a request's
        adapter when it admits it, before the step's sequences take their blocks."""
        with self._lock:
            entry = self._entries.get(ref.key)
            if entry is None or entry.host is None:
                return False
            if entry.slot is not None:
                return True
            try:
                return self._place(entry, set(in_use) | {ref.key}, set(wanted))
            except Exception as e:  # this adapter's copy to the device failed: it alone fails
                self._fail_entry(entry, f"{type(e).__name__}: {e}")
                log.warning("placing adapter %s on the device failed: %r", ref.key, e)
                return False

    def _place(self, entry: _Entry, keep: set[str], wanted: set[str]) -> bool:
        """Load `entry` into a slot, evicting idle residents (not in `keep`; those in `wanted`
        last) until it fits: within the budget, and with an arena, into a run of blocks. With
        an arena the run is found first, counting idle adapters' blocks as free: only the
        adapters it overlaps are evicted, and none when no run can be made (the running
        adapters' share of the budget is the scheduler's to keep)."""
        host = entry.host
        if host is None:
            raise RuntimeError(f"adapter {entry.ref.key} is not in host memory")
        start = time.perf_counter()
        victims = self._victims(keep, wanted)  # the first to evict last
        if self.pool.arena is not None and not self._free_a_run(host, victims):
            return False
        budget = None if self.pool.arena is not None else self.device_budget_bytes
        while True:
            slot = self.pool.free_slot()
            fits = budget is None or self.pool.bytes_used + entry.device_bytes <= budget
            if slot is not None and fits:
                if not self._load_slot(slot, host):  # with an arena: no run after all
                    return False
                entry.slot = slot
                self._slots[slot] = entry.ref.key
                self.device_stats.loads += 1
                self.device_stats.load_ended(entry.ref.key, start)
                return True
            if not victims:
                return False
            self._drop_slot(victims.pop())
            self.device_stats.evictions += 1

    def _free_a_run(self, host: LoadedAdapter, victims: list[_Entry]) -> bool:
        """Evict from `victims` (the first to evict last) the idle adapters whose blocks a run
        for `host` needs, removing them from the list; False, evicting none, when no run can
        be freed."""
        arena = self.pool.arena
        if arena is None:  # pragma: no cover - _place checks
            return True
        order = victims[::-1]
        runs = []
        for victim in order:
            placement = None if victim.slot is None else self.pool._placements[victim.slot]
            runs.append((0, 0) if placement is None else (placement.first, placement.num_blocks))
        needed = arena.runs_to_free(arena.blocks_for(host), runs)
        if needed is None:
            return False
        for i in needed:
            self._drop_slot(order[i])
            victims.remove(order[i])
            self.device_stats.evictions += 1
        return True

    def _load_slot(self, slot: int, adapter: LoadedAdapter) -> bool:
        try:
            return self.pool.load(slot, adapter)
        except Exception:
            self.device_stats.failures += 1
            raise

    def _victims(self, keep: set[str], wanted: set[str]) -> list[_Entry]:
        """Idle residents, the first to evict (none waits for it, least recently used) last;
        pinned versions are never among them."""
        idle = [
            self._entries[k] for k in self._slots.values() if k not in keep and k not in self._pins
        ]
        return sorted(idle, key=lambda e: (e.ref.key not in wanted, -e.last_used))

    def reclaim_blocks(self, short: int, in_use: Iterable[str], wanted: Iterable[str]) -> None:
        """Sequences need `short` more KV blocks than are free: evict idle adapters from the
        arena (those no waiting request needs, least recently used, first) until enough are."""
        arena = self.pool.arena
        if arena is None:
            return
        with self._lock:
            target = arena.blocks.num_free_blocks + short
            victims = self._victims(set(in_use), set(wanted))
            while victims and arena.blocks.num_free_blocks < target:
                self._drop_slot(victims.pop())
                self.device_stats.evictions += 1

    def drop_slot(self, key: str) -> None:
        """Free `key`'s device slot (its next use loads it again from the host copy): after a
        step failed for it, a damaged slot must not fail its next requests too."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.slot is not None:
                self._drop_slot(entry)
                self.device_stats.evictions += 1

    def _drop_slot(self, entry: _Entry) -> None:
        if entry.slot is not None:
            self.pool.free(entry.slot)
            del self._slots[entry.slot]
            entry.slot = None

    def close(self) -> None:
        """Stop the background loader threads."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
