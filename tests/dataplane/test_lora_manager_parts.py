"""LoRAManager over its parts (lora/registry.py, host_tier.py, loads.py, device_tier.py,
pins.py): a setting changed on the manager changes what the part that uses it does, and the
loader threads wait for the one lock the engine thread holds.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from loraplane.dataplane.lora.loader import LoadedAdapter
from loraplane.dataplane.lora.manager import State
from tests.dataplane.test_lora_manager import stored_manager


def test_settings_set_on_the_manager_change_what_its_parts_do(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    m, refs = stored_manager(tiny_llama_dir, peft_adapters, tmp_path)
    m.prefetch_depth = 1  # the loads: one adapter of the list ahead
    m.prefetch(refs)
    assert m.wait_for(refs, timeout=60)
    assert [m.in_host_memory(r) for r in refs] == [True, False, False, False]
    m.prefetch_enabled = False  # the loads: none in the background, `ready` loads now
    assert m.prefetch(refs[1:]) == 0 and not m.in_host_memory(refs[1])
    assert m.ready(refs[1]) and m.in_host_memory(refs[1])
    assert m.pin_cap_slots == 4  # half of the 8 slots
    m.pin_fraction = 1.0  # the pins
    assert m.pin_cap_slots == 8
    m.max_cpu_loras = 1  # the host tier: one copy kept beyond those in use
    # the device tier: room for one of the two
    m.device_budget_bytes = max(m.device_bytes(refs[0]), m.device_bytes(refs[1]))
    m.make_resident([refs[0].key], in_use=[], wanted=[refs[1].key])
    assert m.in_host_memory(refs[0]) and m.in_host_memory(refs[1])  # one in use, one wanted
    m.make_resident([refs[1].key], in_use=[])  # evicts refs[0], idle, from both tiers
    assert [r.key for r in m.resident] == [refs[1].key]
    assert [m.in_host_memory(r) for r in refs[:2]] == [False, True]
    m.retry_after_s = 123.0
    assert m.loads.retry_after_s == 123.0 and m.max_loads_in_flight == 2
    m.close()


def test_a_loader_thread_keeps_its_copy_until_the_engine_thread_lets_go_of_the_lock(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    m, refs = stored_manager(tiny_llama_dir, peft_adapters, tmp_path)
    converted = threading.Event()
    real = m.host.host_form

    def host_form(adapter: LoadedAdapter) -> LoadedAdapter:
        out = real(adapter)
        converted.set()  # read and converted: next the loader thread takes the lock
        return out

    m.host.host_form = host_form  # type: ignore[method-assign]
    with m.registry.lock:  # as the engine thread does in a step
        m.prefetch(refs[:1])
        assert converted.wait(timeout=30)
        time.sleep(0.2)
        # the loader thread waits for the lock: the copy is not in the host tier yet
        assert m.registry.entries[refs[0].key].state is State.LOADING
        assert not m.in_host_memory(refs[0]) and m.pending() == {refs[0].key}
    assert m.wait_for(refs[:1], timeout=60)
    assert m.in_host_memory(refs[0]) and m.pending() == set()
    m.close()
