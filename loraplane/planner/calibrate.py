"""`loraplane plan --calibrate`: measure this engine here and fit the planner's cost model.

Timed `Engine.step()` calls over batches of several sizes, prompt lengths and numbers of
distinct adapters (one closed loop, for steps that mix prompt chunks and decodes, and one on an
engine of 16 adapter slots, where requests wait deferred: the engine goes over that queue
every step) give
(step shape, seconds) samples; `LinearCost`'s coefficients are their non-negative least-squares
fit in relative error. Cold loads are timed through the engine's own loader threads (disk tier
to host memory, digest checked), one at a time.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from loraplane.planner.cost import LinearCost, StepShape
from loraplane.planner.measure import Bench, Clock, closed_loop, make_engine

if TYPE_CHECKING:
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sequence import LoRARef
    from loraplane.dataplane.step_observer import StepRecord

# (requests, distinct adapters, prompt tokens, output tokens), each run as one batch
BATCHES = ((64, 4, 16, 5), (64, 48, 16, 24), (16, 16, 64, 3), (32, 8, 32, 3),
           (8, 1, 16, 6))  # fmt: skip
LOAD_SAMPLES = 8
# (in flight, distinct adapters, requests) on an engine of DEFERRAL_SLOTS slots: most requests
# deferred, to price the engine's work per deferred request
DEFERRAL_LOOP = (64, 48, 128)
DEFERRAL_SLOTS = 16


def load_adapters(engine: Engine, refs: list[LoRARef], timeout: float = 60.0) -> list[float]:
    """Load each of `refs` into host memory through the loader threads, one at a time;
    return each load's seconds as the engine times them (`loraplane_adapter_load_seconds`),
    read from its step records (the loads end outside any step: flushed to the observers)."""
    times: list[float] = []

    def observe(record: StepRecord) -> None:
        times.extend(record.load_seconds("cpu"))

    engine.observers.flush_loads()  # loads that ended before are not these
    engine.observers.append(observe)
    try:
        for ref in refs:
            engine.loras.prefetch([ref])
            engine.loras.wait_for([ref], timeout)
            if not engine.loras.ready(ref):
                raise RuntimeError(f"adapter {ref.key} did not load: {engine.loras.failure(ref)}")
        engine.observers.flush_loads()
    finally:
        engine.observers.remove(observe)
    return times


def clocked_loads(engine: Engine, refs: list[LoRARef], clock: Clock,
                  timeout: float = 60.0) -> list[float]:  # fmt: skip
    """Load each of `refs` into host memory, one at a time, timed by `clock` around the load
    while the engine thread waits: with the process's CPU time, the loader's CPU seconds (the
    engine's own timing, `load_adapters`, is wall time)."""
    times = []
    for ref in refs:
        began = clock()
        engine.loras.prefetch([ref])
        engine.loras.wait_for([ref], timeout)
        times.append(clock() - began)
        if not engine.loras.ready(ref):
            raise RuntimeError(f"adapter {ref.key} did not load: {engine.loras.failure(ref)}")
    return times


def fit(samples: list[tuple[StepShape, float]]) -> tuple[float, ...]:
    """(base, per_token, per_seq, per_context, per_adapter, per_deferred) >= 0 minimising the
    relative squared error of the samples' times (features with a negative fit are dropped)."""
    x = np.array(
        [[1.0, s.tokens, s.seqs, s.context, s.adapters, s.deferred] for s, _ in samples],
        dtype=np.float64,
    )
    y = np.array([t for _, t in samples], dtype=np.float64)
    w = 1.0 / y
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return tuple(float(c) for c in coef)


def measure_steps(
    engine: Engine, refs: list[LoRARef], clock: Clock = time.perf_counter
) -> tuple[list[tuple[StepShape, float]], list[float]]:
    """Timed steps of the calibration batches and closed loop (adapters already loaded), and
    the jitter: each decode step's time over the median of the identical steps beside it."""
    one = engine.loras.device_bytes(refs[0])
    samples: list[tuple[StepShape, float]] = []
    jitter: list[float] = []
    closed_loop(
        engine, refs, [(0, 16, 4)] * 16, 16, clock=clock
    )  # a process's first steps run slow
    for n, distinct, prompt, output in BATCHES:
        trace = [(i % distinct, prompt, output) for i in range(n)]
        steps = closed_loop(engine, refs, trace, n, adapter_bytes=one, clock=clock).steps
        samples += steps
        decodes = [t for s, t in steps if s.tokens == s.seqs == n]
        if len(decodes) >= 3:
            middle = statistics.median(decodes)
            jitter += [t / middle for t in decodes]
    trace = [(i % 48, 8 + i % 17, 4 + i % 9) for i in range(96)]
    samples += closed_loop(engine, refs, trace, 48, adapter_bytes=one, clock=clock).steps
    return samples, jitter


def measure_deferrals(
    bench: Bench, clock: Clock = time.perf_counter, **engine_settings: object
) -> list[tuple[StepShape, float]]:
    """Timed steps where the adapter rules defer requests (the engine's work over a queue of
    deferred requests): `DEFERRAL_LOOP`'s requests over adapters already in host memory on an
    engine with `DEFERRAL_SLOTS` adapter slots."""
    in_flight, distinct, requests = DEFERRAL_LOOP
    settings = {**engine_settings, "max_loras": DEFERRAL_SLOTS, "max_cpu_loras": 2 * distinct}
    engine, refs = make_engine(bench, **settings)
    try:
        load_adapters(engine, refs[:distinct])
        one = engine.loras.device_bytes(refs[0])
        trace = [(i % distinct, 8 + i % 17, 4 + i % 9) for i in range(requests)]
        return closed_loop(engine, refs, trace, in_flight, adapter_bytes=one, clock=clock).steps
    finally:
        engine.loras.close()


def calibrate(bench: Bench, machine: str = "", clock: Clock = time.perf_counter,
              **engine_settings: object) -> LinearCost:  # fmt: skip
    """Measure the engine over `bench` (at least 64 + LOAD_SAMPLES stored adapters) and fit;
    step times read `clock` (see `measure.closed_loop`), loads the engine's own timing (wall)
    or, for another clock, `clock` (`clocked_loads`)."""
    need = max(n for _, n, _, _ in BATCHES) + LOAD_SAMPLES
    if len(bench.versions) < need:
        raise ValueError(f"calibration needs at least {need} stored adapters")
    engine, refs = make_engine(bench, **engine_settings)
    try:
        if clock is time.perf_counter:
            loads = load_adapters(engine, refs[-LOAD_SAMPLES:])
        else:  # timed as the steps are
            loads = clocked_loads(engine, refs[-LOAD_SAMPLES:], clock)
        load_bytes = engine.loras.device_bytes(refs[-1])
        load_adapters(engine, refs[: need - LOAD_SAMPLES])
        samples, jitter = measure_steps(engine, refs, clock)
    finally:
        engine.loras.close()
    samples += measure_deferrals(bench, clock, **engine_settings)
    base, per_token, per_seq, per_context, per_adapter, per_deferred = fit(samples)
    return LinearCost(
        base=base,
        per_token=per_token,
        per_seq=per_seq,
        per_context=per_context,
        per_adapter=per_adapter,
        load_seconds_per_byte=statistics.median(loads) / load_bytes,
        measured_on=machine,
        model=str(bench.model),
        jitter=tuple(jitter),
        per_deferred=per_deferred,
    )


def mean_cost(a: LinearCost, b: LinearCost) -> LinearCost:
    """The mean of two calibrations (its predictions are the mean of theirs), with both
    calibrations' jitter."""
    return LinearCost(
        base=(a.base + b.base) / 2,
        per_token=(a.per_token + b.per_token) / 2,
        per_seq=(a.per_seq + b.per_seq) / 2,
        per_context=(a.per_context + b.per_context) / 2,
        per_adapter=(a.per_adapter + b.per_adapter) / 2,
        load_seconds_per_byte=(a.load_seconds_per_byte + b.load_seconds_per_byte) / 2,
        measured_on=a.measured_on,
        model=a.model,
        jitter=a.jitter + b.jitter,
        per_deferred=(a.per_deferred + b.per_deferred) / 2,
    )
