"""One tenant's failure stays its own: a step that fails for one adapter fails only that
adapter's requests, and everyone else's tokens are exactly those of a run without the fault.

Faults are injected where they would happen for real: an adapter's device slot that no longer
fits the model (the kernels refuse it), and the model itself raising for one batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane.async_engine import AsyncEngine
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine, RequestOutput
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 33, 60, 101, 7], [9, 8, 7, 6], [40, 41, 42, 43, 44], [3, 1, 4, 1, 5, 9, 2]]


def make(model: Path, adapters: dict[str, Path]) -> tuple[Engine, dict[str, LoRARef]]:
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", num_kv_blocks=256,
                          block_size=4)  # fmt: skip
    engine = Engine(config)
    refs = {n: engine.register_lora(n, adapters[n], f"tenant-{n}") for n in ("r4", "r16", "r64")}
    return engine, refs


def break_slot(engine: Engine, ref: LoRARef) -> None:
    """Corrupt `ref`'s device slot the way a bad copy would: its A no longer fits the model."""
    engine.loras.make_resident([ref.key], in_use=[])
    slot = engine.loras.slot_of(ref.key)
    for layer in range(engine.runner.pool.spec.num_layers):
        for module in ("q_proj", "v_proj"):
            table = engine.runner.pool.module_slots(layer, module)
            a = table.lora_a[slot]
            if a is not None:
                table.lora_a[slot] = torch.zeros(a.shape[0], a.shape[1] + 1)


def run(engine: Engine, loras: list[LoRARef | None]) -> dict[str, tuple[list[int], RequestOutput]]:
    """Every prompt with its adapter in one continuous batch: per request, all its tokens and
    its last output."""
    done: dict[str, tuple[list[int], RequestOutput]] = {}
    tokens: dict[str, list[int]] = {}
    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras, strict=True)):
        engine.add_request(f"q{i}", prompt, GREEDY, lora)
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], out)
    return done


@pytest.fixture
def expected(tiny_llama_dir: Path, peft_adapters: dict[str, Path]) -> list[list[int]]:
    engine, refs = make(tiny_llama_dir, peft_adapters)
    loras = [refs["r4"], refs["r16"], None, refs["r64"]]
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY, loras)]


def test_a_broken_adapter_fails_only_its_requests_in_a_mixed_batch(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    engine, refs = make(tiny_llama_dir, peft_adapters)
    break_slot(engine, refs["r16"])
    outs = run(engine, [refs["r4"], refs["r16"], None, refs["r64"]])
    _, broken = outs["q1"]
    assert broken.finish_reason == "error"
    assert broken.error is not None and "ValueError" in broken.error
    for i in (0, 2, 3):  # other tenants and the base model: untouched, token for token
        tokens, out = outs[f"q{i}"]
        assert out.error is None and out.finish_reason == "length"
        assert tokens == expected[i]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # the damaged slot was dropped: the adapter's next request loads it again and is served
    (again,) = engine.generate([PROMPTS[1]], GREEDY, [refs["r16"]])
    assert again.error is None and again.token_ids == expected[1]


def test_a_step_that_fails_for_one_batch_is_retried_per_adapter(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    """The model raises once, for the mixed batch as a whole (say, out of memory): every
    request still gets exactly its tokens, run one adapter at a time in that step."""
    engine, refs = make(tiny_llama_dir, peft_adapters)
    model = engine.runner.model
    forward = model.forward
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA out of memory (injected)")
        return forward(*args, **kwargs)

    model.forward = flaky  # type: ignore[method-assign]
    outs = run(engine, [refs["r4"], refs["r16"], None, refs["r64"]])
    assert calls["n"] > 3  # it did fail once, and went on
    assert [outs[f"q{i}"][0] for i in range(4)] == expected
    assert all(out.error is None for _, out in outs.values())


def test_through_the_async_engine_only_the_broken_tenants_stream_ends_in_error(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    engine, refs = make(tiny_llama_dir, peft_adapters)
    break_slot(engine, refs["r16"])
    front = AsyncEngine(engine)

    async def one(i: int, lora: LoRARef | None) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        error = None
        async for out in front.generate(f"s{i}", PROMPTS[i], GREEDY, lora):
            tokens += out.token_ids
            error = out.error or error
        return tokens, error

    async def all_of_them() -> list[tuple[list[int], str | None]]:
        loras = [refs["r4"], refs["r16"], None, refs["r64"]]
        return await asyncio.gather(*(one(i, lora) for i, lora in enumerate(loras)))

    try:
        results = asyncio.run(all_of_them())
    finally:
        front.shutdown()
    assert results[1][1] is not None
    for i in (0, 2, 3):
        assert results[i] == (expected[i], None)


def _break(path: Path, how: str) -> None:
    """Damage a stored version's files the ways a disk, a bad copy or an operator would."""
    weights, config = path / "adapter_model.safetensors", path / "adapter_config.json"
    for f in (weights, config):
        f.chmod(0o644)
    data = bytearray(weights.read_bytes())
    if how == "flipped-byte":
        data[-1] ^= 0x01
        weights.write_bytes(bytes(data))
    elif how == "truncated":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "deleted":
        weights.unlink()
    elif how == "bad-config":
        config.write_text("{not json")
    elif how == "huge-header":
        weights.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    else:  # pragma: no cover
        raise ValueError(how)


BREAKAGES = ("flipped-byte", "truncated", "deleted", "bad-config", "huge-header")


def test_one_tenants_stored_adapters_broken_five_ways_while_another_tenant_streams(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    from loraplane.adapters.base_model import BaseModelSpec
    from loraplane.adapters.ingest import ingest
    from loraplane.adapters.limits import AdapterLimits
    from loraplane.adapters.store import LocalStore
    from loraplane.dataplane.tiers.disk import DiskTier

    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          num_kv_blocks=256, block_size=4)  # fmt: skip
    engine = Engine(config, disk=DiskTier(store))
    good = ingest(peft_adapters["r16"], "bystander", "good", spec, AdapterLimits(), store)
    good_ref = engine.loras.register_stored(LoRARef("good", "bystander", good.digest), good.path)
    victims = {}
    for i, how in enumerate(BREAKAGES):  # one version per way, each of its own content
        source = peft_adapters[("r4", "r8-qv", "r32-mlp", "r64", "r16-rslora")[i]]
        v = ingest(source, "victim", how, spec, AdapterLimits(), store)
        _break(Path(store.url()) / v.path, how)
        victims[how] = engine.loras.register_stored(LoRARef(how, "victim", v.digest), v.path)
    (alone,) = engine.generate([PROMPTS[0]], GREEDY, [good_ref])  # the bystander's reference
    front = AsyncEngine(engine)

    async def one(rid: str, lora: LoRARef) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        error = None
        async for out in front.generate(rid, PROMPTS[0], GREEDY, lora):
            tokens += out.token_ids
            error = out.error or error
        return tokens, error

    async def everyone() -> list[tuple[list[int], str | None]]:
        jobs = [one(f"b{i}", good_ref) for i in range(6)]
        jobs += [one(f"v-{how}", ref) for how, ref in victims.items()]
        return await asyncio.gather(*jobs)

    try:
        results = asyncio.run(everyone())
    finally:
        front.shutdown()
    bystander, broken = results[:6], results[6:]
    assert all(r == (alone.token_ids, None) for r in bystander)  # untouched, token for token
    reasons = {"flipped-byte": "does not match", "truncated": "InvalidSafetensors",
               "deleted": "no adapter_model.safetensors", "bad-config": "InvalidConfig",
               "huge-header": "InvalidSafetensors"}  # fmt: skip
    for how, (tokens, error) in zip(BREAKAGES, broken, strict=True):
        assert error and reasons[how] in error, (how, error)  # a reason; nothing hangs
        assert tokens == [], how
        assert str(tmp_path) not in error and "/store/" not in error  # no store layout told


def test_an_adapter_whose_copy_to_the_device_fails_fails_alone_and_recovers(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    """Placing one adapter on the device raises (during admission, not in the forward pass):
    its request fails with the reason, the others are served exactly, and once the fault is
    gone the adapter loads again from its source."""
    engine, refs = make(tiny_llama_dir, peft_adapters)
    pool = engine.runner.pool
    load = pool.load
    broken = {"on": True}

    def failing_load(slot: int, adapter: Any) -> bool:
        if broken["on"] and adapter.rank == 16:
            raise RuntimeError("device copy failed (injected)")
        return load(slot, adapter)

    pool.load = failing_load  # type: ignore[method-assign]
    outs = run(engine, [refs["r4"], refs["r16"], None, refs["r64"]])
    _, failed = outs["q1"]
    assert failed.finish_reason == "error"
    assert failed.error is not None and "device copy failed (injected)" in failed.error
    for i in (0, 2, 3):
        tokens, out = outs[f"q{i}"]
        assert (tokens, out.error) == (expected[i], None)
    broken["on"] = False
    engine.loras.retry_after_s = 0.0
    (again,) = engine.generate([PROMPTS[1]], GREEDY, [refs["r16"]])
    assert again.error is None and again.token_ids == expected[1]


def test_a_request_whose_output_cannot_be_formed_fails_alone(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    engine, refs = make(tiny_llama_dir, peft_adapters)
    loras = [refs["r4"], refs["r16"], None, refs["r64"]]
    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras, strict=True)):
        engine.add_request(f"q{i}", prompt, GREEDY, lora)

    def undecodable(token: int, check_stop: bool = True) -> Any:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine.emitter.detokenizers["q2"].add_token = undecodable  # type: ignore[method-assign]
    tokens: dict[str, list[int]] = {}
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            last[out.request_id] = out
    assert last["q2"].finish_reason == "error" and "UnicodeDecodeError" in str(last["q2"].error)
    for i in (0, 1, 3):
        assert (tokens[f"q{i}"], last[f"q{i}"].error) == (expected[i], None)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _stream_all(front: AsyncEngine, loras: list[LoRARef | None]) -> list[tuple[list[int], str]]:
    """Every prompt through the async engine; per request its tokens and how it ended (a
    finish reason, or the exception's text)."""

    async def one(i: int, lora: LoRARef | None) -> tuple[list[int], str]:
        tokens: list[int] = []
        end = ""
        try:
            async for out in front.generate(f"s{i}", PROMPTS[i], GREEDY, lora):
                tokens += out.token_ids
                end = out.error or out.finish_reason or end
        except Exception as e:
            end = f"raised {e}"
        return tokens, end

    async def all_of_them() -> list[tuple[list[int], str]]:
        return await asyncio.gather(*(one(i, lora) for i, lora in enumerate(loras)))

    try:
        return asyncio.run(asyncio.wait_for(all_of_them(), 120))
    finally:
        front.shutdown()


def test_a_scheduler_fault_is_retried_and_fails_no_request(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    engine, refs = make(tiny_llama_dir, peft_adapters)
    schedule = engine.scheduler.schedule
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] in (2, 5, 6):  # once, then twice in a row (under MAX_FAILED_STEPS)
            raise RuntimeError("scheduler fault (injected)")
        return schedule(*args, **kwargs)

    engine.scheduler.schedule = flaky  # type: ignore[method-assign]
    results = _stream_all(AsyncEngine(engine), [refs["r4"], refs["r16"], None, refs["r64"]])
    assert calls["n"] > 6
    assert results == [(expected[i], "length") for i in range(4)]


def test_a_scheduler_that_always_fails_ends_every_request_instead_of_spinning(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    engine, refs = make(tiny_llama_dir, peft_adapters)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("scheduler fault (injected)")

    engine.scheduler.schedule = broken  # type: ignore[method-assign]
    results = _stream_all(AsyncEngine(engine), [refs["r4"], None, refs["r16"], refs["r64"]])
    assert all(end == "raised scheduler fault (injected)" for _, end in results)
    assert not engine.has_unfinished


def test_an_engine_fault_after_the_batch_fails_only_that_batchs_requests(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    """Recording a step raises once (an engine fault past the per-adapter isolation): the
    requests in that step fail, the ones still waiting are served exactly."""
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          num_kv_blocks=256, block_size=4, max_num_seqs=2)  # fmt: skip
    engine = Engine(config)
    refs = {n: engine.register_lora(n, peft_adapters[n], f"tenant-{n}") for n in peft_adapters}
    postprocess = engine.scheduler.postprocess
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bookkeeping fault (injected)")
        return postprocess(*args, **kwargs)

    engine.scheduler.postprocess = flaky  # type: ignore[method-assign]
    results = _stream_all(AsyncEngine(engine), [refs["r4"], refs["r16"], None, refs["r64"]])
    failed = [i for i, (_, end) in enumerate(results) if end.startswith("raised")]
    assert len(failed) == 2  # the first step's two seats
    for i in set(range(4)) - set(failed):
        assert results[i] == (expected[i], "length")


def test_a_step_is_broken_only_when_no_adapter_is_to_blame(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One adapter's forward failing is that tenant's fault (the step is not broken); the base
    model's failing, or every adapter's, is the engine's (the health probes count it)."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                 num_kv_blocks=64))  # fmt: skip
    good, bad = (engine.register_lora(n, peft_adapters[n]) for n in ("r4", "r16"))
    execute = engine.runner.execute
    failing: set[str | None] = set()

    def flaky(out, *args, **kwargs):  # type: ignore[no-untyped-def]
        keys = {r.seq.lora_key for r in out.scheduled}
        if keys & failing:
            raise RuntimeError("injected")
        return execute(out, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    params = SamplingParams(temperature=0, max_tokens=2)
    cases = [({bad.key}, [good, bad, None], False), ({None}, [good, None], True),
             ({good.key, bad.key}, [good, bad], True)]  # fmt: skip
    for n, (fail, loras, broken) in enumerate(cases):
        failing.clear()
        failing.update(fail)
        for i, lora in enumerate(loras):
            engine.add_request(f"c{n}-{i}", [5, 6, 7], params, lora)
        engine.step()
        assert engine.broken is broken, (fail, loras)
        while engine.has_unfinished:
            engine.step()
