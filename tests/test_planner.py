"""The capacity planner (`loraplane plan`, loraplane/planner/): its memory math by hand and
against the engine's own, the simulator's determinism and routing policies, the command, and
the simulator against the real engine on one replica (within 15% on tokens/s and p99 TTFT)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.cli import main
from loraplane.dataplane.config import EngineConfig
from loraplane.planner.cost import GPUS, LinearCost, Roofline, StepShape
from loraplane.planner.fleet import Workload, counted_arrivals, draw_requests, simulate
from loraplane.planner.memory import (
    AdapterProfile,
    arena_blocks,
    kv_bytes_per_token,
    plan_memory,
    shared_pool_blocks,
)
from loraplane.planner.replica import Replica, ReplicaSettings, Request, StepDone
from loraplane.planner.routing import BoundedK, LoraAffinity, Snapshot, lora_affinity_score
from loraplane.planner.search import max_rate, meets, replicas_needed
from loraplane.planner.shapes import SHAPES, ModelShape, named_shape

REPO = Path(__file__).resolve().parents[1]

LLAMA_8B_PARAMS = 8_030_261_248
# rank 16 on all seven projections of Llama-3-8B: 32 layers x 16 x (in + out summed over
# q 4096+4096, k and v 4096+1024, o 4096+4096, gate and up 4096+14336, down 14336+4096) x 2 B
ALL_MODULES_R16 = 32 * 16 * (8192 + 2 * 5120 + 8192 + 3 * 18432) * 2


# -- memory ------------------------------------------------------------------------------


def test_named_shapes_have_their_published_parameter_counts() -> None:
    published = {"llama-3-8b": LLAMA_8B_PARAMS, "llama-3-70b": 70_553_706_496,
                 "mistral-7b": 7_248_023_552, "qwen2-7b": 7_615_616_512,
                 "llama-3.2-1b": 1_235_814_400}  # fmt: skip
    for name, params in published.items():
        assert SHAPES[name].num_params() == params, name


def test_llama_3_8b_on_an_h200_splits_memory_as_computed_by_hand() -> None:
    config = EngineConfig(model="llama-3-8b", dtype="bfloat16", device="cuda")
    plan = plan_memory(named_shape("llama-3-8b"), config, 141 * 10**9, AdapterProfile(2000))
    free = 141 * 10**9 - 2 * LLAMA_8B_PARAMS
    budget = int(free * 0.1)
    assert plan.weights_bytes == 2 * LLAMA_8B_PARAMS == 16_060_522_496
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert plan.adapter_bytes == ALL_MODULES_R16 == 83_886_080  # 80 MiB
    # in the KV cache: 1,310,720 elements per layer fill exactly 40 blocks of 16 tokens x 8
    # KV heads x 128 in its K and V halves, so the arena costs nothing extra here
    assert plan.adapter_device_bytes == 40 * 2 * 32 * 16 * 8 * 128 * 2 == ALL_MODULES_R16
    assert plan.lora_budget_bytes == budget == 12_493_947_750
    assert plan.adapters_resident == budget // ALL_MODULES_R16 == 148
    assert plan.kv_blocks == (int(free * 0.85) - budget) // (16 * 131_072)
    assert (plan.lora_slots, plan.max_cpu_loras) == (256, 512)
    assert plan.host_tier_bytes == 512 * ALL_MODULES_R16
    assert plan.disk_tier_bytes == 2000 * ALL_MODULES_R16


def test_q_v_adapter_bytes_and_a_size_budget_are_rank_exact() -> None:
    shape = named_shape("llama-3-8b")
    config = EngineConfig(model="m", dtype="bfloat16", device="cpu", lora_memory=1 << 30)
    plan = plan_memory(shape, config, 64 << 30, AdapterProfile(10, 16, ("q_proj", "v_proj")))
    assert plan.adapter_bytes == 32 * 16 * (4096 + 4096 + 4096 + 1024) * 2 == 13_631_488
    assert plan.adapter_device_bytes == plan.adapter_bytes  # no arena on a CPU by default
    assert plan.lora_budget_bytes == 1 << 30
    assert plan.adapters_resident == (1 << 30) // 13_631_488 == 78
    rank8 = plan_memory(shape, config, 64 << 30, AdapterProfile(10, 8, ("q_proj", "v_proj")))
    assert rank8.adapter_bytes * 2 == plan.adapter_bytes


def test_adapters_at_once_are_capped_by_the_slots() -> None:
    config = EngineConfig(model="m", dtype="bfloat16", device="cuda", max_loras=8)
    plan = plan_memory(named_shape("llama-3-8b"), config, 141 * 10**9, AdapterProfile(100))
    assert plan.adapters_resident == 8 and plan.max_cpu_loras == 8


def test_weights_that_do_not_fit_are_refused() -> None:
    config = EngineConfig(model="m", dtype="bfloat16", device="cuda")
    with pytest.raises(ValueError, match="do not fit"):
        plan_memory(named_shape("llama-3-70b"), config, 80 * 10**9, AdapterProfile(1))


def test_the_planner_packs_adapters_into_the_kv_cache_as_the_arena_does() -> None:
    """arena_blocks against `KVArena.blocks_for` on a real arena of the same block geometry:
    odd shapes (rank 3 over 10 and 6 features, as test_cuda_defaults.py's `_odd_adapter`), a
    mixture of experts with a dense layer, fp32 and bf16. The arena starts each view on 16
    bytes (4 fp32 or 8 bf16 elements); packed back to back, as the planner did, some of these
    take fewer blocks than the arena does."""
    import torch

    from loraplane.dataplane.block_manager import BlockManager
    from loraplane.dataplane.lora.arena import ALIGN_BYTES, KVArena
    from loraplane.dataplane.lora.loader import LoadedAdapter, LoRAWeights

    assert ALIGN_BYTES == 16  # the arena's views start on 16 bytes (arena_layout.py)
    # q, v: 10 -> 6, o: 6 -> 10
    odd = ModelShape(BaseModelSpec("odd", "llama", num_layers=2, hidden_size=10,
                                   intermediate_size=14, num_heads=2, num_kv_heads=2, head_dim=3),
                     vocab_size=32, max_position_embeddings=64)  # fmt: skip
    moe_spec = dataclasses.replace(odd.spec, name="odd-moe", model_type="qwen3_moe", num_layers=3,
                                   num_experts=3, moe_intermediate_size=6,
                                   moe_layers=(1, 2))  # fmt: skip
    moe = dataclasses.replace(odd, spec=moe_spec, experts_per_tok=2)
    profiles = [AdapterProfile(1, 3, ("q_proj", "v_proj", "o_proj")), AdapterProfile(1, 3),
                AdapterProfile(1, 5, ("q_proj",)), AdapterProfile(1, 8)]  # fmt: skip
    unpadded_differs = set()
    for shape in (odd, moe):
        for profile in profiles:
            modules = {
                (layer, f"m{j}"): LoRAWeights(torch.zeros(profile.rank, fan_in),
                                              torch.zeros(fan_out, profile.rank), 1.0)
                for layer in range(shape.num_layers)
                for j, (fan_in, fan_out) in enumerate(shape.adapted_shapes(profile.modules, layer))
            }  # fmt: skip
            adapter = LoadedAdapter("x", modules)
            for block_size in (1, 2, 4, 5, 16):
                for dtype in ("float32", "bfloat16"):
                    cache = torch.zeros(2, shape.num_layers, 4, block_size, shape.num_kv_heads,
                                        shape.head_dim, dtype=getattr(torch, dtype))  # fmt: skip
                    arena = KVArena(cache, BlockManager(4, block_size))
                    case = (shape.name, profile.rank, profile.modules, block_size, dtype)
                    needed = arena.blocks_for(adapter)
                    assert arena_blocks(shape, profile, block_size, dtype) == needed, case
                    arena.align = 1  # the negative control: views back to back, unpadded
                    if arena.blocks_for(adapter) != needed:
                        unpadded_differs.add(dtype)
    assert unpadded_differs == {"float32", "bfloat16"}


@pytest.mark.parametrize("shared", [False, True], ids=["own-buffers", "in-kv-cache"])
def test_memory_plan_matches_the_engine(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], shared: bool
) -> None:
    from loraplane.dataplane.engine import Engine

    shape = ModelShape.from_dir(str(tiny_llama_dir))
    profile = AdapterProfile(10, rank=16)  # the "r16" adapter: all seven modules
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          max_num_seqs=8, num_kv_blocks=64, lora_memory=3_000_000,
                          kv_lora_shared=shared)  # fmt: skip
    plan = plan_memory(shape, config, 8 << 30, profile)
    engine = Engine(config)
    try:
        ref = engine.register_lora("a", peft_adapters["r16"])
        runner = engine.runner
        assert engine.loras.device_bytes(ref) == plan.adapter_device_bytes
        assert engine.loras.host_copy(ref).nbytes == plan.adapter_bytes
        assert runner.lora_budget_bytes == plan.lora_budget_bytes
        assert (engine.config.lora_slots, engine.config.max_cpu_loras) == (
            plan.lora_slots,
            plan.max_cpu_loras,
        )
        assert runner.model.kv_cache_block_bytes(config.block_size) == plan.block_bytes
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        assert weights == plan.weights_bytes
        if shared:
            assert runner.num_blocks == shared_pool_blocks(plan)
            assert plan.adapter_device_bytes == (
                arena_blocks(shape, profile, config.block_size, config.dtype) * plan.block_bytes
            )
    finally:
        engine.loras.close()


def test_the_engine_runs_as_many_adapters_at_once_as_the_plan_says(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sampling import SamplingParams
    from loraplane.demo.build import build_adapter

    shape = ModelShape.from_dir(str(tiny_llama_dir))
    profile = AdapterProfile(6, rank=8, modules=("q_proj", "v_proj"))
    probe = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32")
    one = plan_memory(shape, probe, 8 << 30, profile).adapter_bytes
    config = dataclasses.replace(probe, max_num_seqs=8, num_kv_blocks=64,
                                 lora_memory=3 * one + one // 2)  # fmt: skip
    plan = plan_memory(shape, config, 8 << 30, profile)
    assert plan.adapters_resident == 3
    engine = Engine(config)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        for i in range(6):
            path = build_adapter(tiny_llama_dir, tmp_path / str(i), r=8,
                                 target_modules=["q_proj", "v_proj"], seed=i)  # fmt: skip
            engine.add_request(f"r{i}", [5, 6, 7], params, engine.register_lora(f"a{i}", path))
        engine.step()
        assert len(engine.scheduler.running_lora_keys) == plan.adapters_resident
        assert engine.scheduler.num_deferred == 3
    finally:
        engine.loras.close()


# -- cost models ---------------------------------------------------------------------------


def test_roofline_decode_step_reads_the_weights_at_the_bandwidth() -> None:
    shape, profile = named_shape("llama-3-8b"), AdapterProfile(1)
    cost = Roofline(GPUS["h100"], shape, "bfloat16", profile)
    one = cost.step_seconds(StepShape(1, 1, 0, 0, 0, 0))
    streamed = (LLAMA_8B_PARAMS - 128256 * 4096) * 2 + kv_bytes_per_token(shape, "bfloat16")
    assert one == pytest.approx(streamed / (3.35e12 * 0.8) + 0.002)
    with_adapters = cost.step_seconds(StepShape(1, 1, 0, 0, 10, 10 * ALL_MODULES_R16))
    assert with_adapters - one == pytest.approx(10 * ALL_MODULES_R16 / (3.35e12 * 0.8))
    # a prompt chunk of 4,096 tokens is compute-bound: 2 flops per weight and token (plus the
    # LM head for 8 rows, attention and the one adapter's side path) at half the peak
    prefill = cost.step_seconds(StepShape(4096, 8, 4096, 4096 * 300, 1, 0))
    flops = (2 * shape.linear_params() * 4096 + 2 * 128256 * 4096 * 8
             + 4 * 32 * 4096 * 4096 * 300 + 2 * (ALL_MODULES_R16 // 2) * 4096)  # fmt: skip
    assert prefill == pytest.approx(flops / (989e12 * 0.5) + 0.002)


def test_calibrated_costs_survive_a_round_trip_through_their_file(tmp_path: Path) -> None:
    cost = LinearCost(0.01, 1e-4, 2e-4, 1e-6, 3e-4, 2e-9, "here", "m", (0.9, 1.1))
    cost.save(tmp_path / "c.json")
    assert LinearCost.load(tmp_path / "c.json") == cost
    # a file from before the deferred-request term was measured reads it as 0
    old = {k: v for k, v in cost.describe().items() if k != "per_deferred"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert LinearCost.load(tmp_path / "old.json") == cost
    priced = dataclasses.replace(cost, per_deferred=1e-4)
    shape = StepShape(10, 10, 100, 100, 2, 0, deferred=20)
    assert priced.step_seconds(shape) == pytest.approx(cost.step_seconds(shape) + 20 * 1e-4)
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "linear", "base": "x"}))
    with pytest.raises(ValueError, match="base must be a number"):
        LinearCost.load(tmp_path / "bad.json")


# -- the simulator ---------------------------------------------------------------------------

TINY_COST = LinearCost(base=0.005, per_token=2e-5, per_seq=1e-4, per_context=0.0,
                       per_adapter=1e-3, load_seconds_per_byte=20e-9)  # fmt: skip
# memory for 8 adapters of 1 MB at once, 16 in host memory: a pool under adapter pressure
TINY = ReplicaSettings(max_num_seqs=32, max_num_batched_tokens=1024, lora_slots=32,
                       lora_budget_bytes=8_000_000, adapter_bytes=1_000_000,
                       adapter_device_bytes=1_000_000, max_cpu_loras=16, kv_blocks=512,
                       block_size=16, device_copies=False)  # fmt: skip
TINY_LOAD = Workload(200, "zipf:1.0", 64, 16, rate=150.0, duration_s=20, warmup_s=4,
                     spread=0.5, seed=1)  # fmt: skip


def test_the_simulation_is_deterministic() -> None:
    a = simulate(TINY, TINY_COST, "lora_affinity", 4, TINY_LOAD)
    b = simulate(TINY, TINY_COST, "lora_affinity", 4, TINY_LOAD)
    assert a == b and a.ttft_s == b.ttft_s
    other = simulate(TINY, TINY_COST, "lora_affinity", 4, dataclasses.replace(TINY_LOAD, seed=2))
    assert other.ttft_s != a.ttft_s


def test_the_simulation_is_the_same_in_every_process() -> None:
    """No figure depends on a process's string hashing (set order): the same simulation in
    processes with different PYTHONHASHSEED gives the same result."""
    code = (
        "import dataclasses, sys; sys.path.insert(0, 'tests');"
        "from test_planner import TINY, TINY_COST, TINY_LOAD;"
        "from loraplane.planner.fleet import simulate;"
        "r = simulate(TINY, TINY_COST, 'round_robin', 2,"
        " dataclasses.replace(TINY_LOAD, duration_s=8, warmup_s=2));"
        "print(r.cold_loads, r.ttft_s)"
    )
    outputs = set()
    for seed in ("1", "3"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=REPO, env=env, check=True)  # fmt: skip
        outputs.add(done.stdout)
    assert len(outputs) == 1


def test_adapter_placement_beats_round_robin_on_loads_and_tail_latency() -> None:
    rr = simulate(TINY, TINY_COST, "round_robin", 4, TINY_LOAD)
    affinity = simulate(TINY, TINY_COST, "lora_affinity", 4, TINY_LOAD)
    bounded = simulate(TINY, TINY_COST, "bounded_k", 4, TINY_LOAD)
    assert rr.stable and affinity.stable and bounded.stable
    assert affinity.cold_loads < rr.cold_loads
    assert bounded.cold_loads < 0.75 * rr.cold_loads
    assert bounded.ttft_p99_s < rr.ttft_p99_s


def test_a_closed_loop_sends_every_request_once() -> None:
    load = Workload(50, "uniform", 16, 8, concurrency=8, requests=100, warmup_requests=8)
    result = simulate(TINY, TINY_COST, "round_robin", 1, load)
    assert result.completed == result.requests == 92  # all but the warm-up's 8 counted
    assert len(draw_requests(load, 100)) == 100 and result.tokens_per_s > 0


# each step takes one simulated second: a request's finish time is the step it finished in
STEP_COST = LinearCost(base=1.0, per_token=0.0, per_seq=0.0, per_context=0.0,
                       per_adapter=0.0, load_seconds_per_byte=0.0)  # fmt: skip


def _run_replica(replica: Replica, arrivals: list[Request]) -> int:
    """Step `replica` from time 0 until it is idle, adding each request at its arrival time;
    the steps it ran."""
    pending = sorted(arrivals, key=lambda r: r.arrival)
    now, steps = 0.0, 0
    while True:
        while pending and pending[0].arrival <= now:
            replica.add(pending.pop(0))
        outcome = replica.step(now)
        if isinstance(outcome, StepDone):
            now, steps = outcome.end, steps + 1
        elif outcome is not None:
            now = outcome
        elif pending:
            now = pending[0].arrival
        else:
            return steps


def test_the_simulator_steps_exactly_as_the_engines_scheduler_does() -> None:
    """A tiny workload, KV blocks tight enough to preempt, adapters warm in host memory: the
    simulated replica runs the steps that the engine's `Scheduler` runs on the same requests,
    and each request ends in the same step."""
    from loraplane.dataplane.block_manager import BlockManager
    from loraplane.dataplane.sampling import SamplingParams
    from loraplane.dataplane.scheduler import Scheduler
    from loraplane.dataplane.sequence import Sequence

    config = EngineConfig(model="m", device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                          block_size=8, num_kv_blocks=12, enable_prefix_caching=False)  # fmt: skip
    settings = dataclasses.replace(TINY, max_num_seqs=4, max_num_batched_tokens=64, kv_blocks=12,
                                   block_size=8, lora_slots=config.lora_slots)  # fmt: skip
    work = [(i % 3, 20 + 7 * i, 6 + 3 * (i % 4)) for i in range(10)]  # adapter, prompt, output
    replica = Replica(settings, STEP_COST)
    replica.tiers.warm(replica.ref(a).key for a in range(3))
    requests = [Request(i, a, p, o, 0.0) for i, (a, p, o) in enumerate(work)]
    sim_steps = _run_replica(replica, requests)

    # as the engine builds its scheduler
    direct = Scheduler(config.scheduler_config(), BlockManager(12, 8, enable_prefix_caching=False))
    seqs = []
    for i, (a, p, o) in enumerate(work):
        params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        seqs.append(Sequence(f"r{i}", [0] * p, params, replica.ref(a)))
        direct.add(seqs[-1])
    ended: dict[str, int] = {}
    steps = 0
    while direct.has_unfinished:
        out = direct.schedule()
        steps += 1
        for seq in direct.postprocess(out, [0] * len(out.sampled)):
            ended[seq.request_id] = steps
    assert direct.preemptions_total > 0  # the case the old copy of admission never had
    assert replica.preemptions_total == direct.preemptions_total
    assert sim_steps == steps
    assert {f"r{r.rid}": round(r.finished) for r in requests} == ended
    assert all(s.num_output_tokens == o for s, (_, _, o) in zip(seqs, work, strict=True))


def test_the_schedulers_tenant_turns_show_in_the_simulation() -> None:
    """One tenant's burst fills the seats and the queue; another tenant's request, sent just
    after, takes the next free seat (the scheduler serves tenants in turn), where the same
    request from the busy tenant waits for the whole queue ahead of it."""

    def late_request_ttft(tenant: str) -> float:
        replica = Replica(dataclasses.replace(TINY, max_num_seqs=4), STEP_COST)
        replica.tiers.warm(replica.ref(a, t).key for a, t in ((0, "busy"), (1, tenant)))
        burst = [Request(i, 0, 16, 8, 0.0, tenant="busy") for i in range(24)]
        late = Request(99, 1, 16, 8, 0.5, tenant=tenant)
        _run_replica(replica, [*burst, late])
        assert late.finished > 0
        return late.first_token - late.arrival

    shared, alone = late_request_ttft("busy"), late_request_ttft("quiet")
    assert alone <= 10 < 40 <= shared  # 20 requests ahead of it, 4 seats, 8 steps each


def test_fewer_seats_and_adapter_slots_show_as_the_scheduler_makes_them() -> None:
    """The simulator's admission is the scheduler's: with 2 adapter slots instead of 32 the
    scheduler defers requests (counted, as on the engine) and the time to first token grows;
    with KV blocks for a few requests only, it preempts and throughput falls."""
    load = Workload(40, "uniform", 64, 32, concurrency=24, requests=240, warmup_requests=24)
    roomy = simulate(TINY, TINY_COST, "round_robin", 1, load)
    narrow_settings = dataclasses.replace(TINY, lora_slots=2)
    narrow = simulate(narrow_settings, TINY_COST, "round_robin", 1, load)
    assert narrow.ttft_p50_s > 2 * roomy.ttft_p50_s
    assert narrow.tokens_per_s < roomy.tokens_per_s
    tight = dataclasses.replace(TINY, kv_blocks=40)
    squeezed = simulate(tight, TINY_COST, "round_robin", 1, load)
    assert squeezed.tokens_per_s < 0.9 * roomy.tokens_per_s
    for settings, deferred, preempted in ((TINY, False, False), (narrow_settings, True, False),
                                          (tight, False, True)):  # fmt: skip
        replica = Replica(settings, TINY_COST)
        _run_replica(replica, [Request(i, i % 8, 64, 32, 0.0) for i in range(48)])
        assert (replica.deferred_total > 0, replica.preemptions_total > 0) == (
            deferred,
            preempted,
        )


def test_the_planner_imports_no_torch_and_shares_the_engines_wait_constants() -> None:
    from loraplane.dataplane import engine
    from loraplane.planner import replica

    assert (replica.LOAD_WAIT_S, replica.MAX_LOAD_WAIT_FRACTION) == (
        engine.LOAD_WAIT_S,
        engine.MAX_LOAD_WAIT_FRACTION,
    )
    code = "import sys, loraplane.planner.report; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
    assert done.stdout.strip() == "False"


def test_replicas_needed_is_the_fewest_that_meet_the_target() -> None:
    # 10 simulated seconds: each point runs the engine's scheduler step by step, and the
    # searches simulate overloaded fleets (long queues) on the way
    load = dataclasses.replace(TINY_LOAD, rate=150.0, duration_s=10, warmup_s=2)
    n, results = replicas_needed(TINY, TINY_COST, "round_robin", load, 0.5)
    assert n is not None and n > 1
    assert meets(results[n], 0.5) and not meets(results[n - 1], 0.5)
    rate, points = max_rate(TINY, TINY_COST, "round_robin", n, load, 0.5, start=50.0,
                            tolerance=0.05)  # fmt: skip
    assert rate >= 150.0 * 0.9 and meets(points[rate], 0.5)


def test_a_run_stopped_once_its_p99_must_miss_answers_as_the_full_run_does() -> None:
    # from hopelessly overloaded (1 replica) to comfortable (4): the verdict of each point is
    # the full run's, and only points that miss end early (their queues are the slow part)
    load = dataclasses.replace(TINY_LOAD, rate=150.0, duration_s=10, warmup_s=2)
    cut = 0
    for n in (1, 2, 3, 4):
        full = simulate(TINY, TINY_COST, "round_robin", n, load)
        assert full.requests == counted_arrivals(load) and not full.cut_short
        quick = simulate(TINY, TINY_COST, "round_robin", n, load, stop_past_ttft_p99_s=0.5)
        assert meets(quick, 0.5) == meets(full, 0.5), n
        if quick.cut_short:
            cut += 1
            assert full.ttft_p99_s > 0.5 and quick.ttft_p99_s == float("inf")
        else:  # not cut: the very same run
            assert quick == full and quick.ttft_s == full.ttft_s
    assert cut >= 1  # the control: some point did end early
    needed = replicas_needed(TINY, TINY_COST, "round_robin", load, 0.5)[0]
    assert replicas_needed(TINY, TINY_COST, "round_robin", load, 0.5, stop_early=True)[0] == needed


def test_the_epp_lora_affinity_scorer_values() -> None:
    def snap(active: set[int], waiting: set[int], max_lora: int = 4) -> Snapshot:
        return Snapshot(0, 0, 0.0, frozenset(active), frozenset(waiting), max_lora)

    assert lora_affinity_score(7, snap({7}, set())) == 1.0
    assert lora_affinity_score(7, snap({1, 2}, {3})) == 0.8  # room: 3 < 4
    assert lora_affinity_score(7, snap({1, 2}, {3, 7})) == 0.6  # full, but 7 waits there
    assert lora_affinity_score(7, snap({1, 2}, {3, 4})) == 0.0
    policy = LoraAffinity()
    busy = Snapshot(waiting=3, running=10, kv_usage=0.3, active=frozenset({7}),
                    waiting_adapters=frozenset(), max_lora=256)  # fmt: skip
    idle = Snapshot(0, 0, 0.0, frozenset(), frozenset(), 256)
    # affinity is worth 2 x (1.0 - 0.8) = 0.4 (loraplane's chart weights), a queue against
    # none 2: the idle replica wins; with equal queues and nearly equal KV use the adapter's
    # replica wins over a cooler one
    assert policy.pick(7, 0.0, [busy, idle]) == 1
    even = dataclasses.replace(busy, waiting=0, kv_usage=0.1)
    assert policy.pick(7, 0.0, [even, idle]) == 0
    assert LoraAffinity(lora_weight=0.0).pick(7, 0.0, [even, idle]) == 1
    assert {policy.pick(9, 0.0, [idle, idle]) for _ in range(2)} == {0, 1}  # ties rotate


def test_bounded_k_keeps_an_adapter_on_its_replica_until_it_is_loaded() -> None:
    policy = BoundedK(4, max_num_seqs=8)
    idle = [Snapshot(0, 0, 0.0, frozenset(), frozenset(), 8)] * 4
    home, second = policy.ranked(3)[:2]
    assert {policy.pick(3, 0.0, idle) for _ in range(8)} == {home}  # below 8 in flight there
    assert policy.pick(3, 0.0, idle) == second  # home is at 8: k grows to 2
    assert policy.pick(3, 0.0, idle) == second  # the less loaded of the two
    policy.scraped()  # the requests sent are in the metrics now: all replicas idle again
    assert policy.pick(3, 1.0, idle) == home


# -- the command ---------------------------------------------------------------------------


def test_plan_prints_json_with_the_memory_split_and_replicas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["plan", "--model-shape", "llama-3-8b", "--gpu", "h200", "--adapters", "2000",
                 "--rate", "40", "--ttft-p99", "2.0", "--duration", "8", "--warmup", "2",
                 "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["adapter_bytes"] == ALL_MODULES_R16
    assert out["kv_bytes_per_token"] == 131_072
    assert out["adapters_resident"] == 148
    assert set(out["replicas"]) == {"round_robin", "lora_affinity", "bounded_k"}
    assert all(isinstance(n, int) and n >= 1 for n in out["replicas"].values())
    assert out["cost"]["kind"] == "roofline"
    # a GPU plan says how far to trust it (issue 32): no GPU run has validated the roofline
    assert out["cost"]["confidence"].startswith("unvalidated on GPUs")


def test_plan_reads_a_model_folder_and_prints_the_split(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["plan", "--model", str(tiny_llama_dir), "--adapter-modules", "q_proj,v_proj",
                 "--adapter-rank", "8", "--device-memory", "16GiB"])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    shape = ModelShape.from_dir(str(tiny_llama_dir))
    one = 8 * shape.num_layers * (2 * shape.hidden_size + shape.hidden_size
                                  + shape.num_kv_heads * shape.head_dim) * 2  # fmt: skip
    assert f"{one / 1e6:.1f} MB each" in text
    assert "memory per replica:" in text and "give --rate" in text
    assert "confidence: unvalidated on GPUs" in text  # its cost model is a GPU roofline


def test_plan_refuses_unknown_shapes_and_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model-shape", "gpt-9"]) == 2
    assert "unknown model shape 'gpt-9'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model-shape", "llama-3-8b", "--device-memory", "0.5"])
    assert exit_.value.code == 2


def test_plan_draws_its_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    code = main(["plan", "--model-shape", "mistral-7b", "--gpu", "h100", "--adapters", "200",
                 "--rate", "20", "--duration", "6", "--warmup", "1", "--policies",
                 "round_robin,bounded_k", "--plot", str(png)])  # fmt: skip
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert f"plot: {png}" in text
    assert "\nconfidence: unvalidated on GPUs" in text  # printed with every roofline plan


# -- the simulator against the engine ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.serial
def test_the_simulator_agrees_with_a_real_replica_where_deferral_and_eviction_bind() -> None:
    """Calibrate on a small CPU model (batches of other shapes, adapters warm: no slot limit,
    and 16 slots with 64 in flight for the cost per deferred request), then run one real
    replica where the planner's parts bind (`validate.VALIDATION`: 32 in
    flight over 4 adapter slots, the barrier after 16 deferred steps, a host tier of 8 under
    Zipf(1.3) over 60 adapters) and simulate the same requests. Tokens/s and p99 TTFT (in
    tokens' time: seconds times the side's tokens/s, so the machine's drift between a
    calibration and a run moves tokens/s alone) within 15%, cold loads within 20%, deferrals
    within 15% (`validate.TOLERANCE`); and the same
    comparison fails for each negative control: the simulator without its starvation barrier,
    and with an unbounded host tier.

    Robust on a shared host: it runs in a process of its own (threads other tests leave slow
    the real runs, not the calibrations); both sides read the process's CPU time, so other
    processes' load does not count (wall time did: the engine thread got a third of a core at
    a load average of 5); calibrations and runs alternate, each run simulated with the mean of
    the calibrations on either side of it, and each figure's verdict is the median of five
    rounds' ratios (three failed one CI run in several: tokens/s 1.156 against the 15%, where
    single rounds on this host read 0.77 to 1.26). Cold loads and deferrals are counts, which
    the machine's load barely moves."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAPLANE_LOADER_NICE": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "loraplane.planner.validate", "--json", "--rounds", "5"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    verdicts, rounds = out["verdicts"], out["rounds"]
    detail = json.dumps({"verdicts": verdicts, "rounds": rounds, "seconds": out["seconds"]})
    print(detail)
    assert len(rounds) == 5, detail
    for r in rounds:  # where the parts bind: most requests deferred, and adapters loaded
        # again and again (half as many again as with a host tier that never evicts)
        once = r["sim"]["unbounded_host_tier"]["cold_loads"]
        assert r["real"]["deferred"] > 150 and r["real"]["cold_loads"] > 1.5 * once, detail
    assert verdicts["simulator"]["agrees"], detail
    assert verdicts["simulator"]["misses"] == [], detail
    # the negative controls: what each part moves fails the comparison
    assert "deferred" in verdicts["no_barrier"]["misses"], detail
    assert "cold_loads" in verdicts["unbounded_host_tier"]["misses"], detail


def test_the_negative_controls_change_what_their_part_decides() -> None:
    """On the validation's settings in the simulator alone: without the barrier fewer requests
    are deferred (others pass the starving ones), and with an unbounded host tier an adapter
    loads once; the full simulator is deterministic against itself. Cheap (no engine), so it
    runs in every test run."""
    from loraplane.planner.replica import Parts
    from loraplane.planner.validate import TOLERANCE, VALIDATION

    settings = ReplicaSettings(max_num_seqs=32, max_num_batched_tokens=2048, lora_slots=4,
                               lora_budget_bytes=10**9, adapter_bytes=229_376,
                               adapter_device_bytes=229_376, max_cpu_loras=8, kv_blocks=512,
                               block_size=16, max_deferral_steps=16, device_copies=False,
                               loads_share_core=True)  # fmt: skip
    cost = LinearCost(base=0.004, per_token=1e-4, per_seq=5e-5, per_context=1e-6,
                      per_adapter=2e-5, load_seconds_per_byte=4e-9)  # fmt: skip
    full = simulate(settings, cost, "round_robin", 1, VALIDATION)
    assert full == simulate(settings, cost, "round_robin", 1, VALIDATION)
    no_barrier = simulate(settings, cost, "round_robin", 1, VALIDATION, parts=Parts(barrier=False))
    unbounded = simulate(settings, cost, "round_robin", 1, VALIDATION,
                         parts=Parts(host_limit=False))  # fmt: skip
    distinct = len({a for a, _, _ in draw_requests(VALIDATION, VALIDATION.requests)})
    assert full.deferred > VALIDATION.requests // 2  # the slots bind
    assert full.cold_loads > 1.5 * distinct  # the host tier evicts and reloads
    assert no_barrier.deferred < (1 - TOLERANCE["deferred"]) * full.deferred
    assert unbounded.cold_loads == distinct
    assert unbounded.cold_loads < (1 - TOLERANCE["cold_loads"]) * full.cold_loads
    # the validation's clock counts the loaders' work on the engine's core: with the loads
    # off the core, the same run is shorter, by at most the loads' seconds (those that end
    # while the engine waits for them cost the wait either way)
    apart = simulate(dataclasses.replace(settings, loads_share_core=False), cost, "round_robin",
                     1, VALIDATION)  # fmt: skip
    tokens = sum(o for _, _, o in draw_requests(VALIDATION, VALIDATION.requests))
    loads_s = full.cold_loads * cost.host_load_seconds(settings.adapter_bytes)
    longer = tokens / full.tokens_per_s - tokens / apart.tokens_per_s
    assert 0.1 * loads_s < longer <= loads_s, (longer, loads_s)
