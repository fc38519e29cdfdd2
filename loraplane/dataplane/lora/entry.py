"""What the adapter manager's parts share: one version's record (`Entry`, its `State`) and a
tier's counters (`TierStats`).

An `Entry` is created by the registry (registry.py) and changed by the host tier
(host_tier.py: its host copy), the loads (loads.py: its state while loading) and the device
tier (device_tier.py: its slot), always under the registry's lock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.dataplane.lora.weights import LoadedAdapter
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.step_observer import AdapterLoad, Tier


class State(enum.Enum):
    """Where a registered version is on its way into host memory."""

    COLD = "cold"  # registered; bytes on disk or in the store only
    LOADING = "loading"  # being read into host memory in the background
    HOST = "host"  # in host memory (and maybe in a device slot)
    FAILED = "failed"  # the last load failed; `error` says why


@dataclass(slots=True)
class Entry:
    """One registered adapter version and where it is: its source, host copy and slot."""

    ref: LoRARef
    local_path: Path | None = None  # static adapters: a folder or archive on this machine
    store_path: str | None = None  # stored versions: their folder in the object store
    state: State = State.COLD
    host: LoadedAdapter | None = None
    slot: int | None = None
    last_used: int = 0  # the registry's clock when last loaded or made resident (LRU order)
    error: str | None = None
    failed_at: float = 0.0
    device_bytes: int = 0  # bytes it takes in the device pool (known once in host memory)
    # host bytes of its copy and (tensor parallelism, rank 0) the other ranks' parts beside it
    host_bytes: int = 0
    # those bytes as last weighed (kept once the copy goes): what loading it again adds, and
    # why it is refused without a read while they exceed the host byte limit
    last_host_bytes: int | None = None
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
