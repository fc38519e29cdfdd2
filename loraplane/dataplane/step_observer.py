"""One hook on the engine's steps: what ran, what it cost, what loaded.

`Engine.step()` hands each of `engine.observers` one `StepRecord` per step (with rows or
not): the scheduler's batch (rows, distinct adapters, preemptions, deferred requests), the wall
time of forming it, computing it and recording it, and the adapter loads that ended since the
last record, per tier:

    def watch(record: StepRecord) -> None:
        print(record.prefill_tokens, record.decode_tokens, record.compute_s, record.loads)

    engine.observers.append(watch)

Loads are reported here by the tiers' `TierStats` (lora/entry.py): a host load ("cpu": disk
or store into host memory) ends on a loader thread, between steps, and reaches the next record;
a device load ("gpu": host memory into the device pool) happens while the scheduler admits, and
reaches that step's record. Loads that end while the engine has no work reach the observers in
a record of no step (`batch` None) when the loop finds it idle (`flush_loads`), so load times
never wait for traffic. The planner's measurements (`planner/measure.py`, `calibrate.py`) and
the server's load-time metrics (`engine_setup.build_engine`) read the engine through this, as
should anything else that observes steps: no wrapping of the scheduler or swapping of callbacks.

An observer runs on the engine's thread, inside the step: it must be quick, and one that raises
is logged and the step goes on. A step that raises (past the engine's own isolation) is not
recorded. Fault injection in tests still wraps what it breaks: that is not observation.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from loraplane.dataplane.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)

Tier = Literal["cpu", "gpu"]  # as loraplane_adapter_load_seconds labels them


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    """One adapter version's load into a tier: "cpu" (into host memory, on a loader thread)
    or "gpu" (into the device pool), and its wall time."""

    tier: Tier
    key: str  # LoRARef.key
    seconds: float


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as its observers see it.

    `batch` is what the scheduler formed (no rows when nothing could run); None for a record
    of no step, which only hands over loads that ended while the engine was idle. The times are
    wall seconds (`time.perf_counter`): `schedule_s` forms the batch and places its new
    adapters on the device, `compute_s` runs the model and the sampler (each adapter group again
    after a fault), `record_s` records the tokens and forms the outputs.
    """

    batch: SchedulerOutput | None
    loads: tuple[AdapterLoad, ...] = ()
    schedule_s: float = 0.0
    compute_s: float = 0.0
    record_s: float = 0.0
    failed_requests: int = 0  # requests this step ended with an error

    @property
    def rows(self) -> list[ScheduledSeq]:
        """The batch's rows, in order (none for a record of no step)."""
        return [] if self.batch is None else self.batch.scheduled

    @property
    def decode_tokens(self) -> int:
        """Rows that compute one token past their prompt."""
        return sum(1 for row in self.rows if _is_decode(row))

    @property
    def prefill_tokens(self) -> int:
        """Tokens of every other row: prompt chunks, and prompts recomputed after preemption."""
        return sum(row.num_new_tokens for row in self.rows if not _is_decode(row))

    @property
    def adapters(self) -> frozenset[str]:
        """The distinct adapter versions (`LoRARef.key`) the step ran."""
        return frozenset() if self.batch is None else self.batch.lora_keys

    @property
    def preempted(self) -> list[str]:
        """Request ids sent back to waiting while the batch was formed."""
        return [] if self.batch is None else self.batch.preempted

    @property
    def deferred(self) -> int:
        """Waiting requests the adapter rules held back after this step."""
        return 0 if self.batch is None else self.batch.num_deferred

    @property
    def seconds(self) -> float:
        """The step's wall time: schedule, compute and record."""
        return self.schedule_s + self.compute_s + self.record_s

    def load_seconds(self, tier: Tier) -> list[float]:
        """The seconds of this record's loads into `tier`."""
        return [load.seconds for load in self.loads if load.tier == tier]


def _is_decode(row: ScheduledSeq) -> bool:
    return row.num_new_tokens == 1 and row.start >= row.seq.num_prompt_tokens


class StepObserver(Protocol):
    """Called with each step's record, on the engine's thread."""

    def __call__(self, record: StepRecord) -> None: ...


class StepObservers:
    """The engine's observers, and the adapter loads reported since its last record."""

    def __init__(self) -> None:
        self._observers: list[StepObserver] = []
        self._loads: deque[AdapterLoad] = deque()  # appended by loader threads

    def append(self, observer: StepObserver) -> None:
        """Call `observer` with every record from now on."""
        self._observers.append(observer)

    def remove(self, observer: StepObserver) -> None:
        """Stop calling `observer` (ValueError if it was not added)."""
        self._observers.remove(observer)

    def __len__(self) -> int:
        return len(self._observers)

    def load_ended(self, load: AdapterLoad) -> None:
        """A tier finished a load (any thread): it goes into the next record."""
        self._loads.append(load)

    def record(
        self,
        batch: SchedulerOutput | None,
        schedule_s: float = 0.0,
        compute_s: float = 0.0,
        record_s: float = 0.0,
        failed_requests: int = 0,
    ) -> None:
        """Hand every observer the record of a step (`batch` None: of no step)."""
        loads = self._take_loads()
        if not self._observers:
            return
        record = StepRecord(batch, loads, schedule_s, compute_s, record_s, failed_requests)
        for observer in list(self._observers):
            try:
                observer(record)
            except Exception:  # watching a step must never fail it
                log.exception("a step observer failed (the step goes on)")

    def flush_loads(self) -> None:
        """Hand over the loads that ended since the last record now, in a record of no step
        (the engine's loop calls this when it has no work)."""
        if self._loads:
            self.record(None)

    def _take_loads(self) -> tuple[AdapterLoad, ...]:
        taken = []
        while self._loads:  # popleft is atomic against the loader threads' appends
            taken.append(self._loads.popleft())
        return tuple(taken)
