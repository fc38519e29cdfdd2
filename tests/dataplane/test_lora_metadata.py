"""LoRABatch: tokens grouped by adapter slot into segments (pure logic)."""

from __future__ import annotations

import pytest
import torch

from loraplane.dataplane.lora import LoRABatch


def test_tokens_are_stably_sorted_by_slot_and_base_tokens_left_out() -> None:
    batch = LoRABatch.from_token_slots([2, -1, 0, 2, 0, -1, 1, 2])
    assert batch.token_order.tolist() == [2, 4, 6, 0, 3, 7]
    assert batch.token_order.dtype == torch.int64
    assert batch.num_tokens == 8
    assert batch.num_lora_tokens == 6


def test_each_slot_gets_one_segment_in_ascending_slot_order() -> None:
    batch = LoRABatch.from_token_slots([2, -1, 0, 2, 0, -1, 1, 2])
    assert batch.segments == [(0, 0, 2), (1, 2, 3), (2, 3, 6)]
    assert batch.seg_slots == (0, 1, 2)
    assert batch.seg_bounds == (0, 2, 3, 6)
    assert batch.seg_slots_t.tolist() == [0, 1, 2]
    assert batch.seg_bounds_t.tolist() == [0, 2, 3, 6]
    assert batch.seg_slots_t.dtype == batch.seg_bounds_t.dtype == torch.int32


def test_a_slot_used_by_non_adjacent_sequences_is_read_as_one_segment() -> None:
    # three sequences: slot 5 (2 tokens), base (1), slot 5 again (decode token)
    batch = LoRABatch.from_token_slots(torch.tensor([5, 5, -1, 5]))
    assert batch.segments == [(5, 0, 3)]
    assert batch.token_order.tolist() == [0, 1, 3]


def test_a_batch_of_only_base_tokens_has_no_segments() -> None:
    batch = LoRABatch.from_token_slots([-1, -1, -1])
    assert batch.is_empty
    assert batch.segments == []
    assert batch.token_order.numel() == 0
    assert batch.seg_bounds == (0,)
    assert batch.num_tokens == 3


def test_an_empty_step_gives_an_empty_batch() -> None:
    batch = LoRABatch.from_token_slots([])
    assert batch.is_empty
    assert batch.num_tokens == 0
    assert batch.num_lora_tokens == 0


def test_slots_below_minus_one_are_rejected() -> None:
    with pytest.raises(ValueError, match="token_slots"):
        LoRABatch.from_token_slots([0, -2])


def test_token_slots_must_be_one_dimensional() -> None:
    with pytest.raises(ValueError, match="token_slots must be 1-D"):
        LoRABatch.from_token_slots(torch.zeros(2, 3, dtype=torch.int64))
