"""Our decoder + LoRA layers + paged cache against HF transformers + PEFT, fp32 on CPU.

Every comparison is row by row: each position's logits must equal HF+PEFT's full-sequence
forward of the same tokens with the same adapter, to 1e-4.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora import LoRAPool, install_lora, load_lora
from loraplane.dataplane.models import load_model
from tests.dataplane.conftest import Family, LoadedModel, PagedRunner, Seq, hf_logits

KINDS = ["llama", "qwen2", "mistral"]
ATOL = 1e-4


def _check(seq: Seq, reference: torch.nn.Module, adapter: str | None) -> float:
    """Assert seq's logits equal HF+PEFT's at the same positions; return the max difference."""
    expected = hf_logits(reference, seq.tokens[: seq.num_computed], adapter)[seq.first_logit :]
    got = torch.stack(seq.logits)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    return float((got - expected).abs().max())


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(length)]


@pytest.mark.parametrize("kind", KINDS)
def test_one_mixed_prefill_batch_of_eight_adapters_and_base_rows_matches_hf_peft(
    kind: str,
    families: dict[str, Family],
    loaded_models: Callable[[str], LoadedModel],
    hf_reference: Callable[[str], torch.nn.Module],
) -> None:
    engine, rng = loaded_models(kind), random.Random(1)
    # every adapter (ranks 4..64, rslora, patterns, layer subsets, partial targets), two base
    # rows, and adapters repeated in non-adjacent sequences so segments gather across the batch
    names: list[str | None] = [*families[kind].adapters, None, "r16", None, "r4"]
    seqs = [Seq(_prompt(rng, rng.randint(3, 17)), engine.slots[n] if n else -1) for n in names]
    runner = PagedRunner(engine.model, num_blocks=96, block_size=4, seed=2)
    runner.step([(s, len(s.tokens)) for s in seqs])
    reference = hf_reference(kind)
    for seq, name in zip(seqs, names, strict=True):
        _check(seq, reference, name)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunks_and_decode_steps_through_shuffled_blocks_match_hf_peft(
    kind: str,
    loaded_models: Callable[[str], LoadedModel],
    hf_reference: Callable[[str], torch.nn.Module],
) -> None:
    engine, rng = loaded_models(kind), random.Random(3)
    names: list[str | None] = ["r64", "r8-patterns", None, "r32-mlp", "r16-rslora"]
    seqs = [
        Seq(_prompt(rng, n), engine.slots[a] if a else -1)
        for a, n in zip(names, [5, 9, 7, 11, 14], strict=True)
    ]
    runner = PagedRunner(engine.model, num_blocks=64, block_size=4, seed=4)
    long_seq = seqs[-1]
    # step 1: four prompts whole, the long one's first chunk; step 2: its second chunk while
    # the others decode; then everyone decodes, each new token fed back from the logits
    runner.step([(s, len(s.tokens)) for s in seqs[:-1]] + [(long_seq, 6)])
    for step in range(5):
        for seq in seqs:
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(int(seq.logits[-1].argmax()))
        work = [(s, len(s.tokens) - s.num_computed) for s in seqs]
        if step == 0:
            assert work[-1] == (long_seq, 8)
        runner.step(work)
    reference = hf_reference(kind)
    for seq, name in zip(seqs, names, strict=True):
        assert len(seq.blocks) > 2  # spread over several shuffled, non-contiguous blocks
        _check(seq, reference, name)


def test_first_step_with_a_cached_prefix_attends_to_blocks_it_did_not_write(
    loaded_models: Callable[[str], LoadedModel], hf_reference: Callable[[str], torch.nn.Module]
) -> None:
    engine, rng = loaded_models("llama"), random.Random(5)
    slot = engine.slots["r16"]
    prefix = _prompt(rng, 8)  # two full blocks of 4
    writer = Seq([*prefix, *_prompt(rng, 5)], slot)
    runner = PagedRunner(engine.model, num_blocks=32, block_size=4, seed=6)
    runner.step([(writer, len(writer.tokens))])
    # tail: context 8 cached + 6 new; last_token: 8 cached + 1 new (q_len 1 on its first step)
    tail = Seq([*prefix, *_prompt(rng, 6)], slot)
    last_token = Seq([*prefix, rng.randrange(3, 384)], slot)
    runner.share_prefix(writer, tail, 2)
    runner.share_prefix(writer, last_token, 2)
    writer.tokens.append(int(writer.logits[-1].argmax()))
    runner.step([(tail, 6), (writer, 1), (last_token, 1)])
    reference = hf_reference("llama")
    for seq in (tail, last_token, writer):
        _check(seq, reference, "r16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_and_pool_stay_close_to_hf_peft_fp32(
    dtype: torch.dtype,
    families: dict[str, Family],
    hf_reference: Callable[[str], torch.nn.Module],
) -> None:
    fam, rng = families["llama"], random.Random(7)
    spec = BaseModelSpec.from_dir(fam.model_dir)
    model = load_model(fam.model_dir, dtype, torch.device("cpu"))
    layout = dispatch.b_transposed(dtype, torch.device("cpu"))  # the engine's
    pool = LoRAPool(3, spec, dtype, "cpu", b_transposed=layout)
    install_lora(model, pool)
    names: list[str | None] = ["r64", None, "r8-qv", "r16-rslora"]
    for slot, name in enumerate(n for n in names if n):
        pool.load(slot, load_lora(fam.adapters[name], spec))
    slots = iter(range(3))
    seqs = [Seq(_prompt(rng, 9), next(slots) if n else -1) for n in names]
    PagedRunner(model, num_blocks=16, block_size=4).step([(s, 9) for s in seqs])
    reference = hf_reference("llama")
    for seq, name in zip(seqs, names, strict=True):
        expected = hf_logits(reference, seq.tokens, name)
        torch.testing.assert_close(torch.stack(seq.logits), expected, atol=0.05, rtol=0.05)
