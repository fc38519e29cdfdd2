"""Replica policy from slot pressure: pure, with time as an explicit input.

The pool needs `ceil(deferred / deferredPerReplica)` replicas for its deferred requests and
`ceil(waitingAdapters / waitingAdaptersPerReplica)` for its waiting adapters; the larger,
within [min, max], is the *need*.

- Up: the need stays above the current count for the whole scale-up window; then scale to
  the need.
- Down: the need stays below the current count for the whole scale-down window, and that
  long has passed since the last scale; then scale to the highest need seen in the window
  (as an HPA's stabilization window does), never below min.
- No fresh pressure (no replica reported lately): hold, and restart both windows.
- Pins: the floor is at least the most replicas one of the pool's pinned versions asks for
  (`with_pins`, within max), so a scale-down never drops a pin's copies.

Each scale restarts both windows, so a pool cannot flap faster than its windows allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    """A pool's bounds, per-replica targets and windows (seconds)."""

    min_replicas: int
    max_replicas: int
    deferred_per_replica: float
    waiting_per_replica: float
    scale_up_seconds: float
    scale_down_seconds: float

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} / max {self.max_replicas}")
        if self.deferred_per_replica <= 0 or self.waiting_per_replica <= 0:
            raise ValueError("per-replica targets must be positive")
        if self.scale_up_seconds < 0 or self.scale_down_seconds < 0:
            raise ValueError("windows must not be negative")


@dataclass(frozen=True, slots=True)
class Pressure:
    """A pool's pressure summed over its replicas' fresh reports."""

    deferred: int = 0
    waiting_adapters: int = 0
    running_adapters: int = 0
    slots_used: int = 0
    adapter_memory_used: int = 0  # device bytes of resident adapters
    adapter_memory_total: int = 0  # the replicas' adapter memory budgets
    host_adapter_memory_used: int = 0  # host bytes of the replicas' host tiers (cpu_bytes)
    replicas_reporting: int = 0


@dataclass(frozen=True, slots=True)
class ScaleState:
    """What the policy remembers between ticks."""

    high_since: float | None = None
    low_since: float | None = None
    low_peak: int = 0
    last_scale: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The replicas to run, the state for the next tick, and why."""

    replicas: int
    state: ScaleState
    reason: str  # ScaledUp | ScaledDown | Clamped | Hold

    @property
    def scaled(self) -> bool:
        """Whether the decision changes the replica count."""
        return self.reason != "Hold"


def with_pins(policy: ScalePolicy, pinned_replicas: int) -> ScalePolicy:
    """`policy` with its floor raised to the most replicas one of the pool's pins asks for
    (within max): scaling down below it would leave a pinned version on fewer replicas than
    asked, and the control plane spreads each pin's copies over the replicas there are."""
    floor = min(max(policy.min_replicas, pinned_replicas), policy.max_replicas)
    return replace(policy, min_replicas=floor)


def needed_replicas(policy: ScalePolicy, pressure: Pressure) -> int:
    """The replicas that keep deferred requests and waiting adapters per replica at target."""
    need = max(
        math.ceil(pressure.deferred / policy.deferred_per_replica),
        math.ceil(pressure.waiting_adapters / policy.waiting_per_replica),
        policy.min_replicas,
    )
    return min(need, policy.max_replicas)


def decide(
    policy: ScalePolicy, state: ScaleState, current: int, pressure: Pressure | None, now: float
) -> Decision:
    """One tick of the policy at time `now` (seconds, any monotonic origin)."""
    if current < policy.min_replicas or current > policy.max_replicas:
        target = max(policy.min_replicas, min(policy.max_replicas, current))
        return Decision(target, ScaleState(last_scale=now), "Clamped")
    if pressure is None:
        return Decision(
            current, replace(state, high_since=None, low_since=None, low_peak=0), "Hold"
        )
    need = needed_replicas(policy, pressure)
    if need > current:
        high_since = state.high_since if state.high_since is not None else now
        if now - high_since >= policy.scale_up_seconds:
            return Decision(need, ScaleState(last_scale=now), "ScaledUp")
        return Decision(
            current, replace(state, high_since=high_since, low_since=None, low_peak=0), "Hold"
        )
    if need < current:
        low_since = state.low_since if state.low_since is not None else now
        peak = max(state.low_peak, need)
        settled = state.last_scale is None or now - state.last_scale >= policy.scale_down_seconds
        if now - low_since >= policy.scale_down_seconds and settled:
            return Decision(
                max(peak, policy.min_replicas), ScaleState(last_scale=now), "ScaledDown"
            )
        return Decision(
            current, replace(state, high_since=None, low_since=low_since, low_peak=peak), "Hold"
        )
    return Decision(current, replace(state, high_since=None, low_since=None, low_peak=0), "Hold")


def _epoch(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def aggregate(report: object, now: float, stale_seconds: float) -> Pressure | None:
    """Sum the replicas' reports at most `stale_seconds` old (`now`: epoch seconds).

    `report` is the control plane's pool `pressure`: `{"replicas": {name: {..., "time"}}}`.
    None when no replica reported lately (replicas come and go; stale ones are ignored).
    """
    replicas = report.get("replicas") if isinstance(report, dict) else None
    if not isinstance(replicas, dict):
        return None
    fresh = []
    for entry in replicas.values():
        when = _epoch(entry.get("time")) if isinstance(entry, dict) else None
        if when is not None and now - when <= stale_seconds:
            fresh.append(entry)
    if not fresh:
        return None
    return Pressure(
        deferred=sum(int(r.get("deferred", 0)) for r in fresh),
        waiting_adapters=sum(int(r.get("waiting_adapters", 0)) for r in fresh),
        running_adapters=sum(int(r.get("running_adapters", 0)) for r in fresh),
        slots_used=sum(int(r.get("slots_used", 0)) for r in fresh),
        adapter_memory_used=sum(int(r.get("gpu_bytes", 0)) for r in fresh),
        adapter_memory_total=sum(int(r.get("gpu_bytes_capacity", 0)) for r in fresh),
        host_adapter_memory_used=sum(int(r.get("cpu_bytes", 0)) for r in fresh),
        replicas_reporting=len(fresh),
    )
