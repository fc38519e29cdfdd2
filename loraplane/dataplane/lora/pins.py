"""Pinned adapter versions (docs/dataplane.md "Pinned adapters"): they never go cold.

Once in host memory a pinned version is never evicted from it, the scheduler places it on the
device each step and counts it in the budget and in its tenant's adapter memory, and no
eviction (budget, host tier, KV reclaim, forgetting idle versions) takes it: the tiers skip
the registry's `pinned` keys. Pins may take at most `fraction` of the adapter memory (and of
the slots): more is refused (`PinRefused`, naming the numbers).
"""

from __future__ import annotations

import logging

from loraplane.dataplane.lora.device_tier import DeviceTier
from loraplane.dataplane.lora.entry import Entry, State
from loraplane.dataplane.lora.errors import PinRefused
from loraplane.dataplane.lora.loads import Loads
from loraplane.dataplane.lora.registry import Registry
from loraplane.dataplane.sequence import LoRARef

log = logging.getLogger(__name__)


PIN_FRACTION = 0.5  # of the adapter memory and of the slots, at most, pinned


class Pins:
    """Which versions may be pinned, and each pin's state. The pinned keys are the
    registry's (`Registry.pinned`); every method takes the registry's lock."""

    def __init__(self, registry: Registry, loads: Loads, device: DeviceTier) -> None:
        self._registry, self._loads, self._device = registry, loads, device
        self.refusals: dict[str, str] = {}  # ref.key -> why its pin was dropped at load
        self.fraction = PIN_FRACTION

    @property
    def cap_bytes(self) -> int | None:
        """Device bytes all pinned versions together may take (None: no byte budget)."""
        budget = self._device.budget_bytes
        return None if budget is None else int(budget * self.fraction)

    @property
    def cap_slots(self) -> int:
        """How many versions may be pinned at once: a fraction of the slots, at least one."""
        return max(1, int(self._device.pool.num_slots * self.fraction))

    def pinned(self) -> list[LoRARef]:
        """The pinned versions, loaded or not."""
        with self._registry.lock:
            return [self._registry.entries[k].ref for k in sorted(self._registry.pinned)]

    def pinned_bytes(self, tenant: str | None = None) -> int:
        """Device bytes of the pinned versions (of `tenant`; 0 for those not loaded yet)."""
        with self._registry.lock:
            entries = [self._registry.entries[k] for k in self._registry.pinned]
        return sum(e.device_bytes for e in entries if tenant is None or e.ref.tenant == tenant)

    def pin(self, ref: LoRARef) -> str:
        """Keep `ref` (registered) resident from now on; its `state`. A version not in host
        memory starts loading now; the scheduler places it on the device once it is.
        KeyError when `ref` is not registered; PinRefused when the pins would take more than
        their cap of the slots or (size known) of the adapter memory. A version whose size is
        learnt at load and does not fit is unpinned then, the reason in `refusals`."""
        with self._registry.lock:
            entry = self._registry.entries.get(ref.key)
            if entry is None:
                raise KeyError(f"adapter {ref.key} is not registered")
            if ref.key not in self._registry.pinned:
                self._check(entry)
                self._registry.pinned[ref.key] = entry.host is not None
                self.refusals.pop(ref.key, None)
                self._loads.load_if_due(entry)
            return self._state(entry)

    def unpin(self, ref: LoRARef) -> bool:
        """Let `ref` be evicted again like any idle version; False when it was not pinned."""
        with self._registry.lock:
            return self._registry.pinned.pop(ref.key, None) is not None

    def state(self, ref: LoRARef) -> str:
        """'resident' (in a device slot), 'host' (placed in the next step), 'loading',
        'failed: <why>' (loaded again after the retry window), 'refused: <why>' or
        'unpinned'."""
        with self._registry.lock:
            refused = self.refusals.get(ref.key)
            if refused is not None:
                return f"refused: {refused}"
            entry = self._registry.entries.get(ref.key)
            if entry is None or ref.key not in self._registry.pinned:
                return "unpinned"
            return self._state(entry)

    def _state(self, entry: Entry) -> str:
        if entry.slot is not None:
            return "resident"
        if entry.state is State.FAILED:
            return f"failed: {entry.error}"
        return "host" if entry.host is not None else "loading"

    def _check(self, entry: Entry) -> None:
        """PinRefused unless `entry` fits beside the other pins (under the lock)."""
        name = entry.ref.name
        entries = self._registry.entries
        others = [entries[k] for k in self._registry.pinned if k != entry.ref.key]
        slots = self.cap_slots
        if len(others) + 1 > slots:
            raise PinRefused(
                f"pinning {name} would pin {len(others) + 1} adapters on this replica, more"
                f" than its cap of {slots} ({self.fraction:.0%} of its"
                f" {self._device.pool.num_slots} adapter slots)"
            )
        cap = self.cap_bytes
        if cap is None or entry.host is None:
            return
        used = sum(e.device_bytes for e in others)
        if used + entry.device_bytes > cap:
            raise PinRefused(
                f"pinning {name} needs {entry.device_bytes} bytes of adapter memory beside the"
                f" {used} bytes pinned already, more than the {cap} bytes pins may take"
                f" ({self.fraction:.0%} of the {self._device.budget_bytes}-byte adapter"
                " memory, --lora-memory)"
            )

    def ready(self) -> list[LoRARef]:
        """The pinned versions in host memory, for the scheduler to keep on the device each
        step; a load starts for each pinned one that is not (a first load, or a retry). One
        whose size, learnt at load, does not fit beside the other pins is unpinned with the
        reason in `refusals`."""
        pinned = self._registry.pinned
        if not pinned:
            return []
        ready: list[LoRARef] = []
        with self._registry.lock:
            for key, checked in sorted(pinned.items()):
                entry = self._registry.entries[key]
                if entry.host is None:
                    self._loads.load_if_due(entry)
                    continue
                if not checked:
                    try:
                        self._check(entry)
                    except PinRefused as e:
                        del pinned[key]
                        self.refusals[key] = str(e)
                        log.warning("pin of %s dropped: %s", key, e)
                        continue
                    pinned[key] = True
                ready.append(entry.ref)
        return ready
