"""Pinned adapter versions: never evicted from the device or host memory, placed each step,
counted in the budget and in their tenant's adapter memory, refused past their cap.

Real adapters (PEFT, on the tiny model) in a real CPU pool for the tiers; the scheduler's fake
tiers (test_scheduler.Tiers) for the share rules; a real engine for the flood.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.lora.errors import PinRefused
from loraplane.dataplane.lora.manager import LoRAManager
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import DiskTier
from tests.dataplane.test_lora_manager import NAMES, manager, sizes, stored_manager
from tests.dataplane.test_scheduler import Tiers, adapter, make, rows, seq, step


def churn(m: LoRAManager, refs: list[LoRARef], rounds: int) -> None:
    """Each ref in turn read into host memory (prefetch off: now) and made resident for a
    step, the previous one still running."""
    previous: list[str] = []
    for i in range(rounds):
        ref = refs[(i * 7 + 1) % len(refs)]
        assert m.ready(ref)
        m.make_resident([ref.key], in_use=previous)
        previous = [ref.key]


def test_a_pinned_adapter_stays_on_the_device_and_in_host_memory_under_eviction_pressure(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    m = manager(tiny_llama_dir, None, slots=16, prefetch=False)
    refs = [m.register(n, peft_adapters[n], f"t{t}") for n in NAMES for t in range(8)]
    m.max_cpu_loras = 16  # the host tier too is under pressure
    m.device_budget_bytes = 4 * max(m.device_bytes(r) for r in refs)
    pinned = refs[0]
    assert m.pin(pinned) == "host"
    assert m.pins() == [pinned]
    assert m.place(pinned, in_use=[])
    assert m.pin_state(pinned) == "resident"
    churn(m, refs[1:], 200)
    assert m.device_stats.evictions > 100  # the others were evicted, over and over
    assert m.host_stats.evictions > 100  # and from host memory too
    assert pinned in m.resident and m.in_host_memory(pinned)
    assert m.pool.bytes_used <= m.device_budget_bytes
    hits = m.device_stats.hits
    m.make_resident([pinned.key], in_use=[])
    assert m.device_stats.hits == hits + 1  # a hit: no load for the pinned version
    # the control: unpinned, the same churn evicts it
    assert m.unpin(pinned) and not m.unpin(pinned)
    churn(m, refs[1:], 200)
    assert pinned not in m.resident
    m.close()


def test_a_pinned_stored_version_loads_at_once_and_is_never_forgotten_as_idle(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    m, refs = stored_manager(tiny_llama_dir, peft_adapters, tmp_path)
    assert m.pin(refs[0]) == "loading"  # cold: its load starts now, no request needed
    deadline = time.monotonic() + 10
    while not m.pins() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.pins() == [refs[0]] and m.pin_state(refs[0]) == "host"
    m.unpin(refs[0])
    m.pin(refs[1])  # cold and idle: forget_idle must pass it by
    time.sleep(0.02)
    forgotten = {r.name for r in m.forget_idle(0.001)}
    assert refs[1].name not in forgotten and m.is_registered(refs[1])
    m.close()


def test_pins_past_their_cap_of_memory_or_slots_are_refused_naming_the_numbers(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    m = manager(tiny_llama_dir, None, slots=4)  # at most 2 pins: half the slots
    refs = {n: m.register(n, peft_adapters[n], "acme") for n in NAMES}
    size = sizes(m, refs)
    m.device_budget_bytes = 2 * (size["r16"] + size["r4"])  # pins: up to half of it
    m.pin(refs["r16"])
    m.pin(refs["r4"])
    assert m.pinned_bytes("acme") == size["r16"] + size["r4"] == m.pin_cap_bytes
    with pytest.raises(PinRefused, match=r"3 adapters on this replica, more than its cap of 2"):
        m.pin(refs["r8-qv"])
    m.unpin(refs["r4"])
    with pytest.raises(PinRefused) as refused:
        m.pin(refs["r32-mlp"])
    message = str(refused.value)
    assert f"needs {size['r32-mlp']} bytes" in message
    assert f"{size['r16']} bytes pinned already" in message
    assert f"{m.pin_cap_bytes} bytes pins may take" in message and "--lora-memory" in message
    assert m.pin_state(refs["r32-mlp"]) == "unpinned"
    with pytest.raises(KeyError):
        m.pin(LoRARef("nope", "acme", "0" * 64))
    m.close()


def test_a_pin_whose_size_learnt_at_load_does_not_fit_is_dropped_with_the_reason(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    m, refs = stored_manager(tiny_llama_dir, peft_adapters, tmp_path)
    m.device_budget_bytes = 1000  # far less than any adapter: pins may take 500 bytes
    assert m.pin(refs[0]) == "loading"
    assert m.wait_for(refs[:1], timeout=60)
    assert m.pins() == []
    state = m.pin_state(refs[0])
    assert state.startswith("refused: pinning r4 needs") and "500 bytes pins may take" in state
    m.close()


def test_unregistering_a_version_drops_its_pin(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    m = manager(tiny_llama_dir, None)
    ref = m.register("r4", peft_adapters["r4"], "acme")
    m.pin(ref)
    m.unregister("r4", "acme")
    assert m.pinned == [] and m.pins() == []
    m.close()


# -- the scheduler ----------------------------------------------------------------------------


def test_a_pinned_version_takes_its_place_in_the_budget_every_step() -> None:
    # a budget of three 10-byte adapters, one of them pinned: two others run at once
    sched = make(max_loras=8, max_num_seqs=16)
    pin = adapter("pinned", tenant="quiet")
    tiers = Tiers(sizes={}, budget_bytes=30, pinned=[pin])
    tiers.sizes = {n: 10 for n in ("pinned", "a", "b", "c")}
    for name in ("a", "b", "c"):
        sched.add(seq(4, 50, lora=adapter(name, tenant="busy"), tenant="busy"))
    out, _ = step(sched, tiers=tiers)
    assert {k.split("@")[0] for k in out.lora_keys} == {"busy/a", "busy/b"}
    # its request needs no room: the pinned version is already counted
    quiet = seq(4, 4, lora=pin, tenant="quiet")
    sched.add(quiet)
    out, _ = step(sched, tiers=tiers)
    assert quiet.request_id in rows(out) and not out.preempted


@pytest.mark.parametrize("pinned", [True, False])
def test_a_tenant_s_pins_count_in_its_adapter_memory_share(pinned: bool) -> None:
    # budget 30: the busy tenant runs two 10-byte adapters; the quiet tenant pins one (10)
    # and wants another. Counted with its pin, it would hold 20 against busy's 10 after a
    # swap: no swap (the hysteresis). The control: without the pin it takes busy's memory.
    sched = make(max_loras=8, max_num_seqs=16, max_deferral_steps=1000)
    pin = adapter("pinned", tenant="quiet")
    tiers = Tiers(budget_bytes=30 if pinned else 20, pinned=[pin] if pinned else [])
    tiers.sizes = {n: 10 for n in ("pinned", "a", "b", "more")}
    for name in ("a", "b"):
        sched.add(seq(4, 200, lora=adapter(name, tenant="busy"), tenant="busy"))
    step(sched, tiers=tiers)
    more = seq(4, 4, lora=adapter("more", tenant="quiet"), tenant="quiet")
    sched.add(more)
    out, _ = step(sched, tiers=tiers)
    assert (more.request_id in rows(out)) is not pinned
    assert bool(out.preempted) is not pinned


# -- the engine under a flood -----------------------------------------------------------------


def test_after_a_flood_over_many_adapters_the_pinned_one_s_request_takes_no_load(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    probe = manager(tiny_llama_dir, None)
    size = probe.device_bytes(probe.register("r16", peft_adapters["r16"]))
    probe.close()
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          num_kv_blocks=256, block_size=4, max_cpu_loras=6,
                          lora_memory=4 * size, max_num_seqs=8)  # fmt: skip
    engine = Engine(config, disk=DiskTier(store))
    refs = []
    for i in range(24):  # many versions (a tenant each), far more than the device holds
        v = ingest(peft_adapters[NAMES[i % 4]], f"t{i}", "a", spec, AdapterLimits(), store)
        refs.append(engine.loras.register_stored(LoRARef("a", f"t{i}", v.digest), v.path))
    pinned = refs[1]  # r16: the largest pinnable
    engine.loras.pin(pinned)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    (first,) = engine.generate([[5, 6, 7]], params, [pinned])
    assert first.error is None and engine.loras.pin_state(pinned) == "resident"
    host, device = engine.loras.host_stats.loads, engine.loras.device_stats.loads
    others = [r for r in refs if r != pinned]
    outs = engine.generate([[5, 6, 7]] * 46, params, [others[i % 23] for i in range(46)])
    assert all(o.error is None for o in outs)
    assert engine.loras.device_stats.evictions > 10 and engine.loras.host_stats.evictions > 10
    assert engine.loras.device_stats.loads > device + 10
    host, device = engine.loras.host_stats.loads, engine.loras.device_stats.loads
    (after,) = engine.generate([[5, 6, 7]], params, [pinned])
    assert after.error is None and after.token_ids == first.token_ids
    assert (engine.loras.host_stats.loads, engine.loras.device_stats.loads) == (host, device)
    engine.close()
