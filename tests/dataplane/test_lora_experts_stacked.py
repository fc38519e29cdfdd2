"""A sparse layer's expert LoRA in one SGMV call per linear (`RoutedRows.batch`,
`ExpertLoRA.stacked`, `ExpertLoRA.apply_layer`) and the block that uses it, against the
per-expert torch reference `expert_lora_torch` and transformers' per-expert loop.

Every case has an expert no token routes to, base rows, and a slot that does not adapt one
expert's linear. The backends: the native C kernel (B held transposed, as a CPU pool keeps it),
torch, and Triton (its interpreter on CPU tensors, as the root conftest sets it up without
CUDA; compiled on a CUDA device).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.kernels import dispatch, sgmv_cpu
from loraplane.dataplane.lora import metadata
from loraplane.dataplane.lora.experts import (
    ExpertLoRA,
    expert_batch,
    expert_lora_torch,
    route_rows,
)
from loraplane.dataplane.lora.layers import LoRAContext
from loraplane.dataplane.lora.loader import LoadedAdapter, LoRAWeights
from loraplane.dataplane.lora.metadata import LoRABatch
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.models.moe import MoEConfig, SparseMoeBlock

NUM_EXPERTS, NUM_SLOTS, TOP_K = 4, 5, 2
HIDDEN, INTER = 24, 40
UNROUTED = 3  # no token routes to this expert
# slot -> rank per expert (None: the slot does not adapt that expert); slot 4 holds nothing
RANKS: dict[int, tuple[int | None, ...]] = {
    0: (4, 4, 4, 4),
    1: (16, None, 8, 16),  # does not adapt expert 1
    2: (8, 8, 8, 8),
    3: (2, 6, None, 2),
}
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def _experts(tokens: int, seed: int) -> torch.Tensor:
    """[T, k] routing that never picks UNROUTED."""
    gen = torch.Generator().manual_seed(seed)
    hit = [e for e in range(NUM_EXPERTS) if e != UNROUTED]
    return torch.stack(
        [torch.tensor(hit)[torch.randperm(len(hit), generator=gen)[:TOP_K]] for _ in range(tokens)]
    )


def _slots(tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 4, (tokens,), generator=gen).tolist()  # -1: base rows


def _tables(
    transposed: bool, device: torch.device, dtype: torch.dtype = torch.float32
) -> list[tuple[ModuleSlots, ModuleSlots, ModuleSlots]]:
    """[expert][gate, up, down] slot tables; B as a dense [r, out] transposed or [out, r]."""
    torch.manual_seed(3)
    tables = []
    for e in range(NUM_EXPERTS):
        per = []
        for fan_in, fan_out in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
            table = ModuleSlots(NUM_SLOTS, device)
            for slot, ranks in RANKS.items():
                r = ranks[e]
                if r is None:
                    continue
                table.lora_a[slot] = (torch.randn(r, fan_in) * 0.3).to(device, dtype)
                b = torch.randn(r, fan_out) * 0.3
                table.lora_b[slot] = (b.to(device, dtype).t() if transposed
                                      else b.t().contiguous().to(device, dtype))  # fmt: skip
                table.scales[slot] = 0.25 * (slot + 1)
            per.append(table)
        tables.append((per[0], per[1], per[2]))
    return tables


def test_the_layer_batch_is_every_experts_segments_at_stacked_slots() -> None:
    experts = _experts(29, seed=1)
    batch = LoRABatch.from_token_slots(_slots(29, seed=2))
    rows = route_rows(experts, batch, NUM_EXPERTS, NUM_SLOTS)
    assert UNROUTED not in rows.experts_hit
    layer = rows.batch
    assert layer is not None and layer.num_tokens == 29 * TOP_K
    want_slots, want_rows = [], []
    for e in rows.experts_hit:
        first = rows.expert_bounds[e]
        for slot, start, end in rows.segments(e):
            want_slots.append(e * NUM_SLOTS + slot)
            want_rows.append(list(range(first + start, first + end)))
    assert layer.seg_slots == tuple(want_slots)
    assert layer.seg_slots_t.tolist() == want_slots
    for s, expected in enumerate(want_rows):
        lo, hi = layer.seg_bounds[s], layer.seg_bounds[s + 1]
        assert layer.token_order[lo:hi].tolist() == expected
        assert layer.token_slots[lo:hi].tolist() == [want_slots[s]] * len(expected)
    # the base rows are in no segment; every adapter row in exactly one
    slot_of = torch.tensor(_slots(29, seed=2))[rows.tokens]
    adapter_rows = torch.nonzero(slot_of >= 0).squeeze(1).tolist()
    assert sorted(layer.token_order.tolist()) == adapter_rows
    assert layer.seg_bounds_t.tolist() == list(layer.seg_bounds)


def test_no_layer_batch_for_base_rows_only_and_slots_beyond_the_pool_refused() -> None:
    experts = _experts(6, seed=4)
    assert route_rows(experts, LoRABatch.from_token_slots([-1] * 6), 4, NUM_SLOTS).batch is None
    assert route_rows(experts, None, 4, NUM_SLOTS).batch is None
    assert route_rows(experts, LoRABatch.from_token_slots([0] * 6), 4).batch is None  # no S
    with pytest.raises(ValueError, match="not below the 5 slots"):
        route_rows(experts, LoRABatch.from_token_slots([5, 0, 0, 0, 0, 0]), 4, NUM_SLOTS)


BACKENDS = ["native", "torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_layer_equals_the_reference_expert_by_expert(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "native" and sgmv_cpu.library() is None:
        pytest.skip("the native CPU kernel does not build here")
    if backend == "triton":
        pytest.importorskip("triton")
        if not INTERPRETED and not torch.cuda.is_available():
            pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    device = torch.device("cuda" if backend == "triton" and not INTERPRETED else "cpu")
    monkeypatch.setenv(dispatch.ENV, backend)
    tables = _tables(transposed=backend != "triton", device=device)
    lora = ExpertLoRA(tables)
    tokens = 31
    experts = _experts(tokens, seed=7).to(device)
    slots = _slots(tokens, seed=8)
    rows = route_rows(experts, LoRABatch.from_token_slots(slots, device), NUM_EXPERTS, NUM_SLOTS)
    assert rows.batch is not None
    n = tokens * TOP_K
    for proj, (fan_in, fan_out) in enumerate(((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN))):
        x = torch.randn(n, fan_in, device=device)
        y0 = torch.randn(n, fan_out, device=device)
        want, got = y0.clone(), y0.clone()
        for e in rows.experts_hit:
            lo, hi = rows.expert_bounds[e], rows.expert_bounds[e + 1]
            expert_lora_torch(want[lo:hi], x[lo:hi], rows.segments(e), tables[e][proj])
        lora.apply_layer(got, x, proj, rows.batch)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        base = torch.tensor([s < 0 for s in slots], device=device)[rows.tokens]
        assert torch.equal(got[base], y0[base])  # base rows: no delta at all
        assert (got - y0).abs().max() > 1e-2  # the adapters did add something
        # slot 1 does not adapt expert 1: its rows there are untouched
        lo = rows.expert_bounds[1]
        for slot, start, end in rows.segments(1):
            if slot == 1:
                assert torch.equal(got[lo + start : lo + end], y0[lo + start : lo + end])


def test_stacked_tables_follow_the_pools_loads_and_frees() -> None:
    """With the pool's slot generation, the stacked tables are refilled when it changes: a
    freed slot adds nothing after, a slot loaded with new tensors adds their delta."""
    tables = _tables(transposed=True, device=torch.device("cpu"))
    generation = [0] * NUM_SLOTS
    lora = ExpertLoRA(tables, generation)
    stacked = lora.stacked(0)
    assert stacked.lora_a[2 * NUM_SLOTS + 3] is None  # slot 3 does not adapt expert 2
    assert stacked.lora_a[1 * NUM_SLOTS + 0] is tables[1][0].lora_a[0]
    assert float(stacked.scales[1 * NUM_SLOTS + 2]) == 0.75
    for e in range(NUM_EXPERTS):  # free slot 2, as LoRAPool.free does
        for table in tables[e]:
            table.clear(2)
    generation[2] += 1
    stacked = lora.stacked(0)
    assert stacked.lora_a[1 * NUM_SLOTS + 2] is None and float(stacked.scales[7]) == 0.0
    a, b = torch.randn(3, HIDDEN), torch.randn(3, INTER).t()
    tables[0][0].lora_a[4], tables[0][0].lora_b[4] = a, b  # load slot 4 into expert 0's gate
    tables[0][0].scales[4] = 2.0
    generation[4] += 1
    stacked = lora.stacked(0)
    assert stacked.lora_a[4] is a and stacked.lora_b[4] is b and float(stacked.scales[4]) == 2.0
    # and the kernel reads them: expert 0's rows of slot 4 get 2 * x A^T B^T
    batch = LoRABatch(
        num_tokens=3,
        token_order=torch.tensor([1, 2]),
        seg_slots=(4,),
        seg_bounds=(0, 2),
        seg_slots_t=torch.tensor([4], dtype=torch.int32),
        seg_bounds_t=torch.tensor([0, 2], dtype=torch.int32),
        token_slots=torch.tensor([4, 4]),
    )
    x, y = torch.randn(3, HIDDEN), torch.zeros(3, INTER)
    lora.apply_layer(y, x, 0, batch)
    torch.testing.assert_close(y[1:], 2.0 * (x[1:] @ a.t() @ b.t()), atol=1e-4, rtol=1e-4)
    assert torch.equal(y[0], torch.zeros(INTER))


def _block(dtype: torch.dtype) -> SparseMoeBlock:
    config = MoEConfig.from_hf(
        {
            "model_type": "mixtral",
            "vocab_size": 64,
            "hidden_size": HIDDEN,
            "intermediate_size": INTER,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": NUM_EXPERTS,
            "num_experts_per_tok": TOP_K,
        }
    )
    torch.manual_seed(11)
    block = SparseMoeBlock(config, 0).to(dtype)
    with torch.no_grad():  # feature 0 (a constant 50 in `_inputs`) feeds UNROUTED's logit alone
        block.gate.weight[:, 0] = 0.0
        block.gate.weight[UNROUTED] = 0.0
        block.gate.weight[UNROUTED, 0] = -1.0  # logit -50: never in the top 2
    return block


def _inputs(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(tokens, HIDDEN)
    x[:, 0] = 50.0
    return x.to(dtype)


def _reference(
    block: SparseMoeBlock,
    x: torch.Tensor,
    tables: list[tuple[ModuleSlots, ModuleSlots, ModuleSlots]] | None,
    batch: LoRABatch | None,
) -> torch.Tensor:
    """transformers' loop, expert by expert in ascending order (index_add_ into zeros), with
    each expert's adapter deltas from the torch reference."""
    weights, experts = block.route(x)
    rows = route_rows(experts, batch, block.num_experts)
    xs = x[rows.tokens]
    out = torch.zeros_like(x)
    for e in rows.experts_hit:
        lo, hi = rows.expert_bounds[e], rows.expert_bounds[e + 1]
        gate_l, up_l, down_l = block.expert_list[e].linears()
        xe = xs[lo:hi]
        gate, up = gate_l(xe), up_l(xe)
        if tables is not None:
            expert_lora_torch(gate, xe, rows.segments(e), tables[e][0])
            expert_lora_torch(up, xe, rows.segments(e), tables[e][1])
        h = F.silu(gate) * up
        y = down_l(h)
        if tables is not None:
            expert_lora_torch(y, h, rows.segments(e), tables[e][2])
        w = weights.reshape(-1)[rows.pairs[lo:hi]]
        out.index_add_(0, rows.tokens[lo:hi], (y * w[:, None]).to(out.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_base_block_equals_transformers_loop(dtype: torch.dtype) -> None:
    """Up to the GEMMs' rounding: the block writes each expert's products into the layer's
    row buffers, whose alignment can change a BLAS kernel's last bit."""
    block = _block(dtype)
    x = _inputs(37, dtype)
    with torch.no_grad():
        got, want = block(x), _reference(block, x, None, None)
    assert UNROUTED not in set(block.route(x)[1].reshape(-1).tolist())
    tol = 1e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    with torch.no_grad():  # no token at all: no row, zeros of the right shape
        assert block(x[:0]).shape == (0, HIDDEN)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_the_adapted_block_equals_the_per_expert_reference(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "native" and sgmv_cpu.library() is None:
        pytest.skip("the native CPU kernel does not build here")
    monkeypatch.setenv(dispatch.ENV, backend)
    block = _block(torch.float32)
    tables = _tables(transposed=True, device=torch.device("cpu"))
    block.lora = ExpertLoRA(tables)
    context = LoRAContext(pool=None)  # type: ignore[arg-type]
    block.context = context
    x = _inputs(41, torch.float32)
    slots = _slots(41, seed=12)
    context.batch = LoRABatch.from_token_slots(slots)
    with torch.no_grad():
        got = block(x)
        want = _reference(block, x, tables, context.batch)
        base = _reference(block, x, None, None)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    is_base = torch.tensor(slots) < 0
    # base tokens as the base model's (up to the GEMMs' rounding, as above)
    torch.testing.assert_close(got[is_base], base[is_base], atol=1e-6, rtol=1e-6)
    assert (got - base).abs().max() > 1e-3
    context.batch = LoRABatch.from_token_slots([-1] * 41)  # no adapter token: the base path
    with torch.no_grad():
        base_path = block(x)
    assert UNROUTED not in set(block.route(x)[1].reshape(-1).tolist())
    torch.testing.assert_close(base_path, base, atol=1e-6, rtol=1e-6)
    assert torch.equal(base_path[is_base], got[is_base])  # the same rows either way


# Once per step, as the dense layers (test_kernels_bgmv.py: the backend read once when the
# batch is built, stamped layers checking their slot tables once per pool change).


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_the_backend_is_read_once_per_step_not_per_sparse_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every sparse layer's batch takes the step batch's LORAPLANE_SGMV choice: an environment
    changed after the step's batch was built (even to a bad value) does not change that step,
    whose layers read it no more; the next batch reads it."""
    monkeypatch.setenv(dispatch.ENV, "torch")
    block = _block(torch.float32)
    tables = _tables(transposed=True, device=torch.device("cpu"))
    block.lora = ExpertLoRA(tables)
    context = LoRAContext(pool=None)  # type: ignore[arg-type]
    block.context = context
    x = _inputs(23, torch.float32)
    reads = _count_calls(monkeypatch, metadata, "read_choice")
    batch = context.batch = LoRABatch.from_token_slots(_slots(23, seed=5))
    assert batch.backend == "torch" and len(reads) == 1
    monkeypatch.setenv(dispatch.ENV, "cuda-please")
    with torch.no_grad():
        got = [block(x) for _ in range(3)]  # three sparse layers of one step
        want = _reference(block, x, tables, batch)
    assert len(reads) == 1
    for out in got:
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    layer = route_rows(block.route(x)[1], batch, NUM_EXPERTS, NUM_SLOTS).batch
    assert layer is not None and layer.backend == "torch"
    assert expert_batch([(0, 0, 2)], torch.device("cpu"), batch.backend).backend == "torch"
    with pytest.raises(ValueError, match=dispatch.ENV):
        LoRABatch.from_token_slots([0])
    monkeypatch.setenv(dispatch.ENV, "native")
    assert LoRABatch.from_token_slots([0]).backend == "native"


def _spec() -> BaseModelSpec:
    """`_block`'s shapes: one sparse Mixtral layer."""
    return BaseModelSpec("m", "mixtral", 1, HIDDEN, INTER, 4, 2, HIDDEN // 4,
                         num_experts=NUM_EXPERTS, moe_intermediate_size=INTER,
                         moe_layers=(0,))  # fmt: skip


def _expert_adapter(rank: int, seed: int, experts: Iterable[int]) -> LoadedAdapter:
    """An adapter of every linear of `experts` in `_spec`'s layer 0."""
    spec, gen = _spec(), torch.Generator().manual_seed(seed)
    modules = {}
    for e in experts:
        for name in ("w1", "w3", "w2"):
            fan_in, fan_out = spec.module_shape(f"experts.{e}.{name}")
            a = torch.randn(rank, fan_in, generator=gen) * 0.3
            b = torch.randn(fan_out, rank, generator=gen) * 0.3
            modules[(0, f"experts.{e}.{name}")] = LoRAWeights(a, b, 0.5)
    return LoadedAdapter(f"r{rank}-{seed}", modules)


def test_stamped_sparse_layers_check_the_slot_tables_once_per_pool_change_not_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a pool and the context's stamp: the stacked tables are compared with the pool,
    and their kernels' slot tables checked, at the first call after a load or free, then
    trusted over steps and sparse layers; a reload into a used slot is seen."""
    pytest.importorskip("triton")
    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    device = torch.device("cpu" if INTERPRETED else "cuda")
    monkeypatch.setenv(dispatch.ENV, "triton")
    pool = LoRAPool(NUM_SLOTS, _spec(), torch.float32, device, b_transposed=False)
    block = _block(torch.float32).to(device)
    context = LoRAContext(pool)
    block.lora = ExpertLoRA.from_pool(pool, 0, NUM_EXPERTS, block.expert_list[0].names)
    block.context = context
    assert pool.load(0, _expert_adapter(4, seed=1, experts=range(NUM_EXPERTS)))
    assert pool.load(1, _expert_adapter(8, seed=2, experts=(0, 2)))  # not expert 1
    checks = _count_calls(monkeypatch, dispatch, "_is_current")
    fills = _count_calls(monkeypatch, ExpertLoRA, "_fill")
    token_slots = [1, 0, -1, 1, 0, 0, 1]
    x = _inputs(len(token_slots), torch.float32).to(device)

    def step() -> None:
        batch = LoRABatch.from_token_slots(token_slots, device=device)
        context.activate(batch)
        with torch.no_grad():
            got = [block(x) for _ in range(2)]  # two sparse layers of one step
            assert block.lora is not None
            want = _reference(block, x, block.lora.tables, batch)
            context.activate(None)
            base = block(x)
        for out in got:
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        assert (got[0] - base).abs().max() > 1e-3

    for _ in range(3):
        step()
    assert len(checks) <= 3  # the first step only, a table per linear (fresh: not checked)
    assert len(fills) == 3  # the first call filled the three linears' stacked tables
    pool.free(1)
    assert pool.load(1, _expert_adapter(16, seed=3, experts=(1, 2)))  # new tensors and rank
    checks.clear()
    fills.clear()
    for _ in range(2):
        step()
    assert len(checks) == 3 and len(fills) == 3  # once per linear after the change
