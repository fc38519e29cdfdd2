"""The planner's measurements of the real engine (planner/measure.py, calibrate.py) read it
through its step records (step_observer.py), on a tiny model: each step that ran is one
sample with its batch's shape, each cold load's seconds are counted once, and nothing of the
measurement stays on the engine afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.planner.calibrate import load_adapters
from loraplane.planner.measure import Bench, build_bench, closed_loop, make_engine


@pytest.fixture(scope="module")
def bench(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Bench:
    return build_bench(tmp_path_factory.mktemp("bench"), 6, rank=4, model=tiny_llama_dir)


def test_a_closed_loop_samples_every_step_that_ran_and_times_each_cold_load_once(
    bench: Bench,
) -> None:
    engine, refs = make_engine(bench, max_num_seqs=4, max_cpu_loras=3, num_kv_blocks=128)
    try:
        trace = [(i % 6, 5 + i % 3, 3) for i in range(12)]
        run = closed_loop(engine, refs, trace, 4)
        assert len(run.ttft) == 12 and all(t > 0 for t in run.ttft)
        assert run.loads >= 6 and len(run.load_seconds) == run.loads  # the host tier evicted
        assert all(s > 0 for s in run.load_seconds)
        assert sum(run.cold) >= 6
        assert 0 < len(run.steps) <= engine.stats.steps  # steps waiting on loads ran no rows
        tokens = sum(shape.tokens for shape, _ in run.steps)
        assert tokens == sum(p for _, p, _ in trace) + sum(o - 1 for _, _, o in trace)
        assert all(shape.adapters >= 1 and took > 0 for shape, took in run.steps)
        assert len(engine.observers) == 0  # the run's observer is gone with it
    finally:
        engine.loras.close()


def test_load_adapters_times_each_load_through_the_engine_once(bench: Bench) -> None:
    engine, refs = make_engine(bench)
    try:
        engine.loras.prefetch([refs[0]])  # a load before the measured ones is not theirs
        assert engine.loras.wait_for([refs[0]], 30)
        times = load_adapters(engine, refs[1:4])
        assert len(times) == 3 and all(t > 0 for t in times)
        assert load_adapters(engine, refs[1:4]) == []  # already in host memory: no load
        assert len(engine.observers) == 0
    finally:
        engine.loras.close()


def test_a_closed_loop_counts_deferrals_from_the_records_and_can_time_the_engine_alone(
    bench: Bench,
) -> None:
    """Deferrals are the step records' newly deferred requests, which is the scheduler's own
    count; with `engine_only` the run's clock advances only inside `Engine.step()` (a clock
    that ticks once per reading: the span is exactly one tick per step call)."""
    from loraplane.dataplane.step_observer import StepRecord

    engine, refs = make_engine(bench, max_num_seqs=6, max_loras=2, max_cpu_loras=6,
                               num_kv_blocks=128)  # fmt: skip
    calls: list[StepRecord] = []
    engine.observers.append(lambda r: calls.append(r) if r.batch is not None else None)
    ticks = iter(range(10**9))
    try:
        trace = [(i % 6, 5, 3) for i in range(18)]
        run = closed_loop(engine, refs, trace, 6, clock=lambda: float(next(ticks)),
                          engine_only=True)  # fmt: skip
        assert run.deferred == engine.scheduler.deferred_total > 0  # 6 adapters, 2 slots
        tokens = sum(o for _, _, o in trace)
        assert tokens / run.tokens_per_s == pytest.approx(len(calls))
        assert all(t >= 1 for t in run.ttft)  # at least the step that made the token
    finally:
        engine.loras.close()
