"""The engine's one step hook (step_observer.py): one record per step with what ran, what it
cost and what loaded; loads that end while the engine is idle still reach the observers; an
observer that raises never fails a step; the server's load-time metrics are fed from it."""

from __future__ import annotations

import time
from pathlib import Path

from loraplane.adapters.store import LocalStore
from loraplane.dataplane.async_engine import AsyncEngine
from loraplane.dataplane.engine_setup import LoadTimes
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.step_observer import StepRecord
from loraplane.dataplane.tiers.disk import DiskTier
from tests.dataplane.test_tiers import engine_for, register, stored

PROMPTS = [[5, 17, 33, 60, 101, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
MAX_TOKENS = 5


def test_each_step_is_recorded_once_with_its_rows_tokens_adapters_and_loads(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Two stored adapters, cold: their host loads and device placements reach the records
    (each once, with its seconds); every step() call gives exactly one record; the records'
    prefill and decode tokens are the prompts and the outputs' tokens after the first."""
    store = LocalStore(tmp_path / "store")
    chosen = {n: peft_adapters[n] for n in ("r4", "r16")}
    engine = engine_for(tiny_llama_dir, DiskTier(store), max_loras=2)
    refs = register(engine, stored(store, tiny_llama_dir, chosen))
    records: list[StepRecord] = []
    engine.observers.append(records.append)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (prompt, ref) in enumerate(zip(PROMPTS, refs.values(), strict=True)):
        engine.add_request(f"r{i}", prompt, params, ref)
    calls = 0
    finished = []
    while engine.has_unfinished:
        calls += 1
        finished += [out.finish_reason for out in engine.step() if out.finished]
        assert len(records) == calls  # one record per step, with rows or without
    assert finished == ["length", "length"]
    ran = [r for r in records if r.rows]
    assert sum(r.prefill_tokens for r in ran) == sum(len(p) for p in PROMPTS)
    assert sum(r.decode_tokens for r in ran) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert all(r.batch is not None for r in records)
    keys = {ref.key for ref in refs.values()}
    assert set().union(*(r.adapters for r in ran)) == keys
    for tier in ("cpu", "gpu"):
        loads = [load for r in records for load in r.loads if load.tier == tier]
        assert sorted(load.key for load in loads) == sorted(keys), tier
        assert all(load.seconds > 0 for load in loads)
    assert engine.loras.host_stats.loads == engine.loras.device_stats.loads == 2  # counters kept
    # a device load is recorded by the step whose scheduling placed it: the step that ran it
    first_run = {key: next(r for r in ran if key in r.adapters) for key in keys}
    for key, record in first_run.items():
        assert key in {load.key for load in record.loads if load.tier == "gpu"}
    for r in records:
        assert r.schedule_s >= 0 and r.compute_s >= 0 and r.record_s >= 0
        assert r.seconds == r.schedule_s + r.compute_s + r.record_s
        assert r.preempted == [] and r.deferred == 0 and r.failed_requests == 0
    assert all(r.compute_s > 0 for r in ran) and not any(r.compute_s for r in records if not r.rows)


def test_an_observer_that_raises_fails_no_step_and_the_others_still_see_it(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    engine = engine_for(tiny_llama_dir, None)
    ref = engine.register_lora("r4", peft_adapters["r4"], "acme")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (alone,) = engine.generate([PROMPTS[0]], params, [ref])

    def broken(record: StepRecord) -> None:
        raise RuntimeError("observer fault (injected)")

    seen: list[StepRecord] = []
    engine.observers.append(broken)
    engine.observers.append(seen.append)
    (watched,) = engine.generate([PROMPTS[0]], params, [ref])
    assert watched.token_ids == alone.token_ids and watched.error is None
    assert sum(r.decode_tokens for r in seen) == MAX_TOKENS - 1
    engine.observers.remove(broken)
    engine.observers.remove(seen.append)
    assert len(engine.observers) == 0


def test_loads_that_end_while_the_engine_is_idle_reach_the_observers_and_the_metrics(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A prefetched load with no request waiting ends between steps: the engine's loop, idle,
    hands it over in a record of no step, and build_engine's LoadTimes observer (the server's
    loraplane_adapter_load_seconds) gets its tier and seconds."""
    store = LocalStore(tmp_path / "store")
    engine = engine_for(tiny_llama_dir, DiskTier(store))
    (ref,) = register(engine, stored(store, tiny_llama_dir, {"r4": peft_adapters["r4"]})).values()
    records: list[StepRecord] = []
    observed: list[tuple[str, float]] = []
    engine.observers.append(records.append)
    engine.observers.append(LoadTimes(lambda tier, s: observed.append((tier, s))))
    front = AsyncEngine(engine)
    try:
        engine.loras.prefetch([ref])
        deadline = time.monotonic() + 30
        while not records:
            assert time.monotonic() < deadline, "the idle loop never handed the load over"
            time.sleep(0.02)
    finally:
        front.shutdown()
    (record,) = records
    assert record.batch is None and record.rows == [] and record.seconds == 0
    assert [(load.tier, load.key) for load in record.loads] == [("cpu", ref.key)]
    assert observed == [("cpu", record.loads[0].seconds)]


def test_preemptions_and_deferred_requests_are_in_the_records_as_the_engine_counts_them(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    """Room for one adapter and a cache too small for every sequence at once: the records'
    preempted ids and newly deferred requests add up to the engine's own counters, and every
    computed token is a prefill or a decode token."""
    engine = engine_for(tiny_llama_dir, None, max_loras=1, num_kv_blocks=12)
    refs = [engine.register_lora(n, peft_adapters[n], "acme") for n in ("r4", "r16")]
    # both in host memory first: r16's requests are deferred only once it is ready (a load
    # still running when r4's requests finish, on a busy machine, would defer none)
    engine.loras.prefetch(refs)
    assert engine.loras.wait_for(refs, 60)
    assert set(refs) <= set(engine.loras.in_host)
    records: list[StepRecord] = []
    engine.observers.append(records.append)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", PROMPTS[i % 2], params, refs[i // 3])
    while engine.has_unfinished:
        engine.step()
    assert engine.stats.preemptions > 0 and engine.scheduler.deferred_total > 0
    assert sum(len(r.preempted) for r in records) == engine.stats.preemptions
    newly = sum(r.batch.num_newly_deferred for r in records if r.batch is not None)
    assert newly == engine.scheduler.deferred_total
    assert max(r.deferred for r in records) > 0
    for r in records:
        assert r.batch is not None
        assert r.prefill_tokens + r.decode_tokens == r.batch.num_batched_tokens
