"""The autoscaling policy is pure: a synthetic pressure series gives an exact replica sequence."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from loraplane.operator.autoscaling import (
    Pressure,
    ScalePolicy,
    ScaleState,
    aggregate,
    decide,
    needed_replicas,
    with_pins,
)

POLICY = ScalePolicy(
    min_replicas=1,
    max_replicas=5,
    deferred_per_replica=4,
    waiting_per_replica=2,
    scale_up_seconds=30,
    scale_down_seconds=120,
)


def run(series: list[tuple[float, tuple[int, int] | None]], start: int = 1) -> list[int]:
    """Feed (time, (deferred, waiting adapters) or None) ticks; return replicas per tick."""
    state, current, out = ScaleState(), start, []
    for now, point in series:
        pressure = None if point is None else Pressure(deferred=point[0], waiting_adapters=point[1])
        decision = decide(POLICY, state, current, pressure, now)
        state, current = decision.state, decision.replicas
        out.append(current)
    return out


def test_synthetic_pressure_series_gives_the_exact_replica_sequence() -> None:
    points: dict[int, tuple[int, int] | None] = {
        0: (0, 0),
        15: (10, 0), 30: (10, 0), 45: (10, 0),  # needs 3 for 30 s: up at 45
        60: (30, 0), 75: (2, 0),  # a spike, then calm: the up window restarts
        90: (30, 0), 105: (30, 0), 120: (30, 0),  # needs 8, capped at max 5: up at 120
        135: (0, 4), 150: (0, 4), 165: (0, 4), 180: (0, 4),  # 4 waiting adapters need 2
        195: (0, 6),  # the window's peak need is 3
        210: (0, 4), 225: (0, 4), 240: (0, 4), 255: (0, 4),  # 120 s low: down to the peak, 3
        270: (0, 0), 285: (0, 0),
        300: None,  # no replica reported: hold and restart the windows
        **{t: (0, 0) for t in range(315, 451, 15)},  # low from 315: down to min at 435
    }  # fmt: skip
    series = sorted(points.items())
    expected = {0: 1, 15: 1, 30: 1, 45: 3, 60: 3, 75: 3, 90: 3, 105: 3, 120: 5}
    expected |= {t: 5 for t in range(135, 255, 15)}
    expected |= {t: 3 for t in range(255, 435, 15)}
    expected |= {435: 1, 450: 1}
    assert run([(float(t), p) for t, p in series]) == [expected[t] for t, _ in series]


def test_alternating_pressure_never_flaps() -> None:
    series = [(float(t), (30, 0) if (t // 15) % 2 else (0, 0)) for t in range(0, 1200, 15)]
    assert set(run(series, start=2)) == {2}


def test_scale_down_waits_a_full_window_after_the_last_scale_up() -> None:
    # up at 30 (window 30 s), low from 45: down only once 120 s have passed since the scale
    series = [(0.0, (12, 0)), (30.0, (12, 0))] + [(float(t), (0, 0)) for t in range(45, 181, 15)]
    replicas = run(series)
    assert replicas[:2] == [1, 3]
    assert replicas[-1] == 1
    assert replicas[series.index((150.0, (0, 0)))] == 3  # 105 s after the scale: too early
    assert replicas[series.index((165.0, (0, 0)))] == 1  # low for 120 s since 45: down


def test_replicas_outside_bounds_are_clamped_at_once() -> None:
    decision = decide(POLICY, ScaleState(), 9, Pressure(), 0.0)
    assert (decision.replicas, decision.reason) == (5, "Clamped")


def test_need_counts_deferred_and_waiting_adapters_per_replica() -> None:
    assert needed_replicas(POLICY, Pressure(deferred=9)) == 3
    assert needed_replicas(POLICY, Pressure(waiting_adapters=7)) == 4
    assert needed_replicas(POLICY, Pressure(deferred=1000)) == 5
    assert needed_replicas(POLICY, Pressure()) == 1


def test_aggregate_sums_fresh_replica_reports_and_ignores_stale_ones() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    fresh, stale = now - timedelta(seconds=5), now - timedelta(seconds=300)
    report = {
        "replicas": {
            "a": {
                "deferred": 3,
                "waiting_adapters": 1,
                "slots_used": 2,
                "time": fresh.isoformat(),
                "gpu_bytes": 300,
                "gpu_bytes_capacity": 1000,
            },
            "b": {
                "deferred": 4,
                "running_adapters": 5,
                "time": fresh.isoformat(),
                "gpu_bytes": 700,
                "gpu_bytes_capacity": 1000,
                "cpu_bytes": 5000,
            },
            "gone": {"deferred": 100, "time": stale.isoformat()},
        }
    }
    pressure = aggregate(report, now.timestamp(), stale_seconds=60)
    assert pressure == Pressure(
        deferred=7,
        waiting_adapters=1,
        running_adapters=5,
        slots_used=2,
        adapter_memory_used=1000,
        adapter_memory_total=2000,
        host_adapter_memory_used=5000,  # a replica from before cpu_bytes counts 0
        replicas_reporting=2,
    )
    assert (
        aggregate({"replicas": {"gone": report["replicas"]["gone"]}}, now.timestamp(), 60) is None
    )
    assert aggregate(None, now.timestamp(), 60) is None


def test_a_pool_with_a_pin_on_k_replicas_never_scales_below_k_within_its_max() -> None:
    policy = with_pins(POLICY, 3)
    assert policy.min_replicas == 3 and with_pins(POLICY, 0) == POLICY
    assert with_pins(POLICY, 9).min_replicas == POLICY.max_replicas  # never past max
    idle = Pressure(deferred=0, waiting_adapters=0)
    # no load at all: the pool scales down to the pin's 3, not to min 1
    state, current = ScaleState(), 5
    for now in range(0, 600, 15):
        decision = decide(policy, state, current, idle, float(now))
        state, current = decision.state, decision.replicas
    assert current == 3
    # a pool below the pin's count is brought up to it at once
    assert decide(policy, ScaleState(), 1, idle, 0.0).replicas == 3
    # the control: without the pin the same idle series ends at min
    state, current = ScaleState(), 5
    for now in range(0, 600, 15):
        decision = decide(POLICY, state, current, idle, float(now))
        state, current = decision.state, decision.replicas
    assert current == 1
