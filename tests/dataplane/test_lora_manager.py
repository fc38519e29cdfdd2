"""LoRAManager's device tier under a byte budget and its loader's failures.

Real adapters (PEFT, on the tiny model) in a real CPU pool: what is evicted for what, what
never is, and how every kind of load failure ends.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.lora.manager import LoRAManager, State
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import DiskTier

NAMES = ("r4", "r16", "r8-qv", "r32-mlp")


def manager(model: Path, budget: int | None, slots: int = 8, **kw: object) -> LoRAManager:
    spec = BaseModelSpec.from_dir(model)
    pool = LoRAPool(slots, spec, torch.float32, "cpu")
    return LoRAManager(pool, spec, 64, max_cpu_loras=64, device_budget_bytes=budget, **kw)  # type: ignore[arg-type]


def sizes(m: LoRAManager, refs: dict[str, LoRARef]) -> dict[str, int]:
    return {n: m.device_bytes(r) for n, r in refs.items()}


@pytest.fixture
def loaded(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> tuple[LoRAManager, dict[str, LoRARef]]:
    m = manager(tiny_llama_dir, None)
    refs = {n: m.register(n, peft_adapters[n], "acme") for n in NAMES}
    return m, refs


def test_the_budget_evicts_idle_adapters_least_recently_used_first(
    loaded: tuple[LoRAManager, dict[str, LoRARef]],
) -> None:
    m, refs = loaded
    size = sizes(m, refs)
    m.device_budget_bytes = size["r4"] + size["r16"] + size["r8-qv"]
    for name in ("r4", "r16", "r8-qv"):
        m.make_resident([refs[name].key], in_use=[])
    assert m.pool.bytes_used == m.device_budget_bytes  # exactly full
    m.make_resident([refs["r32-mlp"].key], in_use=[])
    assert m.pool.bytes_used <= m.device_budget_bytes
    resident = {r.name for r in m.resident}
    assert "r32-mlp" in resident and "r4" not in resident  # r4 was the least recently used


def test_capacity_is_what_the_budget_holds_of_adapters_the_size_of_those_resident(
    loaded: tuple[LoRAManager, dict[str, LoRARef]],
) -> None:
    """The protocol's max_lora: all slots while nothing is resident or nothing limits bytes,
    then the budget over the resident adapters' mean size, never more than the slots."""
    m, refs = loaded
    size = sizes(m, refs)
    assert m.capacity == 8  # unlimited budget
    m.device_budget_bytes = 3 * size["r16"]
    assert m.capacity == 8  # nothing resident yet: no size to go by
    m.make_resident([refs["r16"].key], in_use=[])
    assert m.capacity == 3
    m.make_resident([refs["r4"].key], in_use=[])
    assert m.capacity == 3 * size["r16"] * 2 // (size["r16"] + size["r4"]) > 3
    m.device_budget_bytes = 100 * size["r16"]
    assert m.capacity == 8  # the slots bound it


def test_an_adapter_in_use_is_never_evicted_and_one_waiting_requests_need_goes_last(
    loaded: tuple[LoRAManager, dict[str, LoRARef]],
) -> None:
    m, refs = loaded
    size = sizes(m, refs)
    # room for r4, r16 and the larger of r8-qv and r32-mlp: r32-mlp needs one eviction
    m.device_budget_bytes = size["r4"] + size["r16"] + max(size["r8-qv"], size["r32-mlp"])
    for name in ("r4", "r16", "r8-qv"):
        m.make_resident([refs[name].key], in_use=[])
    # r4 is the oldest but in use, r16 is wanted by a waiting request: r8-qv goes, although
    # it was used last
    m.make_resident([refs["r32-mlp"].key], in_use=[refs["r4"].key], wanted=[refs["r16"].key])
    assert {r.name for r in m.resident} == {"r4", "r16", "r32-mlp"}
    # nothing idle is left to evict: running adapters filling the budget is the scheduler's bug
    m.device_budget_bytes = m.pool.bytes_used
    with pytest.raises(RuntimeError, match="admitted more than fits"):
        m.make_resident([refs["r8-qv"].key], in_use=[r.key for r in m.resident])


def test_the_budget_holds_under_churn_over_many_adapters(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    m = manager(tiny_llama_dir, None, slots=64)
    refs = {f"{n}-{t}": m.register(n, peft_adapters[n], f"t{t}") for n in NAMES for t in range(6)}
    budget = 3 * max(sizes(m, refs).values())
    m.device_budget_bytes = budget
    keys = [r.key for r in refs.values()]
    previous = keys[0]
    m.make_resident([previous], in_use=[])
    for i in range(300):
        # the adapter of the last step is still running: it must stay while a new one comes
        new = keys[(i * 5 + 3) % len(keys)]
        m.make_resident([new], in_use=[previous])
        resident = {r.key for r in m.resident}
        assert m.pool.bytes_used <= budget
        assert {previous, new} <= resident
        previous = new
    assert m.device_stats.evictions > 100


@pytest.mark.parametrize(
    "error", [ValueError("unsafe store path"), KeyError("x"), RuntimeError("boom"), MemoryError()]
)
def test_a_load_that_raises_anything_ends_failed_with_its_message_and_retries_later(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path, error: BaseException
) -> None:
    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    version = ingest(peft_adapters["r4"], "acme", "r4", spec, AdapterLimits(), store)
    disk = DiskTier(store)
    m = manager(tiny_llama_dir, None, disk=disk, retry_after_s=0.2)
    ref = m.register_stored(LoRARef("r4", "acme", version.digest), version.path)
    real = disk._acquire

    def broken(store_path: str, digest: str) -> Path:
        raise error

    disk._acquire = broken  # type: ignore[method-assign]
    m.prefetch([ref])
    deadline = time.monotonic() + 5
    while m.failure(ref) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    message = m.failure(ref)
    assert message is not None
    assert type(error).__name__ in message or str(error) in message
    assert not m.pending()  # not LOADING forever
    disk._acquire = real  # type: ignore[method-assign]
    time.sleep(0.25)
    assert m.failure(ref) is None
    m.prefetch([ref])
    assert m.wait_for([ref], timeout=60)
    assert m.ready(ref)
    m.close()


@pytest.mark.parametrize("path", ["../../etc/", "adapters/acme/../../x/", "/etc/", "a//b/"])
def test_a_catalog_path_outside_the_store_fails_the_adapter_and_reads_nothing(
    tiny_llama_dir: Path, tmp_path: Path, path: str
) -> None:
    (tmp_path / "etc").mkdir()
    m = manager(tiny_llama_dir, None, disk=DiskTier(LocalStore(tmp_path / "store")))
    ref = m.register_stored(LoRARef("evil", "acme", "d" * 64), path)
    m.prefetch([ref])
    assert m.wait_for([ref], timeout=60)
    message = m.failure(ref)
    assert message is not None and "unsafe object key" in message
    assert not m.ready(ref)
    m.close()


def test_an_adapter_larger_than_the_whole_budget_fails_its_requests_with_the_reason(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          num_kv_blocks=64, block_size=4, lora_memory=1024)  # fmt: skip
    engine = Engine(config)
    big = engine.register_lora("r64", peft_adapters["r64"], "acme")
    assert engine.loras.device_bytes(big) > 1024
    small_ok = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), [None])
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), [big])
    assert out.finish_reason == "error" and out.error is not None
    assert "more than the whole adapter memory budget" in out.error and "--lora-memory" in out.error
    refused = engine.loras.refusal(big)  # never to run here: a client's error (TooLarge)
    assert refused is not None and "--lora-memory" in refused
    assert small_ok[0].error is None


def stored_manager(
    model: Path, adapters: dict[str, Path], tmp_path: Path, **kw: Any
) -> tuple[LoRAManager, list[LoRARef]]:
    """A manager over a disk tier holding the NAMES adapters as stored versions, all cold."""
    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(model)
    m = manager(model, None, disk=DiskTier(store), **kw)
    refs = []
    for name in NAMES:
        v = ingest(adapters[name], "acme", name, spec, AdapterLimits(), store)
        refs.append(m.register_stored(LoRARef(name, "acme", v.digest), v.path))
    return m, refs


def test_a_prefetch_list_longer_than_the_depth_loads_only_its_head(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    m, refs = stored_manager(tiny_llama_dir, peft_adapters, tmp_path, prefetch_depth=2)
    m.prefetch(refs)
    assert m.wait_for(refs, timeout=60)
    states = [m.registry.entries[r.key].state for r in refs]  # the tier's own state
    assert states[:2] == [State.HOST, State.HOST] and states[2:] == [State.COLD, State.COLD]
    m.close()


class CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts full scans (values, items, iteration)."""

    scans = 0

    def values(self):  # type: ignore[no-untyped-def, override]
        CountingDict.scans += 1
        return super().values()

    def items(self):  # type: ignore[no-untyped-def, override]
        CountingDict.scans += 1
        return super().items()

    def __iter__(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().__iter__()


def test_a_step_never_scans_the_registry_however_many_versions_are_registered(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          num_kv_blocks=256, block_size=4, max_cpu_loras=2)  # fmt: skip
    engine = Engine(config, disk=DiskTier(store))
    v = ingest(peft_adapters["r4"], "acme", "r4", spec, AdapterLimits(), store)
    ref = engine.loras.register_stored(LoRARef("r4", "acme", v.digest), v.path)
    for i in range(5000):  # a catalog replica that has seen many versions
        engine.loras.register_stored(LoRARef(f"x{i}", "acme", f"{i:064x}"), v.path)
    engine.loras.registry.entries = CountingDict(engine.loras.registry.entries)
    CountingDict.scans = 0
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4), [ref])
    assert out.error is None and len(out.token_ids) == 4
    assert CountingDict.scans == 0


def test_idle_stored_versions_are_forgotten_and_registered_again_on_use(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    m = manager(tiny_llama_dir, None, disk=DiskTier(store))
    refs = {}
    for name in ("r4", "r16", "r8-qv"):
        v = ingest(peft_adapters[name], "acme", name, spec, AdapterLimits(), store)
        refs[name] = m.register_stored(LoRARef(name, "acme", v.digest), v.path)
    static = m.register("static", peft_adapters["r4"], "acme")
    m.prefetch([refs["r4"]])
    assert m.wait_for([refs["r4"]], timeout=60)  # r4 holds a host copy: it stays
    time.sleep(0.05)
    forgotten = m.forget_idle(0.01, needed=[refs["r16"].key])  # r16 is wanted by a request
    assert [r.name for r in forgotten] == ["r8-qv"]
    assert not m.is_registered(refs["r8-qv"]) and m.lookup("r8-qv", "acme") is None
    assert all(m.is_registered(r) for r in (refs["r4"], refs["r16"], static))
    m.register_stored(refs["r8-qv"], "adapters/acme/r8-qv/")  # the next request's resolve
    assert m.is_registered(refs["r8-qv"])
    m.close()


def test_loader_threads_run_at_the_configured_low_priority(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import os

    from loraplane.dataplane.lora import registry as module

    seen: list[int] = []
    real = module.load_lora

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "load_lora", recording)
    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    v = ingest(peft_adapters["r4"], "acme", "r4", spec, AdapterLimits(), store)
    for nice in (7, 0):
        monkeypatch.setenv("LORAPLANE_LOADER_NICE", str(nice))
        m = manager(tiny_llama_dir, None, disk=DiskTier(store))
        ref = m.register_stored(LoRARef(f"r4-{nice}", "acme", v.digest), v.path)
        m.prefetch([ref])
        assert m.wait_for([ref], timeout=60)
        m.close()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen == [max(base, 7), base]
    monkeypatch.setenv("LORAPLANE_LOADER_NICE", "twenty")
    with pytest.raises(ValueError, match="LORAPLANE_LOADER_NICE"):
        manager(tiny_llama_dir, None)
