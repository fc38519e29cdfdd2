"""Scheduler: chunked prefill, limits, preemption, adapter limit, deferral, starvation, fairness.

The tests play the engine: `step` schedules, checks the batch is well formed, "runs" it through
`postprocess` with a fixed sampled token, and returns what finished.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.dataplane.block_manager import BlockManager
from loraplane.dataplane.config import SchedulerConfig
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.scheduler import Scheduler, SchedulerOutput
from loraplane.dataplane.sequence import (
    FinishReason,
    LoRARef,
    Sequence,
    SequenceStatus,
    blocks_for,
)

EOS = 2
TOKEN = 5  # what the fake model always samples (not EOS)
_ids = itertools.count()


def make(
    num_blocks: int = 256, block_size: int = 4, prefix_caching: bool = True, **config: object
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(**config),  # type: ignore[arg-type]
        BlockManager(num_blocks, block_size, prefix_caching),
        eos_token_id=EOS,
    )


def seq(
    prompt_len: int = 4,
    max_tokens: int = 4,
    lora: LoRARef | None = None,
    tenant: str = "",
    first: int | None = None,
) -> Sequence:
    """A request; prompts differ unless `first` is given (so the prefix cache stays out)."""
    n = next(_ids)
    start = 1000 * (n + 1) if first is None else first
    prompt = [start + i for i in range(prompt_len)]
    return Sequence(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens), lora, tenant)


def adapter(name: str, tenant: str = "t") -> LoRARef:
    return LoRARef(name, tenant, f"digest-{name}")


class Tiers:
    """Adapter tiers as admission sees them: names still loading, bytes per adapter, a budget,
    pinned versions."""

    def __init__(
        self,
        loading: set[str] | None = None,
        sizes: dict[str, int] | None = None,
        budget_bytes: int | None = None,
        pinned: list[LoRARef] | None = None,
    ) -> None:
        self.loading = loading or set()
        self.pinned = pinned or []  # pinned versions: kept resident, counted every step
        self.sizes = sizes or {}
        self.budget_bytes = budget_bytes
        self.placed_with: list[set[str]] = []  # the `wanted` set of each placement

    def ready(self, ref: LoRARef) -> bool:
        return ref.name not in self.loading

    def device_bytes(self, ref: LoRARef) -> int:
        return self.sizes.get(ref.name, 1)

    def place(self, ref: LoRARef, in_use: object, wanted: object) -> bool:
        self.placed_with.append(set(wanted))  # type: ignore[call-overload]
        return True

    def pins(self) -> list[LoRARef]:
        return [r for r in self.pinned if self.ready(r)]


def step(
    sched: Scheduler, token: int = TOKEN, tiers: Tiers | None = None
) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step with invariants that every step must keep."""
    out = sched.schedule(tiers)
    cfg, bm = sched.config, sched.block_manager
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len(out.lora_keys) <= cfg.max_loras
    assert len(sched.running_lora_keys) <= cfg.max_loras
    if tiers is not None and tiers.budget_bytes is not None:
        running = {s.lora for s in sched.running if s.lora is not None}
        assert sum(tiers.device_bytes(r) for r in running) <= tiers.budget_bytes
    assert len({id(r.seq) for r in out.scheduled}) == len(out.scheduled)
    for r in out.scheduled:
        assert r.seq.status is SequenceStatus.RUNNING
        assert r.start == r.seq.num_computed_tokens
        assert r.num_new_tokens >= 1
        assert r.sample == (r.start + r.num_new_tokens == r.seq.num_tokens)
        assert len(r.seq.block_table) >= blocks_for(r.start + r.num_new_tokens, bm.block_size)
    finished = sched.postprocess(out, [token] * len(out.sampled))
    return out, finished


def rows(out: SchedulerOutput) -> dict[str, tuple[int, bool]]:
    return {r.seq.request_id: (r.num_new_tokens, r.sample) for r in out.scheduled}


def run_until_idle(sched: Scheduler, tiers: Tiers | None = None, max_steps: int = 1000) -> int:
    for n in range(1, max_steps + 1):
        step(sched, tiers=tiers)
        if not sched.has_unfinished:
            return n
    raise AssertionError("requests still unfinished")


# -- batching and limits ---------------------------------------------------------------------


def test_a_short_prompt_is_prefilled_in_one_step_then_decodes_one_token_per_step() -> None:
    sched = make()
    s = seq(prompt_len=6, max_tokens=3)
    sched.add(s)
    out, _ = step(sched)
    assert rows(out) == {s.request_id: (6, True)}
    out, _ = step(sched)
    assert rows(out) == {s.request_id: (1, True)}
    out, finished = step(sched)
    assert finished == [s]
    assert s.finish_reason is FinishReason.LENGTH
    assert s.output_token_ids == [TOKEN] * 3
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_its_last_chunk() -> None:
    sched = make(max_num_batched_tokens=32)
    s = seq(prompt_len=100, max_tokens=2)
    sched.add(s)
    chunks = [rows(step(sched)[0])[s.request_id] for _ in range(4)]
    assert chunks == [(32, False), (32, False), (32, False), (4, True)]
    assert s.output_token_ids == [TOKEN]
    assert rows(step(sched)[0])[s.request_id] == (1, True)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    sched = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = seq(prompt_len=6), seq(prompt_len=6)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert rows(out) == {a.request_id: (6, True)}
    out, _ = step(sched)
    assert rows(out) == {a.request_id: (1, True), b.request_id: (6, True)}
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(seq(prompt_len=11))


def test_a_step_mixes_decodes_and_prefill_chunks_without_starving_decodes() -> None:
    sched = make(max_num_batched_tokens=16)
    decoders = [seq(prompt_len=2, max_tokens=50) for _ in range(3)]
    for s in decoders:
        sched.add(s)
    step(sched)
    long = seq(prompt_len=100)
    sched.add(long)
    out, _ = step(sched)
    assert rows(out) == {
        **{s.request_id: (1, True) for s in decoders},
        long.request_id: (13, False),
    }
    # the long prompt is running now, ahead of nothing: decodes still get their token
    out, _ = step(sched)
    assert all(rows(out)[s.request_id] == (1, True) for s in decoders)
    assert rows(out)[long.request_id] == (13, False)


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make(max_num_seqs=3)
    for _ in range(5):
        sched.add(seq())
    out, _ = step(sched)
    assert len(out.scheduled) == 3
    assert (len(sched.running), len(sched.waiting)) == (3, 2)


def test_the_token_budget_caps_a_step() -> None:
    sched = make(max_num_batched_tokens=10)
    for _ in range(4):
        sched.add(seq(prompt_len=4))
    out, _ = step(sched)
    assert [r.num_new_tokens for r in out.scheduled] == [4, 4, 2]
    assert out.num_batched_tokens == 10


def test_kv_blocks_cap_admission_and_the_head_of_the_queue_is_not_overtaken() -> None:
    sched = make(num_blocks=4, block_size=4)
    big, small = seq(prompt_len=12, max_tokens=1), seq(prompt_len=2, max_tokens=1)
    first = seq(prompt_len=4, max_tokens=8)
    for s in (first, big, small):
        sched.add(s)
    out, _ = step(sched)
    # first takes 1 block (+1 soon); big needs 3 of the 3 left; small would fit but must wait
    assert set(rows(out)) == {first.request_id, big.request_id}
    assert small.status is SequenceStatus.WAITING


def test_add_rejects_duplicates_and_prompts_that_can_never_run() -> None:
    sched = make(num_blocks=4, block_size=4, max_model_len=12)
    s = seq()
    sched.add(s)
    with pytest.raises(ValueError, match="already queued"):
        sched.add(s)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq(prompt_len=12))
    with pytest.raises(ValueError, match="KV cache"):
        make(num_blocks=2, block_size=4).add(seq(prompt_len=9))


# -- stopping, aborting ----------------------------------------------------------------------


def test_eos_finishes_with_stop_and_frees_blocks_unless_ignore_eos() -> None:
    sched = make()
    s = seq(max_tokens=10)
    keep = Sequence("keep", [1, 2], SamplingParams(max_tokens=10, ignore_eos=True))
    sched.add(s)
    sched.add(keep)
    _, finished = step(sched, token=EOS)
    assert finished == [s]
    assert s.finish_reason is FinishReason.STOP and s.status is SequenceStatus.FINISHED_STOPPED
    assert s.block_table == []
    assert keep.status is SequenceStatus.RUNNING


def test_stop_token_ids_finish_with_stop() -> None:
    sched = make()
    s = Sequence("s", [1, 2], SamplingParams(stop_token_ids=[7]))
    sched.add(s)
    _, finished = step(sched, token=7)
    assert finished == [s] and s.finish_reason is FinishReason.STOP


def test_max_model_len_cuts_with_length() -> None:
    sched = make(max_model_len=6)
    s = seq(prompt_len=4, max_tokens=100)
    sched.add(s)
    run_until_idle(sched)
    assert s.num_tokens == 6 and s.finish_reason is FinishReason.LENGTH


def test_a_sequence_that_outgrows_the_whole_cache_is_cut_with_length() -> None:
    sched = make(num_blocks=2, block_size=4)
    s = seq(prompt_len=4, max_tokens=100)
    sched.add(s)
    run_until_idle(sched)
    assert s.num_tokens == 9 and s.finish_reason is FinishReason.LENGTH


def test_abort_frees_a_running_or_waiting_request_and_ignores_unknown_ids() -> None:
    sched = make(max_num_seqs=1)
    running, waiting = seq(max_tokens=10), seq()
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert sched.abort(running.request_id) is running
    assert sched.abort(waiting.request_id) is waiting
    assert running.status is SequenceStatus.FINISHED_ABORTED
    assert waiting.finish_reason is FinishReason.ABORT
    assert sched.abort("nope") is None
    assert not sched.has_unfinished
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_request_aborted_while_its_step_ran_is_skipped_by_postprocess() -> None:
    sched = make()
    a, b = seq(), seq()
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort(a.request_id)
    assert sched.postprocess(out, [TOKEN, TOKEN]) == []
    assert a.output_token_ids == [] and b.output_token_ids == [TOKEN]


def test_finish_on_a_finished_sequence_only_changes_the_reason() -> None:
    sched = make()
    s = seq(max_tokens=1)
    sched.add(s)
    _, finished = step(sched)
    assert finished == [s]
    assert (s.finish_reason, s.status) == (FinishReason.LENGTH, SequenceStatus.FINISHED_LENGTH)
    sched.finish(s, FinishReason.STOP)  # the engine found a stop string in that last token
    assert (s.finish_reason, s.status) == (FinishReason.STOP, SequenceStatus.FINISHED_STOPPED)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_postprocess_rejects_a_wrong_number_of_sampled_tokens() -> None:
    sched = make()
    sched.add(seq())
    out = sched.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled token ids"):
        sched.postprocess(out, [TOKEN, TOKEN])


def test_logprobs_are_kept_only_for_requests_that_asked() -> None:
    sched = make()
    asks = Sequence("a", [1, 2], SamplingParams(logprobs=True))
    quiet = Sequence("q", [1, 2], SamplingParams())
    sched.add(asks)
    sched.add(quiet)
    out = sched.schedule()
    sched.postprocess(out, [TOKEN, TOKEN], [-0.25, -0.5])
    assert asks.output_logprobs == [-0.25]
    assert quiet.output_logprobs == []


# -- prefix caching and preemption -------------------------------------------------------------


def test_a_repeated_prompt_reuses_cached_blocks_and_computes_only_the_rest() -> None:
    sched = make(block_size=4)
    first = seq(prompt_len=10, max_tokens=1, first=7)
    sched.add(first)
    run_until_idle(sched)
    again = seq(prompt_len=10, max_tokens=1, first=7)
    sched.add(again)
    out, _ = step(sched)
    assert rows(out) == {again.request_id: (2, True)}
    assert again.num_cached_tokens == 8


def test_preemption_frees_the_newest_sequence_and_requeues_it_at_the_front() -> None:
    sched = make(num_blocks=4, block_size=4, max_num_seqs=2)
    old, new, later = seq(prompt_len=4, max_tokens=6), seq(prompt_len=4, max_tokens=6), seq()
    for s in (old, new, later):
        sched.add(s)
    step(sched)  # old and new prefilled: 1 block each
    step(sched)  # each decodes into a second block: all 4 blocks used
    for _ in range(3):
        step(sched)
    out, _ = step(sched)  # both need a third block: the newest is preempted
    assert out.preempted == [new.request_id]
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert list(sched.waiting)[:2] == [new, later]
    assert sched.preemptions_total == 1
    assert rows(out) == {old.request_id: (1, True)}


def test_a_preempted_sequence_later_recomputes_all_its_tokens_and_continues() -> None:
    sched = make(num_blocks=4, block_size=4, max_num_seqs=2, prefix_caching=False)
    old, new = seq(prompt_len=4, max_tokens=6), seq(prompt_len=4, max_tokens=7)
    sched.add(old)
    sched.add(new)
    outputs_before = None
    while new.num_preemptions == 0:
        outputs_before = new.num_output_tokens
        step(sched)
    assert outputs_before is not None and new.num_output_tokens == outputs_before
    while new.status is SequenceStatus.WAITING:
        out, _ = step(sched)
    recompute = rows(out)[new.request_id]
    assert recompute == (4 + outputs_before, True)  # prompt and outputs, as one prompt
    run_until_idle(sched)
    assert new.output_token_ids == [TOKEN] * 7
    assert old.output_token_ids == [TOKEN] * 6


# -- adapters: the limit, deferral, starvation, fairness ----------------------------------------


def test_no_step_holds_more_than_max_loras_adapters_and_base_requests_are_not_limited() -> None:
    sched = make(max_loras=2)
    reqs = [seq(lora=adapter(n)) for n in "abc"] + [seq() for _ in range(3)]
    for s in reqs:
        sched.add(s)
    out, _ = step(sched)
    assert out.lora_keys == {adapter("a").key, adapter("b").key}
    assert {r.seq.request_id for r in out.scheduled} == {
        s.request_id for s in reqs if s.lora is None or s.lora.name != "c"
    }


def test_a_request_over_the_adapter_limit_is_deferred_and_counted_once() -> None:
    sched = make(max_loras=1)
    a, b = seq(max_tokens=5, lora=adapter("a")), seq(lora=adapter("b"))
    same = seq(lora=adapter("a"))
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert (out.num_deferred, out.num_newly_deferred) == (1, 1)
    assert b.deferred and b.status is SequenceStatus.WAITING
    sched.add(same)  # the running adapter: admitted, never deferred
    out, _ = step(sched)
    assert same.request_id in rows(out)
    assert (out.num_deferred, out.num_newly_deferred) == (1, 0)
    assert (sched.num_deferred, sched.deferred_total) == (1, 1)
    assert sched.waiting_lora_keys == {adapter("b").key}
    assert sched.running_lora_keys == {adapter("a").key}
    run_until_idle(sched)
    assert b.finish_reason is FinishReason.LENGTH
    assert sched.num_deferred == 0


def test_a_deferred_request_is_passed_by_admissible_ones() -> None:
    sched = make(max_loras=1)
    sched.add(seq(max_tokens=5, lora=adapter("a")))
    step(sched)
    blocked, base = seq(lora=adapter("b")), seq()
    sched.add(blocked)
    sched.add(base)
    out, _ = step(sched)
    assert base.request_id in rows(out) and blocked.request_id not in rows(out)


def test_an_adapter_that_is_not_ready_is_skipped_without_blocking_others() -> None:
    sched = make()
    cold, warm = seq(lora=adapter("cold")), seq(lora=adapter("warm"))
    sched.add(cold)
    sched.add(warm)
    out = sched.schedule(Tiers(loading={"cold"}))
    assert set(rows(out)) == {warm.request_id}
    assert not cold.deferred


def test_a_cold_adapter_is_scheduled_within_the_bound_while_a_hot_one_floods() -> None:
    """max_loras=1; every step 2 new requests of a hot adapter arrive (prompt 4, max_tokens M).

    Bound. The cold request arrives at step s (counted as `arrival_step`). From step s+1 it is
    deferred each step (the hot adapter holds the only slot), so after step s+D+1 its
    deferred_steps is D+1 > D and from step s+D+2 on the barrier admits no hot request. The last
    hot requests were admitted at step s+D+1; a prompt takes one step and yields token 1, so
    they yield token M at step s+D+M and finish there. At step s+D+M+1 no adapter holds the slot
    and the cold request, first in the barrier's order, is admitted: it waits at most D+M+1
    steps.
    """
    D, M = 4, 6
    sched = make(max_loras=1, max_deferral_steps=D, max_num_seqs=64, max_num_batched_tokens=512)
    hot = adapter("hot", tenant="big")
    for _ in range(4):
        for _ in range(2):
            sched.add(seq(max_tokens=M, lora=hot, tenant="big"))
        step(sched)
    cold = seq(max_tokens=2, lora=adapter("cold", tenant="small"))
    sched.add(cold)
    arrival = cold.arrival_step
    scheduled_at = None
    for _ in range(100):
        for _ in range(2):
            sched.add(seq(max_tokens=M, lora=hot, tenant="big"))
        out, _ = step(sched)
        if cold.request_id in rows(out):
            scheduled_at = out.step
            break
    assert scheduled_at is not None
    assert scheduled_at - arrival <= D + M + 1
    # and the flood did not stop: hot requests run again once the cold one has its turn
    run_until_idle(sched)


def test_without_the_barrier_the_same_flood_starves_the_cold_adapter() -> None:
    """The same flood with a barrier that never rises: the cold request never runs."""
    sched = make(max_loras=1, max_deferral_steps=10_000, max_num_seqs=64)
    hot = adapter("hot")
    cold = seq(lora=adapter("cold"))
    sched.add(seq(max_tokens=6, lora=hot))
    step(sched)
    sched.add(cold)
    for _ in range(100):
        for _ in range(2):
            sched.add(seq(max_tokens=6, lora=hot))
        step(sched)
    assert cold.status is SequenceStatus.WAITING and cold.deferred_steps == 100


def test_base_requests_still_run_while_a_barrier_drains_adapters() -> None:
    sched = make(max_loras=1, max_deferral_steps=1)
    hot = adapter("hot")
    sched.add(seq(max_tokens=20, lora=hot))
    step(sched)
    sched.add(seq(lora=adapter("cold")))
    for _ in range(3):
        step(sched)  # the cold request is deferred long enough: the barrier is up
    late_hot, base = seq(lora=hot), seq()
    sched.add(late_hot)
    sched.add(base)
    out, _ = step(sched)
    assert base.request_id in rows(out)
    assert late_hot.request_id not in rows(out) and late_hot.deferred


def test_tenants_take_turns_for_free_seats() -> None:
    sched = make(max_num_seqs=4)
    a = [seq(tenant="a", max_tokens=3) for _ in range(8)]
    b = [seq(tenant="b", max_tokens=3) for _ in range(2)]
    for s in a + b:
        sched.add(s)
    out, _ = step(sched)
    # b arrived after all of a's requests, yet gets half the seats: a0, b0, a1, b1
    assert [r.seq for r in out.scheduled] == [a[0], b[0], a[1], b[1]]


def test_a_light_tenant_takes_a_seat_back_from_a_heavy_tenant_at_once() -> None:
    sched = make(max_num_seqs=3)
    heavy = [seq(tenant="heavy", max_tokens=8 + i) for i in range(10)]
    for s in heavy:
        sched.add(s)
    step(sched)  # three heavy requests running, every seat taken
    step(sched)
    light = seq(tenant="light")
    sched.add(light)
    out, _ = step(sched)
    # the heavy tenant gives way: its least advanced sequence (the newest on a tie) goes back
    assert light.request_id in rows(out)
    assert out.preempted == [heavy[2].request_id]
    assert heavy[2].status is SequenceStatus.WAITING and sched.waiting[0] is heavy[2]
    assert sched.shares.get("heavy").preemptions == 1


def test_age_breaks_ties_between_equally_loaded_tenants() -> None:
    sched = make(max_num_seqs=1)
    first, second = seq(tenant="x"), seq(tenant="y")
    sched.add(first)
    sched.add(second)
    out, _ = step(sched)
    assert [r.seq for r in out.scheduled] == [first]


def test_metrics_views() -> None:
    sched = make(num_blocks=10, block_size=4, max_loras=1)
    sched.add(seq(prompt_len=8, lora=adapter("a")))
    sched.add(seq(lora=adapter("b")))
    sched.add(seq(lora=adapter("b")))
    step(sched)
    assert (len(sched.running), len(sched.waiting)) == (1, 2)
    assert sched.running_lora_keys == {adapter("a").key}
    assert sched.waiting_lora_keys == {adapter("b").key}
    assert sched.waiting_per_lora() == {adapter("b"): 2}
    assert sched.block_manager.usage == pytest.approx(0.2)  # 8 computed tokens in 2 of 10 blocks
    assert sched.num_deferred == 2


# -- property: random traffic ----------------------------------------------------------------

arrival = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(0, 3),  # tenant
    st.one_of(st.none(), st.integers(0, 4)),  # adapter (None: base model)
    st.integers(1, 20),  # prompt length
    st.integers(1, 8),  # max_tokens
)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=25),
    max_loras=st.integers(1, 3),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(4, 40),
    num_blocks=st.integers(8, 40),
    prefix_caching=st.booleans(),
)
def test_random_traffic_keeps_every_limit_and_finishes_every_request(
    arrivals: list[tuple[int, int, int | None, int, int]],
    max_loras: int,
    max_num_seqs: int,
    budget: int,
    num_blocks: int,
    prefix_caching: bool,
) -> None:
    sched = make(
        num_blocks=num_blocks,
        block_size=4,
        prefix_caching=prefix_caching,
        max_loras=max_loras,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_deferral_steps=3,
    )
    by_step: dict[int, list[Sequence]] = {}
    for t, tenant, lora, prompt_len, max_tokens in arrivals:
        ref = None if lora is None else adapter(f"a{lora}", tenant=f"t{tenant}")
        s = seq(prompt_len, max_tokens, ref, tenant=f"t{tenant}", first=lora or 0)
        by_step.setdefault(t, []).append(s)
    everyone = [s for batch in by_step.values() for s in batch]
    for n in range(2000):
        for s in by_step.get(n, []):
            sched.add(s)
        step(sched)
        if n > max(by_step) and not sched.has_unfinished:
            break
    assert all(s.finish_reason is FinishReason.LENGTH for s in everyone)
    assert all(s.output_token_ids == [TOKEN] * s.params.max_tokens for s in everyone)
    assert sched.block_manager.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)


# -- adapter memory --------------------------------------------------------------------------


def test_adapters_are_admitted_while_their_bytes_fit_the_budget_not_up_to_a_count() -> None:
    tiers = Tiers(sizes={"a": 6, "b": 6, "c": 4}, budget_bytes=10)
    sched = make(max_loras=64)
    first = [seq(max_tokens=5, lora=adapter(n)) for n in ("a", "b", "c")]
    for s in first:
        sched.add(s)
    out, _ = step(sched, tiers=tiers)
    # a (6) and c (4) fill the 10 bytes; b (6) would not fit beside a: deferred, passed by c
    assert set(rows(out)) == {first[0].request_id, first[2].request_id}
    assert first[1].deferred and sched.num_deferred == 1
    # many small adapters fit at once where a count of 8 slots would have stopped at 8
    small = Tiers(sizes={f"s{i}": 1 for i in range(20)}, budget_bytes=20)
    sched = make(max_num_seqs=32, max_loras=32)  # the engine's auto count: max_num_seqs
    for i in range(20):
        sched.add(seq(lora=adapter(f"s{i}")))
    out, _ = step(sched, tiers=small)
    assert len(out.lora_keys) == 20 and sched.num_deferred == 0


def test_a_deferred_adapter_gets_the_memory_within_the_bound_while_small_ones_flood() -> None:
    """Budget 10: a big adapter (8) waits while small ones (3 each) keep arriving and running.
    Its deferral raises the barrier; the small ones drain and it runs within D + M + 1 steps."""
    D, M = 4, 5
    tiers = Tiers(sizes={"big": 8} | {f"s{i}": 3 for i in range(3)}, budget_bytes=10)
    sched = make(max_deferral_steps=D, max_num_seqs=64, max_num_batched_tokens=512)
    for i in range(3):
        sched.add(seq(max_tokens=M, lora=adapter(f"s{i}", tenant="flood"), tenant="flood"))
    step(sched, tiers=tiers)
    big = seq(max_tokens=2, lora=adapter("big", tenant="small"), tenant="small")
    sched.add(big)
    arrival, scheduled_at = big.arrival_step, None
    for n in range(100):
        sched.add(seq(max_tokens=M, lora=adapter(f"s{n % 3}", tenant="flood"), tenant="flood"))
        out, _ = step(sched, tiers=tiers)
        if big.request_id in rows(out):
            scheduled_at = out.step
            break
    assert scheduled_at is not None and scheduled_at - arrival <= D + M + 1


def test_an_adapter_still_loading_never_raises_the_barrier_against_other_tenants() -> None:
    """A request whose adapter loads for 50 steps (a slow store) is not deferred and never
    stops the admission of other adapters; once loaded it runs."""
    tiers = Tiers(loading={"slow"}, sizes={"slow": 1, "x": 1, "y": 1}, budget_bytes=1)
    sched = make(max_deferral_steps=2, max_num_seqs=8)
    slow = seq(lora=adapter("slow", tenant="t1"), tenant="t1")
    sched.add(slow)
    for n in range(50):
        other = seq(max_tokens=1, lora=adapter("xy"[n % 2], tenant="t2"), tenant="t2")
        sched.add(other)
        out, _ = step(sched, tiers=tiers)
        assert other.request_id in rows(out)  # never held back by the loading one
        assert not slow.deferred
    tiers.loading.clear()
    run_until_idle(sched, tiers)
    assert slow.finish_reason is FinishReason.LENGTH


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=25),
    sizes=st.lists(st.integers(1, 10), min_size=5, max_size=5),
    budget_bytes=st.integers(10, 30),
    load_steps=st.lists(st.integers(0, 6), min_size=5, max_size=5),
    max_num_seqs=st.integers(1, 8),
)
def test_random_traffic_keeps_the_adapter_memory_budget_and_finishes_every_request(
    arrivals: list[tuple[int, int, int | None, int, int]],
    sizes: list[int],
    budget_bytes: int,
    load_steps: list[int],
    max_num_seqs: int,
) -> None:
    """Adapters of random sizes (each fits alone) that take random steps to load: every step's
    running adapters fit the budget (checked in `step`), and every request finishes."""
    tiers = Tiers(sizes={f"a{i}": s for i, s in enumerate(sizes)}, budget_bytes=budget_bytes)
    sched = make(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                 max_deferral_steps=3)  # fmt: skip
    by_step: dict[int, list[Sequence]] = {}
    for t, tenant, lora, prompt_len, max_tokens in arrivals:
        ref = None if lora is None else adapter(f"a{lora}", tenant=f"t{tenant}")
        s = seq(prompt_len, max_tokens, ref, tenant=f"t{tenant}")
        by_step.setdefault(t, []).append(s)
    everyone = [s for batch in by_step.values() for s in batch]
    for n in range(2000):
        for s in by_step.get(n, []):
            sched.add(s)
        tiers.loading = {f"a{i}" for i, k in enumerate(load_steps) if n < k}
        step(sched, tiers=tiers)
        if n > max(by_step) and not sched.has_unfinished:
            break
    assert all(s.finish_reason is FinishReason.LENGTH for s in everyone)


def test_an_adapter_placed_for_a_request_being_admitted_is_in_use_against_kv_reclaim() -> None:
    """With adapters in KV blocks, admitting a request first places its adapter, then finds
    its KV blocks; if that asks idle adapters for blocks, the one just placed is not idle."""
    sched = make(num_blocks=8, block_size=4, max_loras=8)
    seen: list[set[str]] = []
    sched.block_manager.reserve(6)  # idle adapters' runs: only 2 blocks are free
    sched.block_manager.reclaim = lambda short: seen.append(sched.in_use_lora_keys)
    new = seq(prompt_len=12, lora=adapter("new"))  # needs 3 blocks: reclaim is asked
    sched.add(new)
    sched.schedule(Tiers())
    assert seen and all(adapter("new").key in in_use for in_use in seen)
    assert sched.in_use_lora_keys == sched.running_lora_keys  # outside admission: running only


def test_admission_places_an_adapter_knowing_which_ones_waiting_requests_need() -> None:
    """Placing a new adapter may evict idle ones: those waiting requests need go last, so the
    scheduler hands the manager the waiting requests' adapters."""
    tiers = Tiers()
    sched = make(max_num_seqs=1, max_loras=8)
    first, later = seq(lora=adapter("first")), seq(lora=adapter("later"))
    sched.add(first)
    sched.add(later)
    step(sched, tiers=tiers)
    assert tiers.placed_with and adapter("later").key in tiers.placed_with[0]
