"""The planner's tensor parallelism: one rank's shapes are the data plane's own split (module
shapes from `shard.local_spec`, adapter slices from `shard.shard_adapter`), each GPU's weights
about 1/N of the model's and its KV bytes per token 1/N (one replicated head below N KV heads),
an adapter a bit more than 1/N; the step's collectives cost a ring's bytes plus a latency each,
growing with N, on top of the rank's own step."""

from __future__ import annotations

import dataclasses

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.config import EngineConfig
from loraplane.planner.cost import GPUS, Roofline, StepShape
from loraplane.planner.memory import (
    AdapterProfile,
    adapter_elements,
    kv_bytes_per_token,
    plan_memory,
    weights_bytes,
)
from loraplane.planner.parallel import Collectives, TensorParallelRefused, check_split, rank_shape
from loraplane.planner.shapes import ModelShape, named_shape

torch = pytest.importorskip("torch")

# a small Llama with fewer KV heads (2) than the largest split (4): each rank then holds one
SMALL = ModelShape(BaseModelSpec("small", "llama", num_layers=2, hidden_size=64, num_heads=8,
                                 num_kv_heads=2, head_dim=8, intermediate_size=128),
                   vocab_size=101, max_position_embeddings=512)  # fmt: skip


def config(n: int) -> EngineConfig:
    return EngineConfig(model="m", tensor_parallel_size=n)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_rank_holds_about_1_over_n_of_the_weights_and_of_the_kv_per_token(n: int) -> None:
    shape = named_shape("llama-3-70b")
    plan = plan_memory(shape, config(n), 141 * 10**9, AdapterProfile(2000))
    total = weights_bytes(shape, "bfloat16")
    assert plan.model_weights_bytes == total
    # the norms are whole on every rank and the vocabulary padded: a little over 1/N
    assert total / n < plan.weights_bytes < total / n * 1.001
    assert plan.kv_bytes_per_token == 2 * 80 * (8 // n) * 128 * 2
    assert plan.kv_bytes_per_token == kv_bytes_per_token(shape, "bfloat16") // n
    free = 141 * 10**9 - plan.weights_bytes
    budget = int(free * 0.1)
    assert plan.lora_budget_bytes == budget and plan.kv_lora_shared  # inside the KV cache
    wanted = 256 * 8192 // 16  # max_num_seqs sequences of the longest length
    blocks = (int(free * 0.85) - budget) // (plan.kv_bytes_per_token * 16)
    assert plan.kv_blocks == min(wanted, blocks)
    assert plan.devices == n


def test_below_n_kv_heads_each_rank_holds_one_replicated() -> None:
    two, four = rank_shape(SMALL, 2), rank_shape(SMALL, 4)
    assert (two.num_kv_heads, four.num_kv_heads) == (1, 1)
    assert kv_bytes_per_token(four, "bfloat16") == 2 * 2 * 1 * 8 * 2  # layers, 1 head of 8
    assert four.vocab_size == 26  # ceil(101 / 4), the last rank's rows padded


def test_an_adapter_on_each_rank_is_a_bit_more_than_1_over_n() -> None:
    """Column-parallel: A whole, B's rows split; row-parallel: A's columns split, B whole."""
    shape, profile = named_shape("llama-3-70b"), AdapterProfile(1, rank=16)
    r, n = 16, 2
    column = [(8192, 8192), (8192, 1024), (8192, 1024), (8192, 28672), (8192, 28672)]
    row = [(8192, 8192), (28672, 8192)]  # (in, out) of o_proj, down_proj
    per_layer = sum(r * i + r * o // n for i, o in column) + sum(r * i // n + r * o for i, o in row)
    local = adapter_elements(rank_shape(shape, n), profile)
    assert local == 80 * per_layer
    whole = adapter_elements(shape, profile)
    assert whole / n < local < whole
    plan = plan_memory(shape, config(n), 141 * 10**9, AdapterProfile(2000))
    assert plan.adapter_bytes == 2 * local
    # inside each rank's KV cache: its part in whole blocks of every layer
    assert plan.kv_lora_shared and 2 * local <= plan.adapter_device_bytes < 2 * local * 1.1
    beside = plan_memory(shape, EngineConfig(model="m", tensor_parallel_size=n,
                                             kv_lora_shared=False), 141 * 10**9,
                         AdapterProfile(2000))  # fmt: skip
    assert beside.adapter_device_bytes == 2 * local
    assert plan.adapter_full_bytes == 2 * whole
    # rank 0 keeps every rank's part of each copy (its own and the workers', lora/host_tier.py)
    assert plan.host_tier_bytes == 512 * 2 * local * n


@pytest.mark.parametrize(("shape", "n"), [(SMALL, 2), (SMALL, 4), (named_shape("qwen2-7b"), 4)])
def test_a_rank_s_shapes_are_the_data_plane_s_split(shape: ModelShape, n: int) -> None:
    """The planner's rank shape against the data plane's `local_spec` (the slots it builds)
    and `shard_adapter` (the slices a rank keeps) on every module of an adapter."""
    import loraplane.dataplane.models.loader  # noqa: F401  (the data plane's import order)
    from loraplane.dataplane.lora.loader import LoadedAdapter, LoRAWeights
    from loraplane.dataplane.parallel.shard import TPShard, heads_of, local_spec, shard_adapter

    local = rank_shape(shape, n)
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for rank in range(n):
        spec = local_spec(shape.spec, TPShard(rank, n))
        assert [spec.module_shape(m) for m in modules] == [
            local.spec.module_shape(m) for m in modules
        ]
    if shape.hidden_size > 1024:
        return  # a big base's adapter is not built here; its shapes agree above
    r = 4
    weights = {}
    for layer in range(shape.num_layers):
        for m in modules:
            fan_in, fan_out = shape.spec.module_shape(m)
            weights[(layer, m)] = LoRAWeights(torch.zeros(r, fan_in), torch.zeros(fan_out, r), 1.0)
    for rank in range(n):
        part = shard_adapter(LoadedAdapter("x", weights), TPShard(rank, n), heads_of(shape.spec))
        kept = sum(w.a.numel() + w.b.numel() for w in part.modules.values())
        assert kept == adapter_elements(local, AdapterProfile(1, rank=r))


SMALL_MOE = ModelShape(BaseModelSpec("small-moe", "qwen3_moe", num_layers=2, hidden_size=64,
                                     num_heads=4, num_kv_heads=2, head_dim=32,
                                     intermediate_size=80, num_experts=4,
                                     moe_intermediate_size=48, moe_layers=(0,)),
                       vocab_size=101, max_position_embeddings=512,
                       experts_per_tok=2)  # fmt: skip


@pytest.mark.parametrize("n", [2, 4])
def test_a_mixture_of_experts_rank_shape_is_the_data_plane_s_split(n: int) -> None:
    """Each expert's linears split as a dense MLP's: the planner's rank shape against the data
    plane's `local_spec` and `shard_adapter` on every module of a sparse and a dense layer."""
    import loraplane.dataplane.models.loader  # noqa: F401  (the data plane's import order)
    from loraplane.dataplane.lora.loader import LoadedAdapter, LoRAWeights
    from loraplane.dataplane.parallel.shard import TPShard, heads_of, local_spec, shard_adapter

    shape, r = SMALL_MOE, 4
    local = rank_shape(shape, n)
    weights = {}
    for layer in range(shape.num_layers):
        for m in shape.spec.layer_modules(layer):
            fan_in, fan_out = shape.spec.module_shape(m)
            weights[(layer, m)] = LoRAWeights(torch.zeros(r, fan_in), torch.zeros(fan_out, r), 1.0)
    for rank in range(n):
        spec = local_spec(shape.spec, TPShard(rank, n))
        for layer in range(shape.num_layers):
            modules = spec.layer_modules(layer)
            assert [spec.module_shape(m) for m in modules] == [
                local.spec.module_shape(m) for m in modules
            ]
        part = shard_adapter(LoadedAdapter("x", weights), TPShard(rank, n), heads_of(shape.spec))
        for (_, m), w in part.modules.items():
            assert (w.a.shape[1], w.b.shape[0]) == spec.module_shape(m)
        kept = sum(w.a.numel() + w.b.numel() for w in part.modules.values())
        assert kept == adapter_elements(local, AdapterProfile(1, rank=r))


def test_splits_serve_refuses_are_refused_by_name() -> None:
    with pytest.raises(TensorParallelRefused, match="does not divide num_attention_heads"):
        check_split(named_shape("llama-3-70b"), 3)
    wide = dataclasses.replace(SMALL, spec=dataclasses.replace(SMALL.spec, intermediate_size=130))
    with pytest.raises(TensorParallelRefused, match="does not divide intermediate_size"):
        check_split(wide, 4)
    odd = dataclasses.replace(SMALL, spec=dataclasses.replace(SMALL.spec, num_heads=12,
                                                              num_kv_heads=3))  # fmt: skip
    with pytest.raises(TensorParallelRefused, match="neither divides num_key_value_heads"):
        check_split(odd, 2)
    for name in ("qwen3-30b-a3b", "mixtral-8x7b"):  # mixtures of experts split as the engine's
        assert rank_shape(named_shape(name), 2).moe_intermediate_size == (
            named_shape(name).moe_intermediate_size // 2
        )
    odd_experts = dataclasses.replace(
        named_shape("qwen3-30b-a3b"),
        spec=dataclasses.replace(named_shape("qwen3-30b-a3b").spec, moe_intermediate_size=770),
    )
    with pytest.raises(TensorParallelRefused, match=r"does not divide moe_intermediate_size \(770"):
        check_split(odd_experts, 4)
    check_split(named_shape("gemma-3-12b"), 1)  # one rank is no split


def test_the_collectives_cost_a_ring_s_bytes_and_a_latency_each() -> None:
    shape, step = named_shape("llama-3-70b"), 64  # a decode step of 64 rows
    link, lat = 450e9 * 0.8, 10e-6
    activations = step * 8192 * 2
    for n in (2, 4, 8):
        ring = Collectives(n, 450e9, lat)
        reduce = lat + 2 * (n - 1) / n * activations / link
        logits = step * -(-128256 // n) * n * 2
        gather = lat + (n - 1) / n * logits / link
        assert ring.step_seconds(shape, 2, step, step) == pytest.approx(161 * reduce + gather)
    assert Collectives(1, 450e9, lat).step_seconds(shape, 2, step, step) == 0.0


def test_the_all_reduce_term_grows_with_n_and_is_added_to_the_rank_s_step() -> None:
    shape, profile = named_shape("llama-3-70b"), AdapterProfile(100)
    step = StepShape(tokens=256, seqs=64, context=64 * 600, attention=64 * 600 + 192 * 300,
                     adapters=8, adapter_bytes=8 * 280 << 20)  # fmt: skip
    h200 = GPUS["h200"]
    free_link = dataclasses.replace(h200, interconnect=1e30, collective_latency=0.0)
    comms = []
    for n in (2, 4, 8):
        with_links = Roofline(h200, shape, "bfloat16", profile, tensor_parallel_size=n)
        ideal = Roofline(free_link, shape, "bfloat16", profile, tensor_parallel_size=n)
        comm = with_links.step_seconds(step) - ideal.step_seconds(step)
        assert comm == pytest.approx(with_links.collectives.step_seconds(shape, 2, 256, 64))
        comms.append(comm)
    assert comms[0] < comms[1] < comms[2]
    assert comms[0] > 161 * 10e-6  # at least a latency per all-reduce
    # a rank reads its shard: the split step is faster than the whole model's would be
    one = Roofline(dataclasses.replace(h200, memory=10**12), shape, "bfloat16", profile)
    assert Roofline(h200, shape, "bfloat16", profile, tensor_parallel_size=2).step_seconds(
        step
    ) < 0.6 * one.step_seconds(step)
