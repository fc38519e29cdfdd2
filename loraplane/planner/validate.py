"""The planner against the engine: the same closed-loop load on one real replica and in the
simulator, with a cost model calibrated in the same process just before.

Calibrations (`calibrate.calibrate`) and real runs alternate: each run of the load on a fresh
engine (`measure.closed_loop`) is simulated (`fleet.simulate`, one replica, the engine's own
settings) with the mean of the calibrations just before and just after it, so a machine that
slows down or speeds up meanwhile (other processes on a shared host) moves both sides alike;
the rounds' median ratios (tokens/s, and p99 time to first token) are the verdict, so a
disturbed round (a neighbour's burst during one run only, which no calibration saw) does not
decide it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

from loraplane.planner.calibrate import calibrate, mean_cost
from loraplane.planner.cost import LinearCost
from loraplane.planner.fleet import Workload, draw_requests, percentile, simulate
from loraplane.planner.measure import (
    Bench,
    Clock,
    LoadRun,
    closed_loop,
    make_engine,
    replica_settings,
)
from loraplane.planner.replica import ReplicaSettings


@dataclass(frozen=True, slots=True)
class Round:
    """One round: the real run and its simulation (pooled over jitter seeds)."""

    real_tokens_per_s: float
    sim_tokens_per_s: float
    real_ttft_s: tuple[float, ...]  # the counted requests' (after the warm-up)
    sim_ttft_s: tuple[float, ...]
    real_loads: int
    sim_loads: int

    @property
    def tokens_ratio(self) -> float:
        """Simulated over real tokens/s."""
        return self.sim_tokens_per_s / self.real_tokens_per_s

    @property
    def ttft_ratio(self) -> float:
        """Simulated over real p99 time to first token."""
        return percentile(list(self.sim_ttft_s), 0.99) / percentile(list(self.real_ttft_s), 0.99)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Simulated over real: the rounds' median tokens/s and p99 TTFT ratios, and the p99 time
    to first token over all rounds' requests pooled (for the record: one disturbed round
    holds most of a pooled tail, so the ratios are per round)."""

    tokens_ratio: float
    ttft_ratio: float
    real_ttft_p99_s: float
    sim_ttft_p99_s: float
    rounds: tuple[Round, ...]


def real_run(
    bench: Bench, load: Workload, clock: Clock = time.perf_counter, **engine_settings: Any
) -> tuple[LoadRun, ReplicaSettings]:
    """Run `load` (a closed loop) on a fresh engine; its run and simulator settings."""
    if load.concurrency is None:
        raise ValueError("validation runs a closed loop: give the workload a concurrency")
    engine, refs = make_engine(bench, **engine_settings)
    try:
        trace = draw_requests(load, load.requests)
        run = closed_loop(engine, refs, trace, load.concurrency, seed=load.seed, clock=clock)
        settings = replica_settings(engine, engine.loras.device_bytes(refs[trace[0][0]]))
    finally:
        engine.loras.close()
    return run, settings


def compare(run: LoadRun, settings: ReplicaSettings, cost: LinearCost, load: Workload,
            sims: int = 3) -> Round:  # fmt: skip
    """Simulate `load` with `cost` (`sims` jitter seeds, pooled) beside the real run."""
    results = [simulate(settings, cost, "round_robin", 1, load, seed) for seed in range(sims)]
    return Round(
        real_tokens_per_s=run.tokens_per_s,
        sim_tokens_per_s=statistics.mean(r.tokens_per_s for r in results),
        real_ttft_s=tuple(run.ttft[load.warmup_requests :]),
        sim_ttft_s=tuple(t for r in results for t in r.ttft_s),
        real_loads=run.loads,
        sim_loads=round(statistics.mean(r.cold_loads for r in results)),
    )


def validate(bench: Bench, load: Workload, rounds: int = 3, clock: Clock = time.perf_counter,
             **engine_settings: Any) -> Verdict:  # fmt: skip
    """Alternate calibrations and real runs (round i runs `load` with seed `load.seed + i` on
    an engine with `engine_settings`) and set each run beside its simulation; both read
    `clock` (see `measure.closed_loop`)."""
    before = calibrate(bench, clock=clock)
    done = []
    for i in range(rounds):
        round_load = dataclasses.replace(load, seed=load.seed + i)
        run, settings = real_run(bench, round_load, clock, **engine_settings)
        after = calibrate(bench, clock=clock)
        done.append(compare(run, settings, mean_cost(before, after), round_load))
        before = after
    return Verdict(
        tokens_ratio=statistics.median(r.tokens_ratio for r in done),
        ttft_ratio=statistics.median(r.ttft_ratio for r in done),
        real_ttft_p99_s=percentile([t for r in done for t in r.real_ttft_s], 0.99),
        sim_ttft_p99_s=percentile([t for r in done for t in r.sim_ttft_s], 0.99),
        rounds=tuple(done),
    )
