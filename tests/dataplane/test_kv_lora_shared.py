"""One device pool for KV blocks and adapters (lora/arena.py), run on CPU.

The oracle is HF + PEFT: with adapters living inside the KV cache, every token equals PEFT's
while the scheduler churns adapters through a budget smaller than the set. Then the sharing
itself: idle adapters give their blocks back to sequences before anyone is preempted, adapters
use blocks that sequences do not, and a reserved block never reaches a sequence.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.block_manager import BlockManager
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.lora.arena import KVArena
from loraplane.dataplane.lora.manager import LoRAManager
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef, Sequence
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import hf_greedy, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def shared_engine(
    family: Family, adapters: int, **overrides: Any
) -> tuple[Engine, dict[str, LoRARef]]:
    """An engine whose adapter memory holds about `adapters` of the family's largest ones."""
    probe = Engine(EngineConfig(model=str(family.model_dir), device="cpu", dtype="float32",
                                block_size=4, num_kv_blocks=64, kv_lora_shared=True))  # fmt: skip
    refs = {n: probe.register_lora(n, p, "t") for n, p in family.adapters.items()}
    largest = max(probe.loras.device_bytes(r) for r in refs.values())
    settings: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                                "num_kv_blocks": 256, "kv_lora_shared": True,
                                "lora_memory": adapters * largest}  # fmt: skip
    settings.update(overrides)
    engine = Engine(EngineConfig(model=str(family.model_dir), **settings))
    return engine, {n: engine.register_lora(n, p, "t") for n, p in family.adapters.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_in_kv_blocks_give_peft_tokens_while_churning_through_a_small_budget(
    families: dict[str, Family], hf_reference: Callable[[str], torch.nn.Module], tp: int
) -> None:
    """tp 2 (tensor parallelism): rank 0's block manager reserves each adapter's run, the
    worker puts its part in the same blocks of its own KV cache (the parts and blocks have the
    same shapes on every rank), frees it when rank 0 does, and gets it again when rank 0
    places it again; the budget holds about one adapter's part per rank."""
    family = families["llama"]
    engine, refs = shared_engine(family, adapters=2 // tp, max_num_batched_tokens=48,
                                 num_kv_blocks=64, tensor_parallel_size=tp)  # fmt: skip
    try:
        assert engine.runner.pool.arena is not None
        names: list[str | None] = [*family.adapters, None, "r64", None, "r4"]
        batch = prompts(len(names), seed=31)
        outs = engine.generate(batch, GREEDY, [refs[n] if n else None for n in names])
        reference = hf_reference("llama")
        for prompt, name, out in zip(batch, names, outs, strict=True):
            assert out.error is None, out.error
            assert out.token_ids == hf_greedy(reference, prompt, name, 16), name
        assert engine.loras.device_stats.evictions > 0  # the budget forced adapters out and back
        assert engine.scheduler.deferred_total > 0
        bm = engine.block_manager
        assert bm.num_free_blocks + bm.num_reserved == bm.num_blocks  # no sequence holds a block
        for name in ("r4", "r64", "r4"):  # again, each after the other took the blocks
            (out,) = engine.generate([batch[0]], GREEDY, [refs[name]])
            assert out.token_ids == hf_greedy(reference, batch[0], name, 16), name
    finally:
        engine.close()


def test_idle_adapters_give_their_blocks_to_sequences_before_anyone_is_preempted(
    families: dict[str, Family],
) -> None:
    family = families["llama"]
    engine, refs = shared_engine(family, adapters=8, num_kv_blocks=16)
    for name in family.adapters:  # every adapter runs once, then sits idle in the arena
        (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), [refs[name]])
        assert out.error is None
    bm = engine.block_manager
    held = bm.num_reserved
    assert held > 16  # adapters use far more blocks than the KV share: memory KV did not use
    # base-model prompts that need more blocks than are free: the idle adapters make room
    need = bm.num_free_blocks + 8
    per = 10  # blocks per request: 36 prompt tokens and 4 generated, block size 4
    count = -(-need // per)
    assert count * per < bm.num_free_blocks + held  # it all fits once adapters step aside
    batch = [[3 + (i * 7 + j) % 300 for j in range(36)] for i in range(count)]
    outs = engine.generate(batch, SamplingParams(max_tokens=4, ignore_eos=True), [None] * count)
    assert all(o.error is None and len(o.token_ids) == 4 for o in outs)
    assert engine.scheduler.preemptions_total == 0
    assert bm.num_reserved < held  # some adapters were evicted from the arena for it
    again = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), [refs["r64"]])
    assert again[0].error is None  # and come back when needed


def test_a_sequence_never_gets_a_block_an_adapter_holds(families: dict[str, Family]) -> None:
    family = families["llama"]
    engine, refs = shared_engine(family, adapters=3, num_kv_blocks=48)
    rng = random.Random(7)
    names = list(family.adapters)
    seen_overlap = []

    original = engine.runner.execute

    def checked(out: Any, in_use: Any, wanted: Any = None) -> torch.Tensor:
        pool = engine.runner.pool
        placements = [pool.placement(slot) for slot in range(pool.num_slots)]
        reserved = {
            b for p in placements if p is not None
            for b in range(p.first, p.first + p.num_blocks)
        }  # fmt: skip
        for row in out.scheduled:
            seen_overlap.extend(set(row.seq.block_table) & reserved)
        return original(out, in_use, wanted)

    engine.runner.execute = checked  # type: ignore[method-assign]
    batch = prompts(24, seed=9, low=8, high=40)
    loras = [refs[rng.choice(names)] if rng.random() < 0.8 else None for _ in batch]
    outs = engine.generate(batch, SamplingParams(max_tokens=10, ignore_eos=True), loras)
    assert all(o.error is None for o in outs)
    assert not seen_overlap


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "reserve", "release"]),
                          st.integers(1, 9)), max_size=60))  # fmt: skip
def test_block_manager_keeps_reserved_runs_and_sequences_apart(ops: list[tuple[str, int]]) -> None:
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    seqs: list[Sequence] = []
    runs: list[tuple[int, int]] = []
    for i, (op, n) in enumerate(ops):
        if op == "alloc":
            seq = Sequence(f"s{i}", [1 + (i % 3)] * (4 * n), SamplingParams(max_tokens=1))
            if bm.can_allocate(seq, len(seq.token_ids)):
                bm.allocate(seq, len(seq.token_ids))
                seq.num_computed_tokens = len(seq.token_ids)
                bm.register_full_blocks(seq)
                seqs.append(seq)
        elif op == "free" and seqs:
            bm.free(seqs.pop(n % len(seqs)))
        elif op == "reserve":
            first = bm.reserve(n)
            if first is not None:
                runs.append((first, n))
        elif op == "release" and runs:
            bm.release(*runs.pop(n % len(runs)))
        reserved = {b for first, k in runs for b in range(first, first + k)}
        held = [b for s in seqs for b in s.block_table]
        assert not reserved & set(held)
        assert bm.num_reserved == len(reserved)
        assert bm.num_free_blocks + bm.num_reserved + len(set(held)) == bm.num_blocks


def test_the_arena_packs_each_layer_into_its_run_and_the_views_hold_the_weights(
    families: dict[str, Family],
) -> None:
    family = families["llama"]
    engine, refs = shared_engine(family, adapters=8)
    arena = engine.runner.pool.arena
    assert isinstance(arena, KVArena)
    for name in family.adapters:
        adapter = engine.loras.host_copy(refs[name])
        n = arena.blocks_for(adapter)
        placement = arena.place(adapter)
        assert placement is not None and placement.num_blocks == n
        for key, w in adapter.modules.items():
            a, b = placement.views[key]
            assert torch.equal(a, w.a) and torch.equal(b, w.b)
        storage = {(t.data_ptr(), t.numel()) for pair in placement.views.values() for t in pair}
        spans = sorted((p, p + k * 4) for p, k in storage)
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))  # no overlap
        arena.free(placement)
    # a tensor-parallel worker's arena (no block manager) lays an adapter out in the run rank
    # 0 reserved, as rank 0 does: the same offsets from the same first block
    adapter = engine.loras.host_copy(refs["r16"])
    placement = arena.place(adapter)
    assert placement is not None
    twin = torch.zeros_like(arena.cache)
    worker = KVArena(twin, None)
    copy = worker.place(adapter, at=placement.first)
    assert copy is not None and copy.first == placement.first
    for key, (a, b) in placement.views.items():
        for mine, theirs in zip((a, b), copy.views[key], strict=True):
            assert theirs.data_ptr() - twin.data_ptr() == mine.data_ptr() - arena.cache.data_ptr()
            assert torch.equal(mine, theirs)
    worker.free(copy)  # rank 0 gives the run back; the worker has nothing to release
    arena.free(placement)
    with pytest.raises(ValueError, match="a worker's arena places at rank 0's run, not at None"):
        worker.place(adapter)
    # fewer blocks would not do: the packing is tight to a block
    adapter = engine.loras.host_copy(refs["r64"])
    n = arena.blocks_for(adapter)
    by_layer = arena._by_layer(adapter)
    assert any(arena._pack(sizes, n - 1) is None for sizes in by_layer.values()) or n == 1


@pytest.mark.parametrize("device", ["cpu"])
def test_the_shared_pool_is_off_on_cpu_and_on_for_cuda_by_default(device: str) -> None:
    assert EngineConfig(model="m", device="cpu").kv_lora_shared is False
    assert EngineConfig(model="m", device="cuda").kv_lora_shared is True
    assert EngineConfig(model="m", device=device, kv_lora_shared=True).kv_lora_shared is True


def arena_manager(model: Path, num_blocks: int) -> tuple[LoRAManager, BlockManager]:
    """A manager whose adapters live in the KV blocks of a CPU cache of `num_blocks` blocks of
    16 tokens (the tiny model's r4 takes 4 of them, r16 takes 16)."""
    spec = BaseModelSpec.from_dir(model)
    blocks = BlockManager(num_blocks, 16)
    cache = torch.zeros(2, spec.num_layers, num_blocks, 16, spec.num_kv_heads, spec.head_dim)
    pool = LoRAPool(8, spec, torch.float32, "cpu")
    pool.attach_arena(KVArena(cache, blocks))
    return LoRAManager(pool, spec, 64, max_cpu_loras=8), blocks


def test_placement_evicts_nothing_when_no_run_can_be_freed(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    m, blocks = arena_manager(tiny_llama_dir, 24)
    a = m.register("a", peft_adapters["r4"], "t")
    b = m.register("b", peft_adapters["r4"], "u")
    big = m.register("big", peft_adapters["r16"], "t")
    assert m.place(a, in_use=[])  # blocks 20-23 (runs are taken from the top)
    assert blocks.reserve(1) == 19  # blocks held by others (sequences), between the adapters
    assert m.place(b, in_use=[])  # 15-18
    assert blocks.reserve(15) == 0  # 0-14: KV fragmented, no 16 blocks free even without a, b
    assert not m.place(big, in_use=[])
    assert {r.name for r in m.resident} == {"a", "b"}  # both still resident: nothing gained
    assert m.device_stats.evictions == 0
    assert not m.place(big, in_use=[])  # the next step's try costs them nothing either
    assert m.device_stats.evictions == 0


def test_placement_evicts_only_the_adapters_its_run_overlaps(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    m, blocks = arena_manager(tiny_llama_dir, 24)
    a = m.register("a", peft_adapters["r4"], "t")
    b = m.register("b", peft_adapters["r4"], "u")
    big = m.register("big", peft_adapters["r16"], "t")
    assert m.place(a, in_use=[])  # 20-23, the least recently used
    assert blocks.reserve(1) == 19
    assert m.place(b, in_use=[])  # 15-18
    free = blocks.reserve(12)  # 3-14 stay free: set aside while 0-2 are taken
    assert blocks.reserve(3) == 0 and free == 3
    blocks.release(free, 12)
    # a is older, but freeing it makes no run of 16 (19 is held): only b's blocks, with 3-14,
    # do. b goes; a stays
    assert m.place(big, in_use=[])
    assert {r.name for r in m.resident} == {"a", "big"}
    assert m.device_stats.evictions == 1


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 5)), min_size=1, max_size=12),
    st.integers(1, 12),
    st.randoms(use_true_random=False),
)
def test_a_run_is_planned_from_the_fewest_idle_adapters_it_overlaps(
    layout: list[tuple[bool, int]], n: int, rng: random.Random
) -> None:
    """Blocks laid out as spans, each held by an idle adapter (True) or by a sequence; the
    plan frees only adapters, a run of n appears exactly when one can, none is freed for
    nothing, and only adapters the run overlaps go."""
    total = sum(k for _, k in layout)
    blocks = BlockManager(total, 1)
    arena = KVArena(torch.zeros(2, 1, total, 1, 1, 1), blocks)
    spans, end = [], total
    for is_adapter, k in layout:  # reserve takes the highest free run: spans fill top down
        assert blocks.reserve(k) == end - k
        spans.append((is_adapter, end - k, k))
        end -= k
    for is_adapter, f, k in spans:
        if not is_adapter and rng.random() < 0.3:  # some of the sequences' spans are free
            blocks.release(f, k)
    runs = [(f, k) for is_adapter, f, k in spans if is_adapter]
    rng.shuffle(runs)  # any eviction order
    held = blocks.held_map()
    plan = arena.runs_to_free(n, runs)
    every = bytearray(held)
    for f, k in runs:
        every[f : f + k] = bytes(k)
    if plan is None:
        assert every.find(bytes(n)) < 0  # no run even with every idle adapter gone
        return
    after = bytearray(held)
    for i in plan:
        f, k = runs[i]
        after[f : f + k] = bytes(k)
    at = after.rfind(bytes(n))
    assert at >= 0  # the plan makes a run
    if held.find(bytes(n)) >= 0:
        assert plan == []
    # each adapter freed is needed: without any one of them the run it made is gone
    for i in plan:
        f, k = runs[i]
        assert f < at + n and at < f + k
