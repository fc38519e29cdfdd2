"""Expert LoRA through the Triton SGMV kernels (one launch over an expert's (expert, adapter)
segments) against the torch reference `expert_lora_torch`.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set
here before Triton is imported, and LORAPLANE_SGMV=triton so dispatch takes the Triton path on
CPU tensors); fp32 only there (the interpreter's bf16 `tl.dot` is wrong). With CUDA and
TRITON_INTERPRET unset, the compiled kernels run on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.dataplane.triton_mode import DEVICE, INTERPRETED, require_triton

require_triton()

from loraplane.dataplane.kernels import dispatch  # noqa: E402
from loraplane.dataplane.kernels import sgmv_triton as st  # noqa: E402
from loraplane.dataplane.lora.experts import (  # noqa: E402
    expert_batch,
    expert_lora_apply,
    expert_lora_torch,
    route_rows,
)
from loraplane.dataplane.lora.metadata import LoRABatch  # noqa: E402
from loraplane.dataplane.lora.module_slots import ModuleSlots  # noqa: E402

if INTERPRETED and type(st._shrink_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "sgmv_triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

# slot 2 does not adapt this expert's linear; ranks differ per slot (rank-exact)
RANKS: dict[int, int | None] = {0: 4, 1: 16, 2: None, 3: 8}
FAN_IN, FAN_OUT = 48, 40


def _table(seed: int) -> ModuleSlots:
    torch.manual_seed(seed)
    table = ModuleSlots(len(RANKS), DEVICE)
    for slot, rank in RANKS.items():
        if rank is None:
            continue
        table.lora_a[slot] = torch.randn(rank, FAN_IN, device=DEVICE) * 0.3
        table.lora_b[slot] = torch.randn(FAN_OUT, rank, device=DEVICE) * 0.3
        table.scales[slot] = 0.25 * (slot + 1)
    return table


@pytest.fixture(autouse=True)
def _triton_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV, "triton")


def test_one_experts_segments_through_triton_equal_the_torch_reference() -> None:
    assert dispatch.backend(torch.empty(1, device=DEVICE)) == "triton"
    table = _table(1)
    # rows 0-2 base, then slots 0, 1, 2 (not adapted), 3
    segments = [(0, 3, 8), (1, 8, 9), (2, 9, 12), (3, 12, 19)]
    x = torch.randn(19, FAN_IN, device=DEVICE)
    y0 = torch.randn(19, FAN_OUT, device=DEVICE)
    want, got = y0.clone(), y0.clone()
    expert_lora_torch(want, x, segments, table)
    expert_lora_apply(got, x, segments, table)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[:3], y0[:3]) and torch.equal(got[9:12], y0[9:12])
    assert (got[3:9] - y0[3:9]).abs().max() > 1e-2  # the adapters did add something


def test_routed_batch_every_expert_through_triton_equals_the_reference() -> None:
    """A sparse layer's routed rows (4 experts, top-2, mixed slots and base tokens): each
    expert's segments through Triton equal the reference, expert by expert."""
    gen = torch.Generator().manual_seed(5)
    tokens = 23
    experts = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    slots = torch.randint(-1, 4, (tokens,), generator=gen)
    rows = route_rows(experts.to(DEVICE), LoRABatch.from_token_slots(slots, DEVICE), 4)
    tables = [_table(10 + e) for e in range(4)]
    x = torch.randn(tokens, FAN_IN, device=DEVICE)[rows.tokens]
    y0 = torch.randn(tokens * 2, FAN_OUT, device=DEVICE)
    want, got = y0.clone(), y0.clone()
    for e in rows.experts_hit:
        start, end = rows.expert_bounds[e], rows.expert_bounds[e + 1]
        expert_lora_torch(want[start:end], x[start:end], rows.segments(e), tables[e])
        expert_lora_apply(got[start:end], x[start:end], rows.segments(e), tables[e])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (want - y0).abs().max() > 1e-2


def test_expert_batch_lists_the_segments_rows_in_order() -> None:
    batch = expert_batch([(0, 2, 4), (3, 4, 7)], torch.device("cpu"))
    assert batch.token_order.tolist() == [2, 3, 4, 5, 6]
    assert batch.seg_slots == (0, 3) and batch.seg_bounds == (0, 2, 5)
    assert batch.token_slots.tolist() == [0, 0, 3, 3, 3] and batch.num_tokens == 7
