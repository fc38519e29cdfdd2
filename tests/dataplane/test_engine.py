"""The engine end to end against HF transformers + PEFT, and its batching invariants.

Greedy generation through continuous batching (mixed adapters and base requests, paged KV
cache, chunked prefill) must equal a plain greedy loop over HF+PEFT's forward, token for token;
a request's output must not depend on its batch, on prefix caching, or on preemption.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.dataplane.async_engine import AsyncEngine
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine, RequestOutput
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from tests.dataplane.conftest import Family, hf_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def make_engine(
    family: Family, register: bool = True, **overrides: Any
) -> tuple[Engine, dict[str, LoRARef]]:
    settings: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "block_size": 4,
        "max_loras": len(family.adapters),
        "num_kv_blocks": 512,
    }
    settings.update(overrides)
    engine = Engine(EngineConfig(model=str(family.model_dir), **settings))
    adapters = family.adapters if register else {}
    refs = {name: engine.register_lora(name, path, "t") for name, path in adapters.items()}
    return engine, refs


def hf_greedy(
    reference: torch.nn.Module, prompt: list[int], adapter: str | None, n: int
) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf_logits(reference, tokens, adapter)[-1].argmax()))
    return tokens[len(prompt) :]


def prompts(count: int, seed: int, low: int = 3, high: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(low, high))] for _ in range(count)]


def mixed_batch(
    family: Family, seed: int
) -> tuple[Engine, list[list[int]], SamplingParams, list[LoRARef | None]]:
    """An engine over `family`'s adapters, and a greedy batch of one request per adapter and one
    of the base model asking for log-probs: for comparing two settings of a CPU fast path."""
    engine, refs = make_engine(family)
    names: list[str | None] = [*family.adapters, None]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True)
    loras = [refs[n] if n else None for n in names]
    return engine, prompts(len(names), seed=seed, high=40), params, loras


def assert_same_outputs(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    """The same tokens, and log-probs equal to rounding."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs),
                                   rtol=0, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_generation_in_one_mixed_batch_equals_peft_token_for_token(
    kind: str, families: dict[str, Family], hf_reference: Callable[[str], torch.nn.Module]
) -> None:
    family = families[kind]
    # small token budget: long prompts are chunked and mixed with other requests' decodes
    engine, refs = make_engine(family, max_num_batched_tokens=48)
    names: list[str | None] = [*family.adapters, None, "r64", None]
    batch = prompts(len(names), seed=11)
    outs = engine.generate(batch, GREEDY, [refs[n] if n else None for n in names])
    reference = hf_reference(kind)
    for prompt, name, out in zip(batch, names, outs, strict=True):
        assert out.token_ids == hf_greedy(reference, prompt, name, 32), (kind, name)
        assert out.finish_reason == "length"


def test_adapters_change_the_output(families: dict[str, Family]) -> None:
    engine, refs = make_engine(families["llama"])
    prompt = prompts(1, seed=5)[0]
    outs = engine.generate([prompt] * 3, GREEDY, [None, refs["r16"], refs["r64"]])
    assert len({tuple(o.token_ids) for o in outs}) == 3


def test_output_is_the_same_alone_batched_with_prefix_caching_and_under_preemption(
    families: dict[str, Family],
) -> None:
    family = families["llama"]
    shared = prompts(1, seed=21, low=20, high=20)[0]  # 5 full blocks of 4 tokens
    target = ([*shared, 7, 8, 9], "r16")
    others = [([*shared, 10], "r16"), ([*shared, 7, 8, 9], "r64"), ([*shared, 7, 8, 9], None)]
    names = ["r4", None, "r8-qv", "r32-mlp", "r16", "r16-rslora"]
    others += list(zip(prompts(6, seed=22), names, strict=True))

    def run(
        requests: list[tuple[list[int], str | None]], **overrides: Any
    ) -> tuple[list[list[int]], Engine]:
        """All but the last request first; the last arrives two steps later, when the
        earlier prompts' full blocks are in the prefix cache."""
        engine, refs = make_engine(family, **overrides)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
        for i, (prompt, name) in enumerate(requests):
            if i == len(requests) - 1 and i > 0:
                for out in engine.step() + engine.step():
                    tokens[out.request_id].extend(out.token_ids)
            engine.add_request(str(i), prompt, GREEDY, refs[name] if name else None)
        while engine.has_unfinished:
            for out in engine.step():
                tokens[out.request_id].extend(out.token_ids)
        return [tokens[str(i)] for i in range(len(requests))], engine

    (alone,), _ = run([target], enable_prefix_caching=False)
    batched, cached = run([*others, target], enable_prefix_caching=True)
    assert batched[-1] == alone
    assert cached.block_manager.cache_hit_tokens > 0  # the r16 requests shared the prefix
    # the same prompt under another adapter, or the base model, is not served from r16's blocks
    for i, (prompt, name) in enumerate(others):
        (solo,), _ = run([(prompt, name)], enable_prefix_caching=False)
        assert batched[i] == solo, name
    # a cache too small for everyone at once: sequences are preempted and recomputed
    squeezed, engine = run([*others, target], num_kv_blocks=40, enable_prefix_caching=True)
    assert engine.stats.preemptions > 0
    assert squeezed == batched


def test_max_loras_defers_requests_and_every_step_holds_at_most_that_many_adapters(
    families: dict[str, Family],
) -> None:
    engine, refs = make_engine(
        families["llama"], max_loras=2, max_deferral_steps=3, max_cpu_loras=8
    )
    seen: list[frozenset[str]] = []
    execute = engine.runner.execute

    def spy(out: Any, in_use: set[str], wanted: set[str] | None = None) -> torch.Tensor:
        seen.append(out.lora_keys)
        assert len(engine.runner.loras.resident) <= 2
        return execute(out, in_use, wanted)

    engine.runner.execute = spy  # type: ignore[method-assign]
    names = ["r4", "r16", "r64", "r8-qv", "r4", "r16", "r64", "r8-qv"]
    # all four in host memory first (room for all there, for 2 on the device): a request is deferred
    # only once its adapter is ready (on a busy machine, loads still running while the first
    # two adapters' requests run would defer none)
    wanted = [refs[n] for n in dict.fromkeys(names)]
    engine.loras.prefetch(wanted)
    assert engine.loras.wait_for(wanted, 60)
    assert set(wanted) <= set(engine.loras.in_host)
    outs = engine.generate(prompts(8, seed=3), GREEDY, [refs[n] for n in names])
    assert all(len(o.token_ids) == 32 for o in outs)
    assert max(len(keys) for keys in seen) <= 2
    assert engine.scheduler.deferred_total > 0
    assert engine.runner.loras.evictions_total > 0


def test_stop_strings_eos_and_max_tokens_end_requests(families: dict[str, Family]) -> None:
    engine, refs = make_engine(families["llama"])
    prompt = prompts(1, seed=8)[0]
    (free,) = engine.generate([prompt], GREEDY, [refs["r16"]])
    assert len(free.token_ids) == 32
    stop = free.text[5:8]
    (stopped,) = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, stop=[stop]), [refs["r16"]]
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    eos = free.token_ids[3]
    (ended,) = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[eos]), [refs["r16"]]
    )
    assert ended.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert ended.finish_reason == "stop"
    # as vLLM: the stop token's text is not output (special or not), unless asked for
    before = engine.tokenizer.decode(ended.token_ids[:-1], skip_special_tokens=True)
    assert ended.text == before and ended.text != engine.tokenizer.decode(ended.token_ids)
    (kept,) = engine.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[eos],
                       include_stop_str_in_output=True),
        [refs["r16"]],
    )  # fmt: skip
    assert kept.text == engine.tokenizer.decode(kept.token_ids) != before


def test_seeded_sampling_and_logprobs(families: dict[str, Family]) -> None:
    engine, refs = make_engine(families["llama"])
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, logprobs=True)
    prompt = prompts(1, seed=9)[0]
    (alone,) = engine.generate([prompt], params, [refs["r8-patterns"]])
    batch = engine.generate(
        [prompt, *prompts(3, seed=10)],
        [params, SamplingParams(temperature=1.0, max_tokens=16)] * 2,
        [refs["r8-patterns"], None, refs["r4"], refs["r64"]],
    )
    assert batch[0].token_ids == alone.token_ids
    assert len(alone.logprobs) == len(alone.token_ids) > 0
    assert all(lp <= 0 for lp in alone.logprobs)


def test_abort_frees_every_block(families: dict[str, Family]) -> None:
    engine, refs = make_engine(families["llama"], enable_prefix_caching=False)
    total = engine.block_manager.num_free_blocks
    engine.add_request("a", prompts(1, seed=1)[0], GREEDY, refs["r16"])
    engine.add_request("b", prompts(1, seed=2)[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < total
    assert engine.abort("a")
    assert engine.abort("b")
    assert not engine.abort("a")
    assert engine.block_manager.num_free_blocks == total
    assert not engine.has_unfinished


def test_invalid_adapter_is_refused_at_registration(
    families: dict[str, Family], tmp_path: Any
) -> None:
    engine, _ = make_engine(families["llama"], register=False, max_lora_rank=16)
    with pytest.raises(AdapterRejected) as info:
        engine.register_lora("big", families["llama"].adapters["r64"])
    assert info.value.code is ReasonCode.RANK_TOO_LARGE


def test_unknown_adapter_and_overlong_prompt_are_value_errors(families: dict[str, Family]) -> None:
    engine, _ = make_engine(families["llama"], max_model_len=64)
    with pytest.raises(ValueError, match="not registered"):
        engine.add_request("x", [5, 6], GREEDY, LoRARef("nope", "t", "0" * 64))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("y", list(range(3, 80)), GREEDY)


def test_async_engine_streams_each_request_and_matches_generate(
    families: dict[str, Family],
) -> None:
    engine, refs = make_engine(families["llama"])
    batch = prompts(4, seed=30)
    loras = [refs["r4"], None, refs["r64"], refs["r16"]]
    expected = [o.token_ids for o in engine.generate(batch, GREEDY, loras)]
    front = AsyncEngine(engine)

    async def one(i: int) -> tuple[list[int], int]:
        tokens, chunks = [], 0
        async for out in front.generate(f"s{i}", batch[i], GREEDY, loras[i]):
            tokens.extend(out.token_ids)
            chunks += 1
        return tokens, chunks

    async def main() -> list[tuple[list[int], int]]:
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        results = asyncio.run(main())
    finally:
        front.shutdown()
    assert [tokens for tokens, _ in results] == expected
    assert all(chunks == 32 for _, chunks in results)  # streamed one token at a time


def test_async_engine_abandoned_stream_aborts_and_frees_blocks(families: dict[str, Family]) -> None:
    engine, refs = make_engine(families["llama"], enable_prefix_caching=False)
    total = engine.block_manager.num_free_blocks
    front = AsyncEngine(engine)

    async def main() -> None:
        stream = front.generate("gone", prompts(1, seed=4)[0], GREEDY, refs["r16"])
        async for _ in stream:
            break  # the client disconnects after the first token
        await stream.aclose()
        deadline = time.monotonic() + 30
        while engine.block_manager.num_free_blocks != total:
            assert time.monotonic() < deadline, "the aborted request kept its blocks"
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
    assert engine.block_manager.num_free_blocks == total
    assert not engine.has_unfinished
