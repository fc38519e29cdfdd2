"""DoRA's per-row rescale in the Triton kernels' epilogue and in captured decode graphs.

The torch path (`sgmv_torch` then `dora.rescale`) is the oracle: the SGMV and BGMV kernels,
pair and fused, with a table holding DoRA slots' g must give its result for a mix of DoRA,
plain LoRA, untargeted and base rows (fp32, 1e-5), with and without a bias, and leave every
row that is not DoRA bit for bit as a table without g does; without g (the negative control)
the DoRA rows differ. Then the decode graphs: a step with DoRA rows replays (no eager
fallback) and equals the eager torch step, their slot tables' g pointers follow the slots as
adapters come and go, and with the pointers zeroed the replay differs. Without CUDA the
kernels run in Triton's interpreter; the real capture is the `gpu` test at the end.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.dataplane.triton_mode import DEVICE, INTERPRETED, require_triton

require_triton()

from loraplane.adapters.base_model import BaseModelSpec  # noqa: E402
from loraplane.dataplane import attention  # noqa: E402
from loraplane.dataplane.cuda_graphs import (  # noqa: E402
    Capture,
    DecodeGraphs,
    GraphShape,
    cuda_capture,
)
from loraplane.dataplane.kernels import bgmv_triton as bt  # noqa: E402
from loraplane.dataplane.kernels import dispatch, sgmv_torch  # noqa: E402
from loraplane.dataplane.kernels import sgmv_triton as st  # noqa: E402
from loraplane.dataplane.lora import (  # noqa: E402
    LoadedAdapter,
    LoRABatch,
    LoRAPool,
    LoRAWeights,
    ModuleSlots,
    dora,
    install_lora,
)
from loraplane.dataplane.models.llama import LlamaForCausalLM  # noqa: E402
from loraplane.dataplane.models.loader import load_model  # noqa: E402
from loraplane.dataplane.step_metadata import StepRow, build_step  # noqa: E402
from tests.dataplane.conftest import _perturb  # noqa: E402

ATOL = RTOL = 1e-5  # fp32
FAN_IN, FAN_OUT = 40, 24  # not multiples of the tiles: masks are exercised
# slot -> (rank, DoRA): DoRA, plain, untargeted, DoRA, plain
SLOTS: list[tuple[int | None, bool]] = [(8, True), (16, False), (None, False), (16, True),
                                        (8, False)]  # fmt: skip
TOKEN_SLOTS = [0, -1, 1, 3, 3, 2, 0, 4, -1, 1, 0, 3, 4, 2, 0, 1]


def _module_slots(seed: int) -> ModuleSlots:
    """One module's slots as the pool holds them: A, B and scales, g in [0.5, 1.5] for DoRA."""
    gen = torch.Generator().manual_seed(seed)
    slots = ModuleSlots(len(SLOTS), DEVICE)
    for k, (rank, is_dora) in enumerate(SLOTS):
        if rank is None:
            continue
        slots.lora_a[k] = (torch.randn(rank, FAN_IN, generator=gen) / FAN_IN**0.5).to(DEVICE)
        slots.lora_b[k] = (torch.randn(FAN_OUT, rank, generator=gen) / rank**0.5).to(DEVICE)
        slots.scales[k] = 0.5 + k / 4
        if is_dora:
            slots.dora[k] = (0.5 + torch.rand(FAN_OUT, generator=gen)).to(DEVICE)
            slots.dora_mask |= 1 << k
    return slots


def _torch_path(
    y: torch.Tensor,
    x: torch.Tensor,
    batch: LoRABatch,
    slots: ModuleSlots,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The oracle: sgmv_torch's update, then dora.rescale on the DoRA rows (the torch and
    native paths' way)."""
    out = sgmv_torch.lora_apply(
        y.clone(), x, batch.token_order, batch.seg_slots, batch.seg_bounds, slots.lora_a,
        slots.lora_b, slots.scales,
    )  # fmt: skip
    dora.rescale(out, slots, dora.dora_rows(batch, slots), bias)
    return out


def _kernel(
    kind: str,
    fused: bool,
    y: torch.Tensor,
    x: torch.Tensor,
    batch: LoRABatch,
    table: st.SlotWeights,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    out = y.clone()
    if kind == "bgmv":
        bt.lora_apply(out, x, batch.token_order, batch.token_slots, table, scales, fused=fused,
                      bias=bias)  # fmt: skip
    else:
        st.lora_apply(out, x, batch.token_order, batch.seg_slots_t, batch.seg_bounds_t, table,
                      scales, batch.max_seg_len, fused=fused, bias=bias)  # fmt: skip
    return out


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_the_kernels_rescale_dora_rows_as_the_torch_path_and_leave_other_rows_as_plain_lora(
    kind: str, fused: bool, with_bias: bool
) -> None:
    slots = _module_slots(seed=1)
    gen = torch.Generator().manual_seed(2)
    batch = LoRABatch.from_token_slots(TOKEN_SLOTS, device=DEVICE)
    x = torch.randn(len(TOKEN_SLOTS), FAN_IN, generator=gen).to(DEVICE)
    y = torch.randn(len(TOKEN_SLOTS), FAN_OUT, generator=gen).to(DEVICE)  # base output + bias
    bias = torch.randn(FAN_OUT, generator=gen).to(DEVICE) if with_bias else None
    want = _torch_path(y, x, batch, slots, bias)
    table = st.SlotWeights.build(slots.lora_a, slots.lora_b, torch.float32, DEVICE, slots.dora)
    assert table.dora and table.g_ptrs_host[1] == table.g_ptrs_host[2] == 0
    got = _kernel(kind, fused, y, x, batch, table, slots.scales, bias)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # a table without g: plain LoRA everywhere (the kernels as they were before DoRA)
    plain_table = st.SlotWeights.build(slots.lora_a, slots.lora_b, torch.float32, DEVICE)
    assert not plain_table.dora
    plain = _kernel(kind, fused, y, x, batch, plain_table, slots.scales, bias)
    dora_rows = [t for t, s in enumerate(TOKEN_SLOTS) if s in (0, 3)]
    others = [t for t, s in enumerate(TOKEN_SLOTS) if s not in (0, 3)]
    assert torch.equal(got[others], plain[others])  # plain, untargeted and base rows: bit for bit
    assert torch.equal(got[[t for t, s in enumerate(TOKEN_SLOTS) if s in (-1, 2)]],
                       y[[t for t, s in enumerate(TOKEN_SLOTS) if s in (-1, 2)]])  # fmt: skip
    # the negative control: without the rescale the DoRA rows are not the torch path's
    assert (plain[dora_rows] - want[dora_rows]).abs().max() > 1e-2


def test_a_table_refuses_a_dora_scale_that_does_not_fit_naming_the_slot() -> None:
    slots = _module_slots(seed=3)
    a, b = slots.lora_a, slots.lora_b
    for bad, message in (
        (torch.ones(FAN_OUT + 1, device=DEVICE), r"dora\[0\] has 25 rows; B has 24"),
        (torch.ones(FAN_OUT, dtype=torch.float16, device=DEVICE), r"dora\[0\] must be .* fp32"),
    ):
        with pytest.raises(ValueError, match=message):
            st.SlotWeights.build(a, b, torch.float32, DEVICE, [bad, None, None, None, None])
    with pytest.raises(ValueError, match=r"dora\[2\]: a DoRA scale on a slot that does not"):
        st.SlotWeights.build(a, b, torch.float32, DEVICE, [None, None, torch.ones(FAN_OUT), None,
                                                           None])  # fmt: skip
    table = st.SlotWeights.build(a, b, torch.float32, DEVICE, slots.dora)
    batch = LoRABatch.from_token_slots(TOKEN_SLOTS, device=DEVICE)
    y = torch.zeros(len(TOKEN_SLOTS), FAN_OUT, device=DEVICE)
    x = torch.zeros(len(TOKEN_SLOTS), FAN_IN, device=DEVICE)
    with pytest.raises(ValueError, match="bias has 23 rows; the weights want 24"):
        bt.lora_apply(y, x, batch.token_order, batch.token_slots, table, slots.scales,
                      bias=torch.zeros(FAN_OUT - 1, device=DEVICE))  # fmt: skip


# Captured decode graphs.

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
BLOCK_SIZE, CONTEXT, ROWS = 4, 6, 12  # every row: 5 cached tokens and the one it decodes
BLOCKS = 2 * ROWS + 1  # two blocks per row, and the padding rows' block (the last)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Qwen2 (q/k/v biases, moved away from 0: DoRA leaves them out of its
    scaling, which a zero bias would not show)."""
    from tests.factories import build_model

    path = build_model(tmp_path_factory.mktemp("dora-graphs"), "qwen2", num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    _perturb(path, seed=7)
    return path


def _adapter(
    model: LlamaForCausalLM, spec: BaseModelSpec, rank: int, modules: Sequence[str], seed: int,
    *, is_dora: bool,
) -> LoadedAdapter:  # fmt: skip
    """Random A and B; a DoRA one's m = ||W + s B A||_row times [0.5, 1.5] (g in that range)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for module in modules:
        fan_in, fan_out = spec.module_shape(module)
        a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
        b = torch.randn(fan_out, rank, generator=gen) / rank**0.5
        scale, magnitude = 2.0 / rank, None
        if is_dora:
            block = "self_attn" if module in ATTENTION else "mlp"
            linear = model.get_submodule(f"model.layers.0.{block}.{module}").base_layer
            norm = torch.linalg.norm(linear.weight.detach().cpu() + scale * (b @ a), dim=1)
            magnitude = norm * (0.5 + torch.rand(fan_out, generator=gen))
        weights[(0, module)] = LoRAWeights(a, b, scale, magnitude=magnitude)
    return LoadedAdapter(f"r{rank}-{seed}", weights)


def _model(qwen2_dir: Path) -> tuple[LlamaForCausalLM, LoRAPool, list[LoadedAdapter]]:
    """The model and a pool the Triton kernels read holding, in slots 0-2: DoRA on every
    module (r16), plain LoRA on q/v (r8), DoRA on the attention (r8); a KV cache of random
    contents. Also a fourth adapter, plain r16 on every module, not loaded."""
    torch.manual_seed(7)
    model = load_model(qwen2_dir, torch.float32, DEVICE)
    spec = BaseModelSpec.from_dir(qwen2_dir)
    pool = LoRAPool(4, spec, torch.float32, DEVICE, b_transposed=False)
    install_lora(model, pool)
    adapters = [
        _adapter(model, spec, 16, ALL, seed=0, is_dora=True),
        _adapter(model, spec, 8, ("q_proj", "v_proj"), seed=1, is_dora=False),
        _adapter(model, spec, 8, ATTENTION, seed=2, is_dora=True),
        _adapter(model, spec, 16, ALL, seed=3, is_dora=False),
    ]
    for slot, adapter in enumerate(adapters[:3]):
        assert pool.load(slot, adapter)
    model.allocate_kv_cache(BLOCKS, BLOCK_SIZE)
    assert model.kv_cache is not None
    model.kv_cache.copy_(torch.randn_like(model.kv_cache))
    return model, pool, adapters


def _graphs(model: LlamaForCausalLM, pool: LoRAPool, capture: Capture) -> DecodeGraphs:
    shape = GraphShape(max_batch=ROWS, max_model_len=2 * BLOCK_SIZE, block_size=BLOCK_SIZE,
                       pad_block=BLOCKS - 1, max_lora_rank=16)  # fmt: skip
    return DecodeGraphs(model, pool, shape, capture)


def _rows(slots: Sequence[int], seed: int) -> list[StepRow]:
    rng = random.Random(seed)
    return [StepRow([rng.randrange(100)], CONTEXT, [2 * i, 2 * i + 1], slot)
            for i, slot in enumerate(slots)]  # fmt: skip


def _replay_equals_the_eager_torch_step(
    qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch, capture: Capture, atol: float
) -> None:
    """A decode step of DoRA, plain and base rows (fewer than the graph's rows: padding)
    replayed from its graph equals the eager step on the torch paths; with the graph tables'
    g pointers zeroed (the rescale off) the replay differs on the DoRA rows."""
    model, pool, _ = _model(qwen2_dir)
    slots = [0, -1, 1, 2, 0, 2, 1, -1, 0, 2, 1]  # 11 rows: the graph of 12, one padding row
    rows = _rows(slots, seed=5)
    assert model.kv_cache is not None
    cache = model.kv_cache.clone()
    monkeypatch.setenv(attention.ENV, "torch")
    monkeypatch.setenv(dispatch.ENV, "torch")
    step = build_step(rows, BLOCK_SIZE, DEVICE)
    with torch.inference_mode():
        want = model(step.input_ids, step.positions, step.attn, step.lora)
    monkeypatch.setenv(attention.ENV, "triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    graphs = _graphs(model, pool, capture)
    model.kv_cache.copy_(cache)
    got = graphs.run(rows)
    assert got is not None and graphs.replays == 1 and graphs.fallbacks == 0
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    for table in pool.modules.values():  # the negative control: g pointers 0, no rescale
        assert table.graph_table is not None
        table.graph_table.g_ptrs.zero_()  # (a view of the graphs' static buffer)
    model.kv_cache.copy_(cache)
    off = graphs.run(rows)
    assert off is not None and graphs.replays == 2
    dora_rows = [i for i, s in enumerate(slots) if s in (0, 2)]
    plain_rows = [i for i, s in enumerate(slots) if s not in (0, 2)]
    assert (off[dora_rows] - want[dora_rows]).abs().max() > 1e-2
    torch.testing.assert_close(off[plain_rows], want[plain_rows], atol=atol, rtol=atol)


def test_a_replayed_decode_step_with_dora_rows_equals_the_eager_torch_step(
    qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not INTERPRETED:
        pytest.skip("runs the model on CPU through Triton's interpreter (GPU: the gpu test)")
    # captured without running: the graph runs once, at replay, as a CUDA graph would
    _replay_equals_the_eager_torch_step(qwen2_dir, monkeypatch, lambda f: f, atol=ATOL)


def test_the_graph_tables_g_pointers_follow_the_slots_as_adapters_come_and_go(
    qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each replayed step refreshes its slots' entries: a DoRA slot's g pointer per module
    (0 where it does not adapt the module), 0 for a plain slot; a slot emptied and refilled
    with a plain adapter reads 0, one refilled with a DoRA adapter its new g."""
    if not INTERPRETED:
        pytest.skip("runs the model on CPU through Triton's interpreter")
    monkeypatch.setenv(attention.ENV, "triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    model, pool, adapters = _model(qwen2_dir)
    graphs = _graphs(model, pool, lambda f: f)
    tables = list(pool.modules.values())

    def entries(slot: int) -> list[int]:
        out = []
        for slots in tables:
            assert slots.graph_table is not None and slots.graph_table.dora
            out.append(int(slots.graph_table.g_ptrs[slot]))
        return out

    def pointers(slot: int) -> list[int]:
        return [g.data_ptr() if (g := slots.dora[slot]) is not None else 0 for slots in tables]

    assert graphs.run(_rows([0, 1, 2, -1], seed=1)) is not None
    for slot in range(3):
        assert entries(slot) == pointers(slot)
    assert all(entries(0)) and not any(entries(1))
    assert 0 < sum(map(bool, entries(2))) < len(tables)  # the attention's modules only
    pool.free(0)
    assert pool.load(0, adapters[3])  # plain, every module: the g pointers go to 0
    pool.free(1)
    assert pool.load(1, adapters[0])  # DoRA where plain LoRA was
    assert graphs.run(_rows([1, 0], seed=2)) is not None
    assert not any(entries(0)) and all(entries(1)) and entries(1) == pointers(1)
    assert graphs.fallbacks == 0 and graphs.replays == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
def test_on_cuda_a_captured_decode_graph_with_dora_rows_equals_the_eager_torch_step(
    qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same step through a real CUDA graph: its g pointers and bias read at replay."""
    _replay_equals_the_eager_torch_step(qwen2_dir, monkeypatch, cuda_capture(), atol=1e-4)
