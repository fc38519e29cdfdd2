"""What a load needs: the fewest replicas for a rate, or the highest rate a fleet carries,
under a p99 time-to-first-token target (each point one `fleet.simulate` run).

Both searches assume monotony (more replicas, or less load, never make the p99 worse), so
they double then bisect; every simulated point is kept and returned, for plots.
"""

from __future__ import annotations

import dataclasses

from loraplane.planner.cost import CostModel
from loraplane.planner.fleet import FleetResult, Workload, simulate
from loraplane.planner.replica import ReplicaSettings


def meets(result: FleetResult, ttft_p99_s: float) -> bool:
    """The fleet kept up with the load and held the p99 time-to-first-token target."""
    return result.stable and result.ttft_p99_s <= ttft_p99_s


def replicas_needed(
    settings: ReplicaSettings,
    cost: CostModel,
    policy: str,
    load: Workload,
    ttft_p99_s: float,
    max_replicas: int = 256,
    *,
    stop_early: bool = False,
    known: dict[int, FleetResult] | None = None,
) -> tuple[int | None, dict[int, FleetResult]]:
    """The fewest replicas that meet `ttft_p99_s` at `load` (None past `max_replicas`), and
    every fleet size simulated on the way. `stop_early`: a fleet size whose p99 is certain
    to miss the target ends its run there (`simulate`'s `stop_past_ttft_p99_s`: the same
    answer; its result is `cut_short`, without figures). `known`: results of this policy
    and load simulated before, by fleet size (used instead of running them again)."""
    results: dict[int, FleetResult] = dict(known or {})
    stop = ttft_p99_s if stop_early else None

    def ok(n: int) -> bool:
        if n not in results:
            results[n] = simulate(settings, cost, policy, n, load, stop_past_ttft_p99_s=stop)
        return meets(results[n], ttft_p99_s)

    high = 1
    while not ok(high):
        if high >= max_replicas:
            return None, results
        high = min(2 * high, max_replicas)
    low = high // 2  # fails (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid
    return high, results


def max_rate(
    settings: ReplicaSettings,
    cost: CostModel,
    policy: str,
    replicas: int,
    load: Workload,
    ttft_p99_s: float,
    start: float,
    tolerance: float = 0.02,
    *,
    stop_early: bool = False,
) -> tuple[float, dict[float, FleetResult]]:
    """The highest request rate (within `tolerance`, relative) at which `replicas` meet
    `ttft_p99_s` (0.0 if not even `start` / 2**10 does), and every rate simulated.
    `stop_early`: as `replicas_needed`'s (the same rate; missed points are `cut_short`)."""
    results: dict[float, FleetResult] = {}
    stop = ttft_p99_s if stop_early else None

    def ok(rate: float) -> bool:
        if rate not in results:
            results[rate] = simulate(
                settings, cost, policy, replicas, dataclasses.replace(load, rate=rate),
                stop_past_ttft_p99_s=stop,
            )  # fmt: skip
        return meets(results[rate], ttft_p99_s)

    low, high = start, start
    if ok(start):
        while ok(high):
            low, high = high, high * 2
    else:
        for _ in range(10):
            low /= 2
            if ok(low):
                break
        else:
            return 0.0, results
    while high - low > tolerance * low:
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return low, results
