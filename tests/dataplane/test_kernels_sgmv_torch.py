"""The torch SGMV reference against a naive per-token loop: ranks 1..64, dtypes, segments."""

from __future__ import annotations

import random

import pytest
import torch

from loraplane.dataplane.kernels import lora_apply, sgmv_expand, sgmv_shrink
from loraplane.dataplane.kernels.sgmv_torch import lora_apply_grouped
from loraplane.dataplane.lora import LoRABatch

TOLERANCE = {  # dtype -> (atol, rtol) against the fp32 loop
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (1e-1, 5e-2),
}


def _naive(
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: list[int],
    lora_a: list[torch.Tensor | None],
    lora_b: list[torch.Tensor | None],
    scales: torch.Tensor,
) -> torch.Tensor:
    """One token at a time, in fp32: y[t] += scale * B (A x[t])."""
    out = y.float().clone()
    for t, slot in enumerate(token_slots):
        a, b = (lora_a[slot], lora_b[slot]) if slot >= 0 else (None, None)
        if a is None or b is None:
            continue
        out[t] += (b.float() @ (a.float() @ x[t].float())) * scales[slot]
    return out


def _slots(
    ranks: list[int | None], fan_in: int, fan_out: int, dtype: torch.dtype
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], torch.Tensor]:
    lora_a: list[torch.Tensor | None] = []
    lora_b: list[torch.Tensor | None] = []
    for r in ranks:
        lora_a.append(None if r is None else (torch.randn(r, fan_in) * 0.2).to(dtype))
        lora_b.append(None if r is None else (torch.randn(fan_out, r) * 0.2).to(dtype))
    scales = torch.rand(len(ranks)) * 2 + 0.1
    return lora_a, lora_b, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lora_apply_equals_a_per_token_loop_for_mixed_ranks_and_interleaved_base_tokens(
    dtype: torch.dtype, seed: int
) -> None:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    fan_in, fan_out, tokens = 48, 40, 97
    # slot 3 does not target this module; slot 6 holds no tokens this step
    ranks: list[int | None] = [1, 64, 8, None, 16, 3, 32, 64]
    lora_a, lora_b, scales = _slots(ranks, fan_in, fan_out, dtype)
    token_slots = [rng.choice([-1, -1, 0, 1, 2, 3, 4, 5, 7]) for _ in range(tokens)]
    x = torch.randn(tokens, fan_in).to(dtype)
    y = torch.randn(tokens, fan_out).to(dtype)
    expected = _naive(y, x, token_slots, lora_a, lora_b, scales)
    batch = LoRABatch.from_token_slots(token_slots)
    got = lora_apply(
        y, x, batch.token_order, batch.seg_slots, batch.seg_bounds, lora_a, lora_b, scales
    )
    assert got is y  # accumulated in place
    assert got.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)
    base_rows = [t for t, s in enumerate(token_slots) if s in (-1, 3)]
    torch.testing.assert_close(got[base_rows].float(), expected[base_rows], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_grouped_cpu_path_equals_the_oracle_for_many_small_segments(
    dtype: torch.dtype, seed: int
) -> None:
    """The serving path (one gather, two matmuls per segment, one scatter) against the oracle:
    50 adapters of mixed ranks with a token or two each (decodes) beside one long prefill
    segment, base tokens, an untargeted slot and slots holding no token."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    ranks: list[int | None] = [rng.choice([1, 4, 8, 16, 33, 64]) for _ in range(50)]
    ranks[7] = None
    lora_a, lora_b, scales = _slots(ranks, 48, 40, dtype)
    token_slots = [rng.choice([-1, *range(45)]) for _ in range(80)] + [12] * 30
    rng.shuffle(token_slots)
    x = torch.randn(len(token_slots), 48).to(dtype)
    y = torch.randn(len(token_slots), 40).to(dtype)
    batch = LoRABatch.from_token_slots(token_slots)
    args = (batch.seg_slots, batch.seg_bounds, lora_a, lora_b, scales)
    expected = lora_apply(y.clone(), x, batch.token_order, *args)
    got = lora_apply_grouped(y, x, batch.token_order, batch.token_slots, *args)
    assert got is y
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    untouched = [t for t, s in enumerate(token_slots) if s in (-1, 7)]
    assert untouched and torch.equal(got[untouched], expected[untouched])


def test_the_grouped_cpu_paths_memo_of_checked_slots_follows_their_tensors() -> None:
    """With a memo (as the pool keeps one per module) the results are the same, and a slot
    whose tensor was replaced by one that does not fit is still refused."""
    torch.manual_seed(3)
    lora_a, lora_b, scales = _slots([4, 8, 2], 12, 10, torch.float32)
    batch = LoRABatch.from_token_slots([0, 1, 2, 1, 0, -1])
    x, y = torch.randn(6, 12), torch.randn(6, 10)
    args = (batch.seg_slots, batch.seg_bounds, lora_a, lora_b, scales)
    memo: list[object] = [None] * 3
    plain = lora_apply_grouped(y.clone(), x, batch.token_order, batch.token_slots, *args)
    for _ in range(2):  # the second call reads the memo
        got = lora_apply_grouped(y.clone(), x, batch.token_order, batch.token_slots, *args,
                                 memo)  # type: ignore[arg-type]  # fmt: skip
        assert torch.equal(got, plain)
    assert all(entry is not None for entry in memo)
    lora_a[1] = torch.zeros(8, 13)  # a bad copy: A no longer fits the layer
    with pytest.raises(ValueError, match="slot 1"):
        lora_apply_grouped(y.clone(), x, batch.token_order, batch.token_slots, *args,
                           memo)  # type: ignore[arg-type]  # fmt: skip


def test_the_grouped_cpu_path_with_only_untargeted_slots_leaves_y_unchanged() -> None:
    lora_a, lora_b, scales = _slots([None, None], 6, 4, torch.float32)
    batch = LoRABatch.from_token_slots([0, 1, -1, 0])
    y = torch.randn(4, 4)
    before = y.clone()
    args = (batch.seg_slots, batch.seg_bounds, lora_a, lora_b, scales)
    lora_apply_grouped(y, torch.randn(4, 6), batch.token_order, batch.token_slots, *args)
    assert torch.equal(y, before)


def test_shrink_writes_each_segment_at_its_own_rank_and_zeros_the_rest() -> None:
    torch.manual_seed(0)
    lora_a, _, _ = _slots([2, 5], fan_in=6, fan_out=4, dtype=torch.float32)
    x = torch.randn(5, 6)
    batch = LoRABatch.from_token_slots([1, 0, 1, -1, 0])
    h = sgmv_shrink(x, batch.token_order, batch.seg_slots, batch.seg_bounds, lora_a)
    assert h.shape == (4, 5)  # [N adapter tokens, largest rank]
    a0, a1 = lora_a[0], lora_a[1]
    assert a0 is not None and a1 is not None
    torch.testing.assert_close(h[:2, :2], x[[1, 4]] @ a0.t())
    assert torch.all(h[:2, 2:] == 0)
    torch.testing.assert_close(h[2:], x[[0, 2]] @ a1.t())


def test_empty_segments_and_single_token_segments_are_handled() -> None:
    torch.manual_seed(1)
    lora_a, lora_b, scales = _slots([4, 4, 4], fan_in=8, fan_out=8, dtype=torch.float32)
    x, y = torch.randn(3, 8), torch.zeros(3, 8)
    order = torch.tensor([2, 0, 1])
    # segment of slot 1 is empty; slots 0 and 2 get one and two tokens
    got = lora_apply(y.clone(), x, order, [0, 1, 2], [0, 1, 1, 3], lora_a, lora_b, scales)
    expected = _naive(y, x, [2, 2, 0], lora_a, lora_b, scales)
    torch.testing.assert_close(got, expected)


def test_no_targeting_adapter_leaves_the_base_output_untouched() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    before = y.clone()
    batch = LoRABatch.from_token_slots([0, 1, 1, -1])
    lora_apply(
        y,
        x,
        batch.token_order,
        batch.seg_slots,
        batch.seg_bounds,
        [None, None],
        [None, None],
        torch.ones(2),
    )
    assert torch.equal(y, before)


def test_expand_adds_scaled_up_projection_into_the_token_rows() -> None:
    h = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = torch.zeros(3, 3)
    sgmv_expand(y, h, torch.tensor([2, 0]), [0], [0, 2], [b], torch.tensor([0.5]))
    assert y.tolist() == [[1.5, 0.0, 1.5], [0.0, 0.0, 0.0], [0.5, 1.0, 1.5]]


def test_inconsistent_segment_arguments_are_rejected() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="seg_bounds"):
        sgmv_shrink(x, torch.tensor([0, 1]), [0], [0, 1], [torch.randn(2, 4)])
    with pytest.raises(ValueError, match="token_order"):
        sgmv_shrink(x, torch.tensor([0, 1], dtype=torch.int32), [0], [0, 2], [torch.randn(2, 4)])
    with pytest.raises(ValueError, match="lora_a"):
        sgmv_shrink(x, torch.tensor([0, 1]), [0], [0, 2], [torch.randn(2, 5)])
