"""The BGMV decode kernels, the launch rule, the once-per-step LoRA metadata, and the captured
decode graphs' launches (linear in the batch) at 256 rows.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set
before Triton is imported); shapes stay tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dataplane.triton_mode import DEVICE, INTERPRETED, require_triton

require_triton()

from loraplane.adapters.base_model import BaseModelSpec  # noqa: E402
from loraplane.dataplane import attention  # noqa: E402
from loraplane.dataplane.cuda_graphs import DecodeGraphs, Forward, GraphShape  # noqa: E402
from loraplane.dataplane.kernels import bgmv_triton as bt  # noqa: E402
from loraplane.dataplane.kernels import dispatch, sgmv_torch  # noqa: E402
from loraplane.dataplane.kernels import sgmv_triton as st  # noqa: E402
from loraplane.dataplane.kernels.launch import BGMV, SGMV, choose_launch  # noqa: E402
from loraplane.dataplane.lora import (  # noqa: E402
    LinearWithLoRA,
    LoadedAdapter,
    LoRABatch,
    LoRAContext,
    LoRAPool,
    LoRAWeights,
    ModuleSlots,
    install_lora,
)
from loraplane.dataplane.models.llama import LlamaForCausalLM  # noqa: E402
from loraplane.dataplane.models.loader import load_model  # noqa: E402
from loraplane.dataplane.step_metadata import StepRow, build_step  # noqa: E402

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2)}
# slot 3 does not target the module; rank 128 next to rank 1, ranks not multiples of 16
RANKS: list[int | None] = [1, 128, 8, None, 16, 3, 33]
FAN_IN, FAN_OUT = 40, 24  # not multiples of the tiles: masks are exercised


def _weights(
    ranks: Sequence[int | None], dtype: torch.dtype, seed: int = 0
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lora_a: list[torch.Tensor | None] = []
    lora_b: list[torch.Tensor | None] = []
    for r in ranks:
        if r is None:
            lora_a.append(None)
            lora_b.append(None)
            continue
        lora_a.append((torch.randn(r, FAN_IN, generator=gen) / FAN_IN**0.5).to(DEVICE, dtype))
        lora_b.append((torch.randn(FAN_OUT, r, generator=gen) / r**0.5).to(DEVICE, dtype))
    scales = (torch.rand(len(ranks), generator=gen) * 2 + 0.1).to(DEVICE)
    return lora_a, lora_b, scales


def _fp32(ts: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.float().cpu() for t in ts]


def _reference(
    y: torch.Tensor,
    x: torch.Tensor,
    batch: LoRABatch,
    lora_a: Sequence[torch.Tensor | None],
    lora_b: Sequence[torch.Tensor | None],
    scales: torch.Tensor,
) -> torch.Tensor:
    """sgmv_torch.lora_apply on fp32 CPU copies of everything."""
    return sgmv_torch.lora_apply(
        y.float().cpu(), x.float().cpu(), batch.token_order.cpu(), batch.seg_slots,
        batch.seg_bounds, _fp32(lora_a), _fp32(lora_b), scales.cpu(),
    )  # fmt: skip


def _decode_slots(seed: int, tokens: int) -> list[int]:
    """A decode step's token slots: base tokens, every slot but 6, one slot much busier."""
    rng = random.Random(seed)
    slots = [rng.choice([-1, 0, 1, 2, 3, 4, 5]) for _ in range(tokens)]
    for t in rng.sample(range(tokens), tokens // 3):
        slots[t] = 4
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
@pytest.mark.parametrize(
    "config", [None, st.KernelConfig(block_k=16, split_k=2)], ids=["default", "split-k"]
)
def test_bgmv_matches_torch_for_mixed_slots_ranks_base_tokens_and_untargeted_slots(
    dtype: torch.dtype, fused: bool, config: st.KernelConfig | None
) -> None:
    lora_a, lora_b, scales = _weights(RANKS, dtype, seed=1)
    token_slots = _decode_slots(seed=1, tokens=24)
    batch = LoRABatch.from_token_slots(token_slots, device=DEVICE)
    x = torch.randn(len(token_slots), FAN_IN).to(DEVICE, dtype)
    y = torch.randn(len(token_slots), FAN_OUT).to(DEVICE, dtype)
    expected = _reference(y, x, batch, lora_a, lora_b, scales)
    weights = st.SlotWeights.build(lora_a, lora_b, dtype, DEVICE)
    before = y.clone()
    got = bt.lora_apply(
        y, x, batch.token_order, batch.token_slots, weights, scales, fused=fused, config=config
    )
    assert got is y
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), expected, atol=atol, rtol=rtol)
    untouched = [t for t, s in enumerate(token_slots) if s in (-1, 3)]  # base, untargeted
    assert torch.equal(got[untouched], before[untouched])


def test_bgmv_shrink_is_rank_exact_and_skips_slot_minus_one_and_expand_adds_scaled_products() -> (
    None
):
    lora_a, lora_b, scales = _weights(RANKS, torch.float32, seed=2)
    order = torch.tensor([5, 0, 3, 1, 2, 4], device=DEVICE)
    token_slots = torch.tensor([1, 2, -1, 3, 6, 0], device=DEVICE)  # -1: a padding row
    x = torch.randn(6, FAN_IN, device=DEVICE)
    weights = st.SlotWeights.build(lora_a, lora_b, torch.float32, DEVICE)
    h = bt.bgmv_shrink(x, order, token_slots, weights)
    assert h.shape == (6, 128)
    for n, (row, slot) in enumerate(zip(order.tolist(), token_slots.tolist(), strict=True)):
        a = lora_a[slot] if slot >= 0 else None
        if a is None:
            assert not h[n].any()  # padding row, untargeted slot
            continue
        torch.testing.assert_close(h[n, : a.shape[0]], x[row] @ a.t(), atol=1e-5, rtol=1e-5)
        assert not h[n, a.shape[0] :].any()  # nothing past the slot's own rank
    y = torch.randn(6, FAN_OUT, device=DEVICE)
    want = y.clone()
    for n, (row, slot) in enumerate(zip(order.tolist(), token_slots.tolist(), strict=True)):
        b = lora_b[slot] if slot >= 0 else None
        if b is not None:
            want[row] += (h[n, : b.shape[1]] @ b.t()) * scales[slot]
    got = bt.bgmv_expand(y, h, order, token_slots, weights, scales)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bgmv_rejects_bad_token_tensors_naming_them() -> None:
    lora_a, lora_b, scales = _weights([4], torch.float32)
    weights = st.SlotWeights.build(lora_a, lora_b, torch.float32, DEVICE)
    x, y = torch.randn(2, FAN_IN, device=DEVICE), torch.zeros(2, FAN_OUT, device=DEVICE)
    order = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="token_slots must be"):
        bt.lora_apply(y, x, order, order.int(), weights, scales)
    with pytest.raises(ValueError, match="token_slots has 1 entries"):
        bt.lora_apply(y, x, order, order[:1], weights, scales)


def test_the_launch_rule_takes_the_grid_with_fewer_programs() -> None:
    assert choose_launch(64, 64, 1) == BGMV  # 64 adapters, a token each
    assert choose_launch(101, 400, 300) == BGMV  # one adapter of 300 tokens, 100 of one
    assert choose_launch(51, 250, 200) == SGMV  # 51 x 4 blocks of 64 < 250 tokens
    assert choose_launch(32, 64, 2) == SGMV  # two tokens per adapter
    assert choose_launch(8, 256, 32) == SGMV  # 8 adapters of 32 decode rows each
    assert choose_launch(1, 512, 512) == SGMV  # a prefill chunk
    decode = LoRABatch.from_token_slots([0, 1, 2, -1, 3])
    assert (decode.launch, decode.max_seg_len, decode.slot_mask) == (BGMV, 1, 0b1111)
    prefill = LoRABatch.from_token_slots([2] * 40 + [0])
    assert (prefill.launch, prefill.max_seg_len, prefill.slot_mask) == (SGMV, 40, 0b101)


def test_the_backend_is_read_once_when_the_batch_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layers read the batch's choice: an environment changed after the step's batch was
    built (even to a bad value) does not change that step; the next batch reads it."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    slots = ModuleSlots(len(RANKS), DEVICE)
    lora_a, lora_b, scales = _weights(RANKS, torch.float32, seed=3)
    slots.lora_a[:], slots.lora_b[:] = lora_a, lora_b
    slots.scales.copy_(scales)
    batch = LoRABatch.from_token_slots(_decode_slots(seed=3, tokens=12), device=DEVICE)
    assert batch.backend == "triton"
    monkeypatch.setenv(dispatch.ENV, "cuda-please")
    x, y = torch.randn(12, FAN_IN, device=DEVICE), torch.randn(12, FAN_OUT, device=DEVICE)
    want = _reference(y, x, batch, lora_a, lora_b, scales)
    got = dispatch.lora_apply(y, x, batch, slots, stamp=0)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=dispatch.ENV):
        LoRABatch.from_token_slots([0])
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert LoRABatch.from_token_slots([0]).backend == "torch"


def _adapter(spec: BaseModelSpec, rank: int, modules: Sequence[str], seed: int) -> LoadedAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(spec.num_layers):
        for module in modules:
            fan_in, fan_out = spec.module_shape(module)
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) / rank**0.5
            weights[(layer, module)] = LoRAWeights(a, b, 2.0 / rank)
    return LoadedAdapter(f"r{rank}-{seed}", weights)


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(dispatch, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, name, counted)
    return calls


def test_stamped_layers_check_the_slot_tables_once_per_pool_change_not_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through LinearWithLoRA (the context's stamp): a table is checked against the pool at
    the first call after a load or free, then trusted; a reload into a used slot is seen."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    spec = BaseModelSpec("m", "llama", 1, 24, 40, 2, 2, 12)
    pool = LoRAPool(3, spec, torch.float32, DEVICE, b_transposed=False)
    model = _OneLayer(spec)
    context = install_lora(model, pool)
    pool.load(0, _adapter(spec, 8, ["gate_proj"], seed=1))
    pool.load(1, _adapter(spec, 16, ["gate_proj"], seed=2))
    layer = model.get_submodule("layers.0.mlp.gate_proj")
    assert isinstance(layer, LinearWithLoRA) and layer.slots is not None
    checks = _count_calls(monkeypatch, "_is_current")
    token_slots = [1, 0, -1, 1, 0, 0]

    def step() -> None:
        batch = LoRABatch.from_token_slots(token_slots, device=DEVICE)
        x = torch.randn(len(token_slots), 24, device=DEVICE)
        context.activate(batch)
        got = layer(x)
        context.activate(None)
        assert layer.slots is not None
        want = _reference(
            layer.base_layer(x), x, batch, layer.slots.lora_a, layer.slots.lora_b,
            layer.slots.scales,
        )  # fmt: skip
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)

    for _ in range(3):
        step()
    assert len(checks) <= 1  # the first step only (a fresh table is built, not checked)
    pool.free(1)
    pool.load(1, _adapter(spec, 24, ["gate_proj"], seed=3))  # new tensors, another rank
    checks.clear()
    for _ in range(2):
        step()
    assert len(checks) == 1


class _OneLayer(torch.nn.Module):
    """A LoRA host with one decoder layer's MLP gate projection (HF names)."""

    def __init__(self, spec: BaseModelSpec) -> None:
        super().__init__()
        mlp = torch.nn.Module()
        mlp.gate_proj = torch.nn.Linear(*spec.module_shape("gate_proj")).to(DEVICE)
        block = torch.nn.Module()
        block.mlp = mlp
        self.layers = torch.nn.ModuleList([block])
        self.lora_context: LoRAContext | None = None


# Captured decode graphs.


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama with one KV head: the interpreter runs 256 rows of it in seconds."""
    from tests.factories import build_model

    return build_model(tmp_path_factory.mktemp("one-layer"), "llama", num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip


@pytest.fixture
def graph_model(one_layer_dir: Path) -> tuple[LlamaForCausalLM, LoRAPool]:
    """The model with four adapters of ranks 8 to 32 (all modules, q/v only, MLP only) in a
    pool the Triton kernels read, and a KV cache of random contents."""
    if not INTERPRETED:
        pytest.skip("runs the tiny model on CPU through Triton's interpreter")
    torch.manual_seed(7)
    model = load_model(one_layer_dir, torch.float32, DEVICE)
    spec = BaseModelSpec.from_dir(one_layer_dir)
    pool = LoRAPool(4, spec, torch.float32, DEVICE, b_transposed=False)
    install_lora(model, pool)
    loads = [(16, ALL), (8, ("q_proj", "v_proj")), (32, ("gate_proj", "up_proj", "down_proj")),
             (8, ALL)]  # fmt: skip
    for slot, (rank, modules) in enumerate(loads):
        assert pool.load(slot, _adapter(spec, rank, modules, seed=slot))
    model.allocate_kv_cache(BLOCKS, BLOCK_SIZE)
    assert model.kv_cache is not None
    model.kv_cache.copy_(torch.randn_like(model.kv_cache))
    return model, pool


BLOCK_SIZE, CONTEXT = 4, 6  # every row: 5 cached tokens and the one it decodes
BLOCKS = 2 * 256 + 1  # two blocks per row, and the padding rows' block (the last)


def _graphs(
    model: LlamaForCausalLM, pool: LoRAPool, max_batch: int, capture: Callable[[Forward], Forward]
) -> DecodeGraphs:
    shape = GraphShape(max_batch=max_batch, max_model_len=2 * BLOCK_SIZE, block_size=BLOCK_SIZE,
                       pad_block=BLOCKS - 1, max_lora_rank=32)  # fmt: skip
    return DecodeGraphs(model, pool, shape, capture)


def test_a_replayed_256_row_decode_step_over_several_adapters_equals_the_eager_torch_step(
    graph_model: tuple[LlamaForCausalLM, LoRAPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """256 single-token rows over four adapters and the base model through the graph of 256
    (BGMV over 256 tokens, Triton attention) against an eager step on the torch paths."""
    model, pool = graph_model
    rng = random.Random(5)
    rows = [
        StepRow([rng.randrange(100)], CONTEXT, [2 * i, 2 * i + 1], rng.choice([-1, 0, 1, 2, 3]))
        for i in range(256)
    ]
    assert model.kv_cache is not None
    cache = model.kv_cache.clone()
    monkeypatch.setenv(attention.ENV, "torch")
    monkeypatch.setenv(dispatch.ENV, "torch")
    step = build_step(rows, BLOCK_SIZE, DEVICE)
    with torch.inference_mode():
        want = model(step.input_ids, step.positions, step.attn, step.lora)
    model.kv_cache.copy_(cache)
    monkeypatch.setenv(attention.ENV, "triton")
    monkeypatch.setenv(dispatch.ENV, "triton-fused")  # a third of the pair's programs
    # capture without running: only the graph of 256 runs, once, at replay
    graphs = _graphs(model, pool, 256, capture=lambda forward: forward)
    got = graphs.run(rows)
    assert got is not None and graphs.replays == 1 and graphs.fallbacks == 0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class _Grids:
    """Stands in for a jitted kernel: records each launch's grid, launches nothing."""

    def __init__(self, log: list[tuple[int, ...]]) -> None:
        self.log = log

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        self.log.append(grid)
        return lambda *args, **kwargs: None


def _blocks(log: Sequence[tuple[int, ...]]) -> int:
    total = 0
    for grid in log:
        count = 1
        for g in grid:
            count *= g
        total += count
    return total


def test_a_captured_graphs_lora_launches_grow_linearly_with_the_batch(
    graph_model: tuple[LlamaForCausalLM, LoRAPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks launched by one decoder layer's LoRA modules on the graph's static batch (what
    its captured forward launches) at b = 64, 128, 256: about twice for twice the rows. The
    same counter over the former sizing (SGMV for b segments of b tokens) grows as b^2."""
    model, pool = graph_model
    monkeypatch.setenv(attention.ENV, "triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    log: list[tuple[int, ...]] = []
    for module, name in ((bt, "_bgmv_shrink_kernel"), (bt, "_bgmv_expand_kernel"),
                         (bt, "_bgmv_fused_kernel"), (st, "_shrink_kernel"),
                         (st, "_expand_kernel"), (st, "_fused_kernel")):  # fmt: skip
        monkeypatch.setattr(module, name, _Grids(log))
    graphs = _graphs(model, pool, 256, capture=lambda forward: forward)
    layer = [m for m in model.model.layers[0].modules() if isinstance(m, LinearWithLoRA)]
    assert len(layer) == 7
    blocks, former = {}, {}
    for b in (64, 128, 256):
        batch = graphs._static(b).lora
        assert batch.launch == BGMV and batch.token_order.numel() == b
        log.clear()
        for mod in layer:
            assert mod.slots is not None
            fan_in, fan_out = mod.base_layer.in_features, mod.base_layer.out_features
            x, y = torch.zeros(b, fan_in), torch.zeros(b, fan_out)
            dispatch.lora_apply(y, x, batch, mod.slots)
        blocks[b] = _blocks(log)
        log.clear()
        for mod in layer:  # the former launches: b segments sized for b tokens each
            assert mod.slots is not None and mod.slots.graph_table is not None
            x = torch.zeros(b, mod.base_layer.in_features)
            y = torch.zeros(b, mod.base_layer.out_features)
            st.lora_apply(y, x, batch.token_order, batch.seg_slots_t, batch.seg_bounds_t,
                          mod.slots.graph_table, mod.slots.scales, b)  # fmt: skip
        former[b] = _blocks(log)
    assert blocks[256] / blocks[128] <= 2.1 and blocks[128] / blocks[64] <= 2.1
    assert former[256] / former[128] >= 3.5  # the counter sees quadratic growth
    assert blocks[256] < former[256]
