"""The planner against the engine: the same closed-loop load on one real replica and in the
simulator, with a cost model calibrated in the same process just before.

Calibrations (`calibrate.calibrate`) and real runs alternate: each run of the load on a fresh
engine (`measure.closed_loop`) is simulated (`fleet.simulate`, one replica, the engine's own
settings) with the mean of the calibrations just before and just after it, so a machine that
slows down or speeds up meanwhile (other processes on a shared host) moves both sides alike;
the rounds' median ratios (tokens/s, and p99 time to first token) are the verdict, so a
disturbed round (a neighbour's burst during one run only, which no calibration saw) does not
decide it.

`python -m loraplane.planner.validate` runs it on this machine in a process of its own (the
way `tests/test_planner.py` does): a process that also holds other engines, servers or their
threads slows the real runs and not the calibrations (measured: 9% fewer tokens/s after the
server tests in one pytest process), which is the engine's neighbours, not the simulator.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane.planner.calibrate import calibrate, mean_cost
from loraplane.planner.cost import LinearCost
from loraplane.planner.fleet import Workload, draw_requests, percentile, simulate
from loraplane.planner.measure import (
    Bench,
    Clock,
    LoadRun,
    build_bench,
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


def main(argv: list[str] | None = None) -> int:
    """Calibrate, run and simulate a Zipf(1.0) closed loop over stored adapters of a small
    model built here; print the verdict. Exit 0 (the figures are for the caller to judge)."""
    parser = argparse.ArgumentParser(
        prog="python -m loraplane.planner.validate",
        description="The planner's simulator against this machine's engine: calibrate the cost "
        "model, run a closed loop on a real CPU replica (cold loads from the disk tier all "
        "along), simulate the same requests, and print simulated over real tokens/s and p99 "
        "time to first token (medians over rounds).",
    )
    parser.add_argument("--adapters", type=int, default=200, help="stored adapters (default 200)")
    parser.add_argument("--requests", type=int, default=600, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=5, help="runs, each between calibrations")
    parser.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default="thread",
        help="thread: the engine thread's CPU time (what wall time would be on a machine of "
        "its own; for shared hosts); wall: wall time",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the step runs on this thread: its CPU time is the step's
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    # ingesting stored adapters fsyncs each file: in RAM where we can (a private mkdtemp there)
    shm = Path("/dev/shm")  # noqa: S108
    where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        print(f"storing {args.adapters} adapters of a small model ...", file=sys.stderr, flush=True)
        bench = build_bench(Path(tmp), args.adapters)
        gc.collect()
        gc.freeze()  # as `loraplane serve` does once started (loraplane.dataplane.heap)
        load = Workload(args.adapters, "zipf:1.0", prompt_tokens=16, output_tokens=8, spread=0.5,
                        concurrency=args.concurrency, requests=args.requests,
                        warmup_requests=min(64, args.requests // 4))  # fmt: skip
        print(f"{args.rounds} rounds ...", file=sys.stderr, flush=True)
        verdict = validate(bench, load, rounds=args.rounds, clock=clock)
    rounds = [
        {"real_tokens_per_s": r.real_tokens_per_s, "sim_tokens_per_s": r.sim_tokens_per_s,
         "ttft_ratio": r.ttft_ratio, "real_loads": r.real_loads, "sim_loads": r.sim_loads}
        for r in verdict.rounds
    ]  # fmt: skip
    out = {
        "tokens_ratio": verdict.tokens_ratio,
        "ttft_ratio": verdict.ttft_ratio,
        "real_ttft_p99_s": verdict.real_ttft_p99_s,
        "sim_ttft_p99_s": verdict.sim_ttft_p99_s,
        "rounds": rounds,
        "seconds": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"tokens/s sim/real {verdict.tokens_ratio:.3f}; p99 TTFT sim/real "
              f"{verdict.ttft_ratio:.3f} (pooled: real {verdict.real_ttft_p99_s:.4f} s, sim "
              f"{verdict.sim_ttft_p99_s:.4f} s)")  # fmt: skip
        for i, r in enumerate(verdict.rounds):
            print(f"  round {i}: real {r.real_tokens_per_s:.0f} tokens/s, sim "
                  f"{r.sim_tokens_per_s:.0f}; p99 TTFT sim/real {r.ttft_ratio:.3f}; cold loads "
                  f"real {r.real_loads}, sim {r.sim_loads}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
