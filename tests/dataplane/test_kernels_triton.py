"""The Triton SGMV kernels against the torch reference: mixed ranks, segments, dtypes, dispatch.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set
here before Triton is imported); bf16 `tl.dot` is wrong in the interpreter, so bf16 is only
tested on a GPU. With CUDA and TRITON_INTERPRET unset, the same tests run the compiled kernels
on CUDA tensors. Shapes stay small: the interpreter is slow.
"""

from __future__ import annotations

import itertools
import random
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from tests.dataplane.triton_mode import DEVICE, INTERPRETED, require_triton

require_triton()

from loraplane.adapters.base_model import BaseModelSpec  # noqa: E402
from loraplane.dataplane.kernels import dispatch, sgmv_torch  # noqa: E402
from loraplane.dataplane.kernels import sgmv_triton as st  # noqa: E402
from loraplane.dataplane.lora import (  # noqa: E402
    LinearWithLoRA,
    LoadedAdapter,
    LoRABatch,
    LoRAContext,
    LoRAPool,
    LoRAWeights,
    ModuleSlots,
)
from tests.dataplane.conftest import compile_without_gpu  # noqa: E402

if INTERPRETED and type(st._shrink_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "sgmv_triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

TOLERANCE = {  # dtype -> (atol, rtol) against the fp32 torch reference
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (1e-1, 5e-2),
}
# Slot 3 does not target the module; rank 128 sits next to rank 1 in one launch.
RANKS: list[int | None] = [1, 128, 8, None, 16, 3, 64, 33]
FAN_IN, FAN_OUT = 48, 40  # not multiples of the tiles: masks are exercised
SPLIT = st.KernelConfig(block_k=16, split_k=2)  # several k steps and the atomic-add path


def _pool_like(
    ranks: Sequence[int | None], fan_in: int, fan_out: int, dtype: torch.dtype, seed: int = 0
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], torch.Tensor]:
    """Per-slot A [r, in] and B [out, r] as views into one flat buffer each, like the pool."""
    gen = torch.Generator().manual_seed(seed)
    lora_a: list[torch.Tensor | None] = []
    lora_b: list[torch.Tensor | None] = []
    for r in ranks:
        if r is None:
            lora_a.append(None)
            lora_b.append(None)
            continue
        buffer = torch.empty(r * (fan_in + fan_out), dtype=dtype, device=DEVICE)
        a = buffer[: r * fan_in].view(r, fan_in)
        b = buffer[r * fan_in :].view(fan_out, r)
        # unit-variance h and y whatever the shape, so one tolerance fits all
        a.copy_(torch.randn(r, fan_in, generator=gen) / fan_in**0.5)
        b.copy_(torch.randn(fan_out, r, generator=gen) / r**0.5)
        lora_a.append(a)
        lora_b.append(b)
    scales = (torch.rand(len(ranks), generator=gen) * 2 + 0.1).to(DEVICE)
    return lora_a, lora_b, scales


def _fp32(ts: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.float().cpu() for t in ts]


def _reference(
    y: torch.Tensor,
    x: torch.Tensor,
    order: torch.Tensor,
    seg_slots: Sequence[int],
    seg_bounds: Sequence[int],
    lora_a: Sequence[torch.Tensor | None],
    lora_b: Sequence[torch.Tensor | None],
    scales: torch.Tensor,
) -> torch.Tensor:
    """sgmv_torch.lora_apply on fp32 CPU copies of everything."""
    return sgmv_torch.lora_apply(
        y.float().cpu(),
        x.float().cpu(),
        order.cpu(),
        seg_slots,
        seg_bounds,
        _fp32(lora_a),
        _fp32(lora_b),
        scales.cpu(),
    )


def _segments(
    seg_slots: Sequence[int], seg_bounds: Sequence[int], order: torch.Tensor
) -> dict[str, Any]:
    """Device tensors and the longest segment for the Triton launchers."""
    return {
        "token_order": order.to(DEVICE),
        "seg_slots": torch.tensor(seg_slots, dtype=torch.int32, device=DEVICE),
        "seg_bounds": torch.tensor(seg_bounds, dtype=torch.int32, device=DEVICE),
        "max_seg_len": max((e - s for s, e in itertools.pairwise(seg_bounds)), default=0),
    }


def _batch(seed: int, tokens: int) -> tuple[list[int], LoRABatch]:
    """Token slots with base tokens interleaved, slot 6 unused and slot 2 holding a long run."""
    rng = random.Random(seed)
    token_slots = [rng.choice([-1, -1, 0, 1, 3, 4, 5, 7]) for _ in range(tokens)]
    for t in rng.sample(range(tokens), 40):  # one segment spans several token blocks
        token_slots[t] = 2
    return token_slots, LoRABatch.from_token_slots(token_slots, device=DEVICE)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any kernel launch fail the test."""

    class _Forbidden:
        def __getitem__(self, grid: object) -> None:
            raise AssertionError("a kernel was launched")

    for name in ("_shrink_kernel", "_expand_kernel", "_fused_kernel"):
        monkeypatch.setattr(st, name, _Forbidden())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
@pytest.mark.parametrize("config", [None, SPLIT], ids=["default", "split-k"])
def test_lora_apply_matches_torch_for_mixed_ranks_base_tokens_and_untargeted_slots(
    dtype: torch.dtype, fused: bool, config: st.KernelConfig | None
) -> None:
    seed = 1 if config is None else 2
    torch.manual_seed(seed)
    lora_a, lora_b, scales = _pool_like(RANKS, FAN_IN, FAN_OUT, dtype, seed)
    token_slots, batch = _batch(seed, tokens=72)
    x = torch.randn(len(token_slots), FAN_IN).to(DEVICE, dtype)
    y = torch.randn(len(token_slots), FAN_OUT).to(DEVICE, dtype)
    expected = _reference(
        y, x, batch.token_order, batch.seg_slots, batch.seg_bounds, lora_a, lora_b, scales
    )
    weights = st.SlotWeights.build(lora_a, lora_b, dtype, DEVICE)
    before = y.clone()
    got = st.lora_apply(
        y,
        x,
        **_segments(batch.seg_slots, batch.seg_bounds, batch.token_order),
        weights=weights,
        scales=scales,
        fused=fused,
        config=config,
    )
    assert got is y  # accumulated in place
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), expected, atol=atol, rtol=rtol)
    untouched = [t for t, s in enumerate(token_slots) if s in (-1, 3)]  # base, untargeted
    assert torch.equal(got[untouched], before[untouched])


def test_lora_apply_reads_no_intermediate_it_did_not_write_when_it_skips_the_memset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a split k the pair's intermediate is not zeroed (one launch less per layer
    call): every torch.empty inside the call comes back poisoned with NaN, and the result
    must still be the reference, untouched rows included (ranks below the table's largest,
    base tokens and untargeted slots leave columns and rows unwritten)."""
    lora_a, lora_b, scales = _pool_like(RANKS, FAN_IN, FAN_OUT, torch.float32, seed=4)
    token_slots, batch = _batch(4, tokens=72)
    x = torch.randn(len(token_slots), FAN_IN, device=DEVICE)
    y = torch.randn(len(token_slots), FAN_OUT, device=DEVICE)
    expected = _reference(
        y, x, batch.token_order, batch.seg_slots, batch.seg_bounds, lora_a, lora_b, scales
    )
    weights = st.SlotWeights.build(lora_a, lora_b, torch.float32, DEVICE)
    segs = _segments(batch.seg_slots, batch.seg_bounds, batch.token_order)
    real = torch.empty
    poisoned: list[torch.Tensor] = []

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real(*args, **kwargs)
        t.fill_(float("nan") if t.is_floating_point() else -7)
        poisoned.append(t)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    config = st.KernelConfig(block_m=16, block_n=32, block_k=32, block_r=16, split_k=1)
    got = st.lora_apply(y, x, **segs, weights=weights, scales=scales, config=config)
    monkeypatch.undo()
    assert any(t.shape == (batch.token_order.numel(), 128) for t in poisoned)  # h was empty
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_writes_each_segment_at_its_own_rank_and_expand_adds_scaled_products(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(3)
    lora_a, lora_b, scales = _pool_like(RANKS, FAN_IN, FAN_OUT, dtype, seed=3)
    # explicit segments: an empty one first, one of 37 tokens (3 blocks), an untargeted one
    seg_slots, seg_bounds = [2, 0, 6, 3, 1, 7], [0, 0, 1, 38, 40, 45, 47]
    order = torch.randperm(60)[:47]
    x = torch.randn(60, FAN_IN).to(DEVICE, dtype)
    segs = _segments(seg_slots, seg_bounds, order)
    weights = st.SlotWeights.build(lora_a, lora_b, dtype, DEVICE)
    h = st.sgmv_shrink(x, weights=weights, config=SPLIT, **segs)
    assert h.shape == (47, 128) and h.dtype == torch.float32
    h_ref = sgmv_torch.sgmv_shrink(x.float().cpu(), order, seg_slots, seg_bounds, _fp32(lora_a))
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(h.cpu(), h_ref, atol=atol, rtol=rtol)
    assert not h[38:40].any()  # slot 3 does not target the module
    assert not h[1:38, 64:].any()  # slot 6 is rank 64: nothing past it

    y = torch.randn(60, FAN_OUT).to(DEVICE, dtype)
    y_ref = sgmv_torch.sgmv_expand(
        y.float().cpu(), h.cpu(), order, seg_slots, seg_bounds, _fp32(lora_b), scales.cpu()
    )
    got = st.sgmv_expand(y, h, weights=weights, scales=scales, **segs)
    torch.testing.assert_close(got.float().cpu(), y_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
def test_lora_apply_with_no_adapter_tokens_returns_y_unchanged_without_launching(
    no_launch: None, fused: bool
) -> None:
    lora_a, lora_b, scales = _pool_like(RANKS, FAN_IN, FAN_OUT, torch.float32)
    weights = st.SlotWeights.build(lora_a, lora_b, torch.float32, DEVICE)
    x, y = torch.randn(5, FAN_IN, device=DEVICE), torch.randn(5, FAN_OUT, device=DEVICE)
    before = y.clone()
    empty = _segments([], [0], torch.empty(0, dtype=torch.int64))
    assert st.lora_apply(y, x, weights=weights, scales=scales, fused=fused, **empty) is y
    assert torch.equal(y, before)
    # a module no loaded adapter targets: every rank is 0
    none = st.SlotWeights.build([None, None], [None, None], torch.float32, DEVICE)
    zeros = torch.zeros(2, device=DEVICE)
    segs = _segments([0], [0, 1], torch.tensor([0]))
    assert st.lora_apply(y, x, weights=none, scales=zeros, fused=fused, **segs) is y
    assert torch.equal(y, before)


def _bad_inputs() -> Iterator[Any]:
    """(argument named in the error, launcher kwargs override)."""
    yield pytest.param("x", {"x": torch.randn(4, FAN_IN, dtype=torch.float64)}, id="x-dtype")
    yield pytest.param("x", {"x": torch.randn(FAN_IN, 4).t()}, id="x-non-contiguous")
    yield pytest.param("x", {"x": torch.randn(4, FAN_IN + 1)}, id="x-features")
    yield pytest.param("y", {"y": torch.randn(4, FAN_OUT, 1)}, id="y-3d")
    yield pytest.param("rows", {"y": torch.randn(5, FAN_OUT)}, id="y-rows")
    yield pytest.param("token_order", {"token_order": torch.tensor([0, 1], dtype=torch.int32)})
    yield pytest.param("seg_slots", {"seg_slots": torch.tensor([0], dtype=torch.int64)})
    yield pytest.param("seg_bounds", {"seg_bounds": torch.tensor([0, 2, 2], dtype=torch.int32)})
    yield pytest.param("max_seg_len", {"max_seg_len": 3})
    yield pytest.param("scales", {"scales": torch.ones(len(RANKS) - 1)}, id="scales-size")
    yield pytest.param("scales", {"scales": torch.ones(len(RANKS), dtype=torch.float16)})


@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
def test_segments_of_untargeted_slots_leave_y_unchanged(fused: bool) -> None:
    # the launcher sees only device tensors, so it launches; every program exits at once
    # (dispatch.lora_apply skips the launch: it checks the host seg_slots)
    lora_a, lora_b, scales = _pool_like(RANKS, FAN_IN, FAN_OUT, torch.float32)
    weights = st.SlotWeights.build(lora_a, lora_b, torch.float32, DEVICE)
    x, y = torch.randn(5, FAN_IN, device=DEVICE), torch.randn(5, FAN_OUT, device=DEVICE)
    before = y.clone()
    untargeted = _segments([3], [0, 2], torch.tensor([4, 1]))
    assert st.lora_apply(y, x, weights=weights, scales=scales, fused=fused, **untargeted) is y
    assert torch.equal(y, before)


@pytest.mark.parametrize(("name", "override"), list(_bad_inputs()))
def test_lora_apply_rejects_bad_inputs_with_ValueError_naming_the_argument(
    no_launch: None, name: str, override: dict[str, Any]
) -> None:
    lora_a, lora_b, scales = _pool_like(RANKS, FAN_IN, FAN_OUT, torch.float32)
    kwargs: dict[str, Any] = {
        "y": torch.randn(4, FAN_OUT),
        "x": torch.randn(4, FAN_IN),
        "weights": st.SlotWeights.build(lora_a, lora_b, torch.float32, DEVICE),
        "scales": scales,
        **_segments([0], [0, 2], torch.tensor([0, 1])),
    }
    kwargs.update(override)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=name):
        st.lora_apply(**kwargs)


def test_expand_rejects_an_intermediate_narrower_than_the_largest_rank() -> None:
    lora_a, lora_b, scales = _pool_like([4, 16], 16, 16, torch.float32)
    weights = st.SlotWeights.build(lora_a, lora_b, torch.float32, DEVICE)
    y, h = torch.zeros(2, 16, device=DEVICE), torch.zeros(2, 8, device=DEVICE)
    segs = _segments([0], [0, 2], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="h must be fp32"):
        st.sgmv_expand(y, h, weights=weights, scales=scales, **segs)


def test_slot_table_rejects_bad_weights_with_ValueError_naming_the_slot() -> None:
    a, b = torch.randn(4, 16), torch.randn(16, 4)
    cases: list[tuple[str, list[Any], list[Any], torch.dtype]] = [
        ("must both be set or both None", [a], [None], torch.float32),
        ("lora_a\\[0\\] must be a contiguous", [torch.randn(16, 4).t()], [b], torch.float32),
        ("lora_b\\[0\\] is torch.float16", [a], [b.half()], torch.float32),
        ("slot 0: A", [a], [torch.randn(16, 5)], torch.float32),
        ("slot 1: A", [a, torch.randn(4, 17)], [b, b], torch.float32),
        ("dtype must be one of", [a], [b], torch.float64),
        ("lora_a has 2 slots", [a, None], [b], torch.float32),
    ]
    for match, lora_a, lora_b, dtype in cases:
        with pytest.raises(ValueError, match=match):
            st.SlotWeights.build(lora_a, lora_b, dtype, "cpu")
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        st.KernelConfig(block_n=96)
    with pytest.raises(ValueError, match="block_m must be >= 16"):
        st.KernelConfig(block_m=8)


def _module_slots(
    ranks: Sequence[int | None], dtype: torch.dtype
) -> tuple[ModuleSlots, list[torch.Tensor | None], list[torch.Tensor | None]]:
    lora_a, lora_b, scales = _pool_like(ranks, FAN_IN, FAN_OUT, dtype)
    slots = ModuleSlots(len(ranks), DEVICE)
    slots.lora_a[:], slots.lora_b[:] = lora_a, lora_b
    slots.scales.copy_(scales)
    return slots, lora_a, lora_b


@pytest.mark.parametrize("backend", ["triton", "triton-fused", "torch"])
def test_dispatch_lora_apply_matches_torch_with_every_backend(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    monkeypatch.setenv(dispatch.ENV, backend)
    slots, lora_a, lora_b = _module_slots(RANKS, torch.float32)
    _, batch = _batch(seed=5, tokens=60)
    x = torch.randn(60, FAN_IN, device=DEVICE)
    y = torch.randn(60, FAN_OUT, device=DEVICE)
    expected = _reference(
        y, x, batch.token_order, batch.seg_slots, batch.seg_bounds, lora_a, lora_b, slots.scales
    )
    assert dispatch.backend(x) == backend
    got = dispatch.lora_apply(y, x, batch, slots)
    assert got is y
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_dispatch_picks_triton_for_cuda_and_native_or_torch_for_cpu_unless_overridden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loraplane.dataplane.kernels import sgmv_cpu

    monkeypatch.delenv(dispatch.ENV, raising=False)
    native = "native" if sgmv_cpu.library() is not None else "torch"
    assert dispatch.backend(torch.zeros(1)) == native
    assert dispatch.backend(torch.zeros(1, dtype=torch.bfloat16)) == "torch"  # fp32 only
    if torch.cuda.is_available():
        assert dispatch.backend(torch.zeros(1, device="cuda")) == "triton"
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert dispatch.backend(torch.zeros(1)) == "torch"
    if torch.cuda.is_available():  # forced, as the setting says
        assert dispatch.backend(torch.zeros(1, device="cuda")) == "torch"
    monkeypatch.setenv(dispatch.ENV, "cuda-please")
    with pytest.raises(ValueError, match=dispatch.ENV):
        dispatch.backend(torch.zeros(1))


def test_dispatch_with_only_base_or_untargeted_tokens_launches_nothing(
    monkeypatch: pytest.MonkeyPatch, no_launch: None
) -> None:
    monkeypatch.setenv(dispatch.ENV, "triton")
    slots, _, _ = _module_slots(RANKS, torch.float32)
    x, y = torch.randn(4, FAN_IN, device=DEVICE), torch.randn(4, FAN_OUT, device=DEVICE)
    before = y.clone()
    for token_slots in ([-1, -1, -1, -1], [3, -1, 3, 3]):
        batch = LoRABatch.from_token_slots(token_slots, device=DEVICE)
        assert dispatch.lora_apply(y, x, batch, slots) is y
        assert torch.equal(y, before)


def test_slot_table_is_cached_and_rebuilt_when_a_used_slot_gets_new_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(dispatch.ENV, "triton")
    slots, _, _ = _module_slots([4, 16, None], torch.float32)
    first = dispatch.slot_weights(slots, [0, 1], torch.float32, DEVICE)
    assert dispatch.slot_weights(slots, [0, 1], torch.float32, DEVICE) is first
    # the pool frees slot 1 and loads a rank-8 adapter there, and one into slot 2
    new_a, new_b, _ = _pool_like([8, 2], FAN_IN, FAN_OUT, torch.float32, seed=9)
    slots.lora_a[1], slots.lora_b[1] = new_a[0], new_b[0]
    slots.lora_a[2], slots.lora_b[2] = new_a[1], new_b[1]
    assert dispatch.slot_weights(slots, [0], torch.float32, DEVICE) is first  # slot 1 unused
    second = dispatch.slot_weights(slots, [1], torch.float32, DEVICE)
    assert second is not first and second.ranks_host == (4, 8, 2)
    assert second.ranks is first.ranks  # refilled in place: captured addresses stay valid
    assert second.ranks.tolist() == [4, 8, 2]
    assert second.a_ptrs.tolist() == [first.a_ptrs_host[0], *second.a_ptrs_host[1:]]
    reloaded = new_a[0]
    assert reloaded is not None and second.a_ptrs_host[1] == reloaded.data_ptr()
    batch = LoRABatch.from_token_slots([2, 1, -1, 1], device=DEVICE)
    x, y = torch.randn(4, FAN_IN, device=DEVICE), torch.randn(4, FAN_OUT, device=DEVICE)
    expected = _reference(
        y,
        x,
        batch.token_order,
        batch.seg_slots,
        batch.seg_bounds,
        slots.lora_a,
        slots.lora_b,
        slots.scales,
    )
    got = dispatch.lora_apply(y, x, batch, slots)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


class _DispatchedLinear(LinearWithLoRA):
    """LinearWithLoRA with the one-line change that wires the kernels in (see dispatch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y: torch.Tensor = self.base_layer(x)
        batch = self.context.batch if self.context is not None else None
        if batch is None or batch.is_empty or self.slots is None:
            return y
        return dispatch.lora_apply(y, x, batch, self.slots)


def test_wired_layer_over_a_real_pool_matches_the_torch_layer_across_free_and_reload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(dispatch.ENV, "triton")
    torch.manual_seed(4)
    # hidden 24, MLP 40: gate is 24 -> 40, down 40 -> 24
    spec = BaseModelSpec("m", "llama", 1, 24, 40, 2, 2, 12)
    pool = LoRAPool(3, spec, torch.float32, DEVICE)

    def adapter(rank: int, modules: Sequence[str]) -> LoadedAdapter:
        weights = {}
        for module in modules:
            fan_in, fan_out = spec.module_shape(module)
            a, b = torch.randn(rank, fan_in) / fan_in**0.5, torch.randn(fan_out, rank) / rank**0.5
            weights[(0, module)] = LoRAWeights(a, b, 2.0 / rank)
        return LoadedAdapter(f"r{rank}", weights)

    pool.load(0, adapter(3, ["gate_proj", "down_proj"]))
    pool.load(1, adapter(64, ["gate_proj"]))  # does not target down_proj
    pool.load(2, adapter(16, ["gate_proj", "down_proj"]))
    context = LoRAContext(pool)
    layers = {}
    for module in ("gate_proj", "down_proj"):
        fan_in, fan_out = spec.module_shape(module)
        base = torch.nn.Linear(fan_in, fan_out).to(DEVICE)
        for cls in (LinearWithLoRA, _DispatchedLinear):
            layer = cls(base, 0, module)
            layer.bind(pool.module_slots(0, module), context)
            layers[module, cls] = layer
    token_slots = [2, -1, 0, 1, 1, 2, -1, 0, 2, 1]
    for step in range(2):
        context.activate(LoRABatch.from_token_slots(token_slots, device=DEVICE))
        for module in ("gate_proj", "down_proj"):
            x = torch.randn(len(token_slots), spec.module_shape(module)[0], device=DEVICE)
            want = layers[module, LinearWithLoRA](x)
            got = layers[module, _DispatchedLinear](x)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the pool frees slot 0 and loads an adapter of another rank there
        pool.free(0)
        pool.load(0, adapter(8 + step, ["down_proj"]))


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from loraplane.dataplane.kernels import bgmv_triton as bt
    from loraplane.dataplane.kernels import sgmv_triton as st

    COMMON = {"token_order_ptr": "*i64", "seg_slots_ptr": "*i32", "seg_bounds_ptr": "*i32",
              "ranks_ptr": "*i32", "g_ptrs_ptr": "*i64"}
    # the kernels that store y, with DoRA's epilogue (g per slot, bias left out) compiled in
    DORA = {"DORA": True, "HAS_BIAS": True}
    def kernels(dt):
        return [
            (st._shrink_kernel, {"x_ptr": dt, "h_ptr": "*fp32", "a_ptrs_ptr": "*i64",
              "in_features": "i32", "h_stride": "i32", "num_r_blocks": "i32"},
             {"BLOCK_M": 16, "BLOCK_K": 128, "BLOCK_R": 16, "SPLIT_K": 8}),
            (st._expand_kernel, {"h_ptr": "*fp32", "y_ptr": dt, "b_ptrs_ptr": "*i64",
              "scales_ptr": "*fp32", "bias_ptr": dt, "out_features": "i32",
              "h_stride": "i32", "num_n_blocks": "i32"},
             {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_R": 16, "RANK_MULTIPLE": 8, **DORA}),
            (st._fused_kernel, {"x_ptr": dt, "y_ptr": dt, "a_ptrs_ptr": "*i64",
              "b_ptrs_ptr": "*i64", "scales_ptr": "*fp32", "bias_ptr": dt,
              "in_features": "i32", "out_features": "i32", "num_n_blocks": "i32"},
             {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_R": 16,
              "RANK_MULTIPLE": 8, **DORA}),
        ]

    TOKENS = {"token_order_ptr": "*i64", "token_slots_ptr": "*i64", "ranks_ptr": "*i32",
              "a_ptrs_ptr": "*i64", "b_ptrs_ptr": "*i64", "scales_ptr": "*fp32",
              "in_features": "i32", "out_features": "i32", "h_stride": "i32", "h_ptr": "*fp32",
              "g_ptrs_ptr": "*i64"}
    def bgmv_kernels(dt):  # the decode kernels: one program per token
        return [
            (bt._bgmv_shrink_kernel, {"x_ptr": dt},
             {"BLOCK_K": 128, "BLOCK_R": 16, "SPLIT_K": 2, "PTR_ALIGN": 16}),
            (bt._bgmv_expand_kernel, {"y_ptr": dt, "bias_ptr": dt},
             {"BLOCK_N": 128, "BLOCK_R": 16, "PTR_ALIGN": 16, "RANK_MULTIPLE": 8, **DORA}),
            (bt._bgmv_fused_kernel, {"x_ptr": dt, "y_ptr": dt, "bias_ptr": dt},
             {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_R": 16, "PTR_ALIGN": 16,
              "RANK_MULTIPLE": 8, **DORA}),
        ]

    count = 0
    for dt, precision in (("*bf16", "tf32"), ("*fp16", "tf32"), ("*fp32", "ieee")):
        launches = [(k, {**COMMON, **t}, {"PTR_ALIGN": 16, "PRECISION": precision, **c})
                    for k, t, c in kernels(dt)]
        launches += [(k, {**TOKENS, **t}, c) for k, t, c in bgmv_kernels(dt)]
        for kernel, types, consts in launches:
            sig = {n: "constexpr" if n in consts else types[n] for n in kernel.arg_names}
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], (kernel, dt)
            count += 1
    print("compiled", count)
    """
)


def test_kernels_compile_to_sm90_cubin_in_every_dtype_without_a_gpu() -> None:
    """The interpreter does not lower kernels; compile them (SGMV and BGMV) for an H100/H200
    target here."""
    assert "compiled 18" in compile_without_gpu(_COMPILE_SCRIPT, timeout=240)


@pytest.mark.gpu
@pytest.mark.skipif(
    INTERPRETED, reason="needs CUDA and compiled Triton (bf16 dot is wrong when interpreted)"
)
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
@pytest.mark.parametrize(
    ("tokens", "hidden", "num_adapters"),
    [(64, 4096, 32), (1024, 1024, 8)],
    ids=["decode", "prefill"],
)
def test_bf16_lora_apply_on_gpu_matches_fp32_torch(
    fused: bool, tokens: int, hidden: int, num_adapters: int
) -> None:
    ranks = [(8, 16, 64)[k % 3] for k in range(num_adapters)]
    lora_a, lora_b, scales = _pool_like(ranks, hidden, hidden, torch.bfloat16, seed=11)
    rng = random.Random(11)
    token_slots = [rng.choice([-1, *range(num_adapters)]) for _ in range(tokens)]
    batch = LoRABatch.from_token_slots(token_slots, device=DEVICE)
    x = torch.randn(tokens, hidden).to(DEVICE, torch.bfloat16)
    y = torch.randn(tokens, hidden).to(DEVICE, torch.bfloat16)
    expected = _reference(
        y, x, batch.token_order, batch.seg_slots, batch.seg_bounds, lora_a, lora_b, scales
    )
    weights = st.SlotWeights.build(lora_a, lora_b, torch.bfloat16, DEVICE)
    segs = _segments(batch.seg_slots, batch.seg_bounds, batch.token_order)
    st.lora_apply(y, x, weights=weights, scales=scales, fused=fused, **segs)
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(y.float().cpu(), expected, atol=atol, rtol=rtol)
