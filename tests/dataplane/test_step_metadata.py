"""The step's inputs built once on the host (step_metadata.build_step): equal to what the
per-piece builders give, and the layers never read a device tensor back during a forward pass
(a sync-counting hook on `.tolist()` / `.item()`, which on a GPU each wait for the device)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplane.dataplane.attention import AttentionMetadata, query_positions
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.lora.metadata import BASE_SLOT, LoRABatch
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.step_metadata import StepRow, build_step


def random_rows(seed: int, block_size: int) -> list[StepRow]:
    rng = random.Random(seed)
    blocks = list(range(2000))
    rng.shuffle(blocks)
    rows = []
    for _ in range(rng.randint(1, 12)):
        ctx = rng.randint(1, 40)
        q = rng.choice([1, 1, ctx, rng.randint(1, ctx)])
        need = -(-ctx // block_size)
        table, blocks = blocks[: need + rng.randint(0, 2)], blocks[need + 2 :]
        slot = rng.choice([BASE_SLOT, 0, 1, 3, 3, 7])
        rows.append(StepRow([rng.randrange(300) for _ in range(q)], ctx, table, slot))
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_the_step_equals_the_per_piece_builders(seed: int) -> None:
    block_size = random.Random(seed).choice([1, 4, 16])
    rows = random_rows(seed, block_size)
    step = build_step(rows, block_size, "cpu")
    q_lens = [len(r.tokens) for r in rows]
    ctx = [r.context_len for r in rows]
    attn = AttentionMetadata.build(q_lens, ctx, [r.block_table for r in rows], block_size)
    assert torch.equal(step.input_ids, torch.tensor([t for r in rows for t in r.tokens]))
    assert torch.equal(step.positions, query_positions(q_lens, ctx))
    for name in ("cu_seqlens_q", "context_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(step.attn, name).long(), getattr(attn, name).long()), name
    assert step.attn.host_cu_seqlens_q == attn.host_cu_seqlens_q
    slots = [r.slot for r in rows for _ in r.tokens]
    expected = LoRABatch.from_token_slots(slots)
    if expected.is_empty:
        assert step.lora is None
        return
    assert step.lora is not None
    assert (step.lora.seg_slots, step.lora.seg_bounds) == (expected.seg_slots, expected.seg_bounds)
    for name in ("token_order", "token_slots", "seg_slots_t", "seg_bounds_t"):
        assert torch.equal(getattr(step.lora, name), getattr(expected, name)), name


def test_a_table_too_short_or_a_negative_block_is_refused() -> None:
    with pytest.raises(ValueError, match="row 1"):
        build_step([StepRow([1], 4, [0]), StepRow([1, 2], 9, [1, 2])], 4, "cpu")
    with pytest.raises(ValueError, match="row 0"):
        build_step([StepRow([1], 2, [-3])], 4, "cpu")


@pytest.fixture
def no_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every `.tolist()` / `.item()` called while armed."""
    calls: list[str] = []
    armed = {"on": False}
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)

        def hooked(self: torch.Tensor, *a: object, _n: str = name, _f: object = original) -> object:
            if armed["on"]:
                calls.append(_n)
            return _f(self, *a)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, hooked)
    armed["on"] = True
    yield calls
    armed["on"] = False


def test_the_layers_never_read_a_tensor_back_in_a_mixed_step(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], no_syncs: list[str]
) -> None:
    """Prefill chunks and decodes of three adapters and the base model in one forward pass:
    the model and its LoRA layers run on the step's tensors and host values alone."""
    no_syncs.clear()
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                 num_kv_blocks=128, block_size=4))  # fmt: skip
    refs = [engine.register_lora(n, peft_adapters[n]) for n in ("r4", "r16", "r64")]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, lora in enumerate([*refs, None]):
        engine.add_request(f"s{i}", [5 + i, 9, 13, 21, 34, 55][: 3 + i], params, lora)
    runner = engine.runner
    forward = runner.model.forward
    inside: list[str] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        before = len(no_syncs)
        out = forward(*args, **kwargs)
        inside.extend(no_syncs[before:])
        return out

    runner.model.forward = counted  # type: ignore[method-assign]
    while engine.has_unfinished:
        engine.step()
    assert engine.stats.steps >= 3
    assert inside == []  # the sampler reads its tokens back once per step: outside the model
