"""Loads from disk into host memory, on background threads off the engine's critical path.

The engine hands `prefetch` the waiting requests' adapters each step, oldest request first
(the waiting queue is the prefetch list), `max_loads_in_flight` at a time, each loader thread
taking the next one as it finishes, so the requests next in line get their adapters first while
the current batch runs. Fair across tenants: the list keeps `prefetch_depth` adapters taken
from the tenants in turn (each tenant's in its own order; one of each, when more tenants wait)
and the loader threads are shared as `tiers/load_order.py` says, so one tenant's slow or dead
objects delay only its own loads. A load that fails (any exception: digest mismatch, store
unreachable after retries, a bad path) marks the version failed for `retry_after_s`: the
engine fails only the requests that need it, and the next request after that window tries
again; a version heavier than the whole host byte limit is not read again while the limit
stays below its weight (`HostTier.too_heavy`).

Under the host byte limit (`max_cpu_lora_bytes`) each tenant's first adapter in the list (its
oldest waiting request's: the one its next admission needs) loads whatever the room, as a
pinned version's does; the others are loaded ahead only into room (`HostTier.room`): what each
is expected to add must fit beside the copies that must stay (in a device slot, in use, pinned,
or wanted by a waiting request) and the loads in flight, else it is skipped until it fits or
comes first (best effort). A copy read ahead is kept only once the copies that may go made room
for it and for the loads still in flight before it in the list (a load whose weight is not known
yet is taken to weigh what this one does); otherwise it is dropped, its weight now known. So
loads ahead never take the tier over its byte limit, in whatever order they end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

from loraplane.adapters.errors import AdapterRejected, StoreError
from loraplane.dataplane.lora.entry import Entry, State
from loraplane.dataplane.lora.host_tier import HostTier
from loraplane.dataplane.lora.loader_pool import loader_pool
from loraplane.dataplane.lora.registry import Registry
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.load_order import in_turn, next_tenant

log = logging.getLogger(__name__)


class Loads:
    """The loader threads, the prefetch list and each version's retry window. Its state is
    guarded by the registry's lock, which the engine thread and the loader threads take;
    `_load_ended` is a condition on that lock."""

    def __init__(
        self,
        registry: Registry,
        host: HostTier,
        prefetch: bool,
        retry_after_s: float,
        max_loads_in_flight: int,
        prefetch_depth: int | None,
    ) -> None:
        self._registry, self._host = registry, host
        self.prefetch_enabled = prefetch
        self.retry_after_s = retry_after_s
        self.max_loads_in_flight = max_loads_in_flight
        # adapters loaded ahead at most: half the host tier, so a prefetched copy is not
        # evicted by later prefetches before its request runs
        self.prefetch_depth = prefetch_depth or max(1, host.max_cpu_loras // 2)
        self._queue: list[Entry] = []  # the latest prefetch list, in load order
        self._loading: set[str] = set()  # ref.keys being loaded
        # the latest prefetch list's versions (the waiting requests'): their copies stay when
        # a load makes room under the byte limit
        self._wanted: frozenset[str] = frozenset()
        self._expected: dict[str, int] = {}  # ref.key -> host bytes its load in flight adds
        self._demanded: set[str] = set()  # loads in flight kept whatever the room
        self._skipped: set[str] = set()  # the list's versions left for want of room, now
        self._load_ended = threading.Condition(registry.lock)  # notified as each load ends
        self._loads_in_flight = 0
        self._tenant_loads: Counter[str] = Counter()  # tenant -> its loads in flight
        self._served: dict[str, int] = {}  # tenant -> when its last load started (a counter)
        self._starts = 0
        self.closed = False
        # room for the threads lent beyond the limit
        self._pool = loader_pool(2 * max_loads_in_flight)

    def ready(self, ref: LoRARef) -> bool:
        """True when `ref` can run in the next step (in host memory). With prefetch off, a
        cold adapter is loaded right now (stalling the step); with prefetch on, loads start
        only in `prefetch`, in the order the engine gives."""
        entry = self._registry.entries.get(ref.key)
        if entry is None:
            return False
        if entry.state is State.HOST:
            return True
        if not self.prefetch_enabled:
            self._load_now(entry)
        return entry.host is not None  # loaded now (prefetch off), or by a racing load

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
        with self._registry.lock:
            by_tenant: dict[str, list[Entry]] = {}
            wanted: set[str] = set()
            for ref in refs:
                wanted.add(ref.key)
                entry = self._registry.entries.get(ref.key)
                if entry is not None:
                    mine = by_tenant.setdefault(ref.tenant, [])
                    if len(mine) < self.prefetch_depth:  # more of one could never be kept
                        mine.append(entry)
            self._wanted = frozenset(wanted)
            queue = in_turn(by_tenant.values())
            # every waiting tenant has a place: another tenant's loads, however slow, never
            # fill the list
            self._queue = queue[: max(self.prefetch_depth, len(by_tenant))]
            # the turns of tenants that neither wait nor load are forgotten: the map stays small
            self._served = {
                t: n for t, n in self._served.items() if t in by_tenant or self._tenant_loads[t]
            }
            while (picked := self._next_load()) is not None:
                self._begin_load(*picked)
                started += 1
        return started

    def _next_load(self) -> tuple[Entry, bool] | None:
        """The adapter of the prefetch list to load now and whether its tenant's next
        admission needs it (its first in the list), or None (under the lock): the first one
        needing a load of the tenant `load_order.next_tenant` picks. Under the byte limit an
        adapter that is not its tenant's first is passed over (`_skipped`) while what it
        would add does not fit in the room the copies that must stay and the loads in flight
        leave."""
        now = time.monotonic()
        room = self._host.room(self._wanted)
        unknown = 0  # loads in flight whose weight was not known when they started
        if room is not None:
            room -= sum(self._expected.values())
            unknown = sum(1 for v in self._expected.values() if not v)
        heads: dict[str, Entry] = {}  # tenant -> its first adapter in the list
        first: dict[str, Entry] = {}  # tenant -> its first adapter to load now
        self._skipped = set()
        for entry in self._queue:
            tenant = entry.ref.tenant
            head = heads.setdefault(tenant, entry) is entry
            if not self._startable(entry, now):
                continue
            # those weighing unknown weigh what this one is expected to: `_keeps`'s estimate
            if (
                not head
                and room is not None
                and self._host.expected_bytes(entry) * (1 + unknown) > room
            ):
                self._skipped.add(entry.ref.key)  # loaded ahead only into room
            elif tenant not in first:
                first[tenant] = entry
        chosen = next_tenant(first, self._tenant_loads, self._served, self.max_loads_in_flight)
        return None if chosen is None else (first[chosen], first[chosen] is heads[chosen])

    def _startable(self, entry: Entry, now: float) -> bool:
        """Whether `entry` needs a load: registered (the prefetch list may hold a version
        forgotten as idle since), cold or failed before the retry window, and not refused for
        its weight (`HostTier.too_heavy`). Under the lock."""
        if entry.ref.key not in self._registry.entries or self._host.too_heavy(entry.ref.key):
            return False
        if entry.state is State.FAILED:
            return now - entry.failed_at >= self.retry_after_s
        return entry.state is State.COLD

    def _begin_load(self, entry: Entry, demanded: bool = True) -> None:
        """Hand `entry` to a loader thread (under the lock); a `demanded` one's copy is kept
        whatever the room (`_keeps`)."""
        entry.state = State.LOADING
        self._loading.add(entry.ref.key)
        self._expected[entry.ref.key] = self._host.expected_bytes(entry)
        if demanded:
            self._demanded.add(entry.ref.key)
        self._loads_in_flight += 1
        self._tenant_loads[entry.ref.tenant] += 1
        self._starts += 1
        self._served[entry.ref.tenant] = self._starts
        entry.future = self._pool.submit(self._load, entry)

    def _due(self, entry: Entry) -> bool:
        """Whether `entry` needs a load now (`_startable`; a failed one is cold again then).
        Under the lock."""
        if not self._startable(entry, time.monotonic()):
            return False
        entry.state = State.COLD
        return True

    def load_if_due(self, entry: Entry) -> None:
        """Start loading `entry` if it is cold (or failed, past the retry window) and the
        loader threads still run (under the lock): how pinned versions load."""
        if self._due(entry) and not self.closed:
            self._begin_load(entry)

    def _load_now(self, entry: Entry) -> None:
        """Load `entry` and wait for it (prefetch off), unless it failed too recently."""
        with self._registry.lock:
            if self._due(entry):
                self._begin_load(entry)
            elif entry.state is State.FAILED:  # too recently: its requests fail meanwhile
                return
            future = entry.future
        if future is not None:
            future.result()

    def pending(self) -> set[str]:
        """Keys of the adapters being loaded now or queued to load (the prefetch list)."""
        with self._registry.lock:
            return self._pending()

    def _pending(self) -> set[str]:
        queued = {e.ref.key for e in self._queue if e.state is State.COLD}
        return self._loading | (queued - self._skipped)  # skipped: none would start now

    def wait_for(self, refs: Iterable[LoRARef], timeout: float) -> bool:
        """Block until none of `refs` is loading or queued to load, for at most `timeout`
        seconds; False if some still were when the time ran out."""
        keys = {r.key for r in refs}
        deadline = time.monotonic() + timeout
        with self._load_ended:
            while True:
                if not keys & self._pending():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._load_ended.wait(left)

    def wait_for_load(self, timeout: float) -> bool:
        """Block until a background load ends, for at most `timeout` seconds; False at once
        when none is in flight. The engine calls it when every waiting request waits for an
        adapter: spinning empty steps would only take the CPU (and the GIL) from the loads."""
        with self._load_ended:
            if self._loads_in_flight == 0:
                return False
            self._load_ended.wait(timeout)
            return True

    def failure(self, entry: Entry) -> str | None:
        """Why `entry` cannot load: too heavy for the byte limit (`HostTier.too_heavy`), or
        its last load failed and the retry window is open; else None."""
        refused = self._host.too_heavy(entry.ref.key)
        if refused is not None:
            return refused
        if entry.state is State.FAILED and time.monotonic() - entry.failed_at < self.retry_after_s:
            return entry.error
        return None

    def _load(self, entry: Entry) -> None:
        """A loader thread's work: load `entry`, then go on down the prefetch list."""
        try:
            self._load_once(entry)
        finally:
            with self._load_ended:
                self._loads_in_flight -= 1
                self._tenant_loads[entry.ref.tenant] -= 1
                if self._tenant_loads[entry.ref.tenant] <= 0:
                    del self._tenant_loads[entry.ref.tenant]
                self._loading.discard(entry.ref.key)
                self._expected.pop(entry.ref.key, None)
                self._demanded.discard(entry.ref.key)
                self._load_ended.notify_all()
                if self.prefetch_enabled and not self.closed:
                    following = self._next_load()  # go on down the prefetch list
                    if following is not None:
                        self._begin_load(*following)

    def _load_once(self, entry: Entry) -> None:
        # read and converted without the lock: the engine's step goes on meanwhile
        start = time.perf_counter()
        try:
            whole = self._registry.read(entry)
            adapter = self._host.host_form(whole)
            peers = self._host.peer_forms(whole)  # tensor parallelism: the workers' parts
        except Exception as e:  # whatever the cause, the version fails, never stays LOADING
            message = (
                str(e)
                if isinstance(e, AdapterRejected | StoreError | OSError)
                else (f"{type(e).__name__}: {e}")
            )
            with self._registry.lock:
                self._host.fail(entry, message)
                self._host.stats.failures += 1
            log.warning("loading adapter %s failed: %s", entry.ref.key, message)
            return
        with self._registry.lock:
            if entry.ref.key not in self._registry.entries:  # unregistered meanwhile
                return
            weight = self._host.weigh(adapter, peers)
            entry.last_host_bytes = weight  # known from now on, kept once the copy goes
            oversize = self._host.too_heavy(entry.ref.key)
            if oversize is not None:  # it would evict every other copy and still not fit
                self._host.fail(entry, oversize)
                self._host.stats.failures += 1
                log.warning("loading adapter %s failed: %s", entry.ref.key, oversize)
            elif self._keeps(entry, weight):
                self._host.add(entry, adapter, peers)
                self._host.stats.load_ended(entry.ref.key, start)
            else:  # read ahead, and no room beside the copies that must stay: read it again
                entry.state = State.COLD  # when it fits or comes first in the list

    def _keeps(self, entry: Entry, weight: int) -> bool:
        """Whether a copy just read (`weight` bytes) is kept (under the lock). With prefetch,
        room is made for it under the byte limit by evicting copies that may go (never one
        the prefetch list wants); one its tenant's next admission needs, a pinned one, or
        one loaded to run at once is kept even where the copies that must stay leave none.
        A copy read ahead also leaves room for the loads still in flight that come before it
        (demanded, or earlier in the prefetch list), each weighing what it is expected to add
        or, where that is not known yet (nothing was hosted when it started), this copy's
        weight: loads end in any order, and one further down the list taking their room would
        leave them dropped, then loaded over the limit once their request comes first."""
        if not self.prefetch_enabled:
            return True
        key, tenant = entry.ref.key, entry.ref.tenant
        head = next((e for e in self._queue if e.ref.tenant == tenant), None)
        if key in self._demanded or key in self._registry.pinned or head is entry:
            self._host.make_room(weight, self._wanted)
            return True
        before = set(self._demanded)
        for queued in self._queue:
            if queued is entry:
                break
            before.add(queued.ref.key)
        owed = sum(self._expected.get(k) or weight for k in (before & self._loading) - {key})
        return self._host.make_room(weight + owed, self._wanted)

    def close(self) -> None:
        """Stop the loader threads."""
        with self._registry.lock:
            self.closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
