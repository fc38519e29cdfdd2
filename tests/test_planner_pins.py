"""The planner accounts for pinned adapters: their bytes in the adapter memory, what is left
for the rest of the traffic, and the data plane's cap (half the memory and slots)."""

from __future__ import annotations

import json

import pytest

from loraplane.cli import main
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.lora.manager import PIN_FRACTION
from loraplane.planner.memory import PIN_FRACTION as PLANNER_PIN_FRACTION
from loraplane.planner.memory import AdapterProfile, plan_memory
from loraplane.planner.replica import ReplicaSettings
from loraplane.planner.shapes import named_shape

QV_R16 = 13_631_488  # a q/v rank-16 adapter of Llama 3 8B in bf16 (test_planner.py)


def plan(pinned: int, lora_memory: int = 1 << 30, **config: object):  # type: ignore[no-untyped-def]
    engine = EngineConfig(model="m", dtype="bfloat16", device="cpu", lora_memory=lora_memory,
                          **config)  # type: ignore[arg-type]  # fmt: skip
    profile = AdapterProfile(100, 16, ("q_proj", "v_proj"), pinned=pinned)
    return plan_memory(named_shape("llama-3-8b"), engine, 64 << 30, profile)


def test_pinned_adapters_take_their_bytes_from_what_the_rest_of_the_traffic_has() -> None:
    p = plan(pinned=10)
    assert p.adapters_resident == (1 << 30) // QV_R16 == 78
    assert p.adapters_pinned == 10 and p.pinned_bytes == 10 * QV_R16
    assert p.adapters_unpinned == 68
    assert plan(pinned=0).adapters_unpinned == 78


def test_pins_past_half_the_adapter_memory_or_slots_are_refused_naming_the_numbers() -> None:
    assert plan(pinned=39).pinned_bytes == 39 * QV_R16  # 531 MB of 1,073 MB: fits
    with pytest.raises(ValueError, match=r"40 pinned adapters take 545,259,520 bytes .* more"
                       r" than the 536,870,912 bytes pins may take"):  # fmt: skip
        plan(pinned=40)
    with pytest.raises(ValueError, match=r"5 pinned adapters per replica exceed its cap of 4"):
        plan(pinned=5, max_loras=8)
    with pytest.raises(ValueError, match="exceed the adapters"):
        AdapterProfile(3, pinned=4)


def test_the_planner_caps_pins_as_the_data_plane_does() -> None:
    assert PLANNER_PIN_FRACTION == PIN_FRACTION


def test_plan_pinned_takes_the_pins_off_the_rest_of_the_traffic_in_the_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--model-shape", "llama-3-8b", "--gpu", "h100", "--adapters", "100",
            "--adapter-modules", "q_proj,v_proj", "--lora-memory", "1GiB"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    unpinned = json.loads(capsys.readouterr().out)
    assert main([*args, "--pinned", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    memory = out["memory"]
    assert memory["adapters_pinned"] == 10 and out["adapters"]["pinned"] == 10
    each = out["adapter_device_bytes"]  # (the GPU's slot: its max_lora_rank's layout)
    assert memory["pinned_bytes"] == 10 * each
    resident = (1 << 30) // each
    assert out["adapters_resident"] == unpinned["adapters_resident"] == resident
    assert out["adapters_unpinned"] == resident - 10
    assert unpinned["adapters_unpinned"] == resident
    assert main([*args, "--pinned", "10"]) == 0
    text = capsys.readouterr().out
    assert "  pinned           10 per replica, 167.8 MB of the adapter memory; 54 at once" in text
    assert main(args) == 0
    assert "  pinned  " not in capsys.readouterr().out  # no pins, no line


@pytest.mark.parametrize(
    ("pinned", "said"),
    [
        ("33", "33 pinned adapters take 553,648,128 bytes of adapter memory, more than the 536"),
        ("101", "pinned adapters (101) exceed the adapters (100)"),
        ("-1", "-1 is negative"),
        ("two", "'two' is not a whole number"),
    ],
)
def test_plan_pinned_past_the_data_plane_s_cap_or_the_adapters_is_refused(
    pinned: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--model-shape", "llama-3-8b", "--gpu", "h100", "--adapters", "100",
            "--adapter-modules", "q_proj,v_proj", "--lora-memory", "1GiB",
            "--pinned", pinned]  # fmt: skip
    try:
        code = main(args)
    except SystemExit as e:  # argparse refuses what is no count
        code = int(str(e.code))
    assert code == 2
    assert said in capsys.readouterr().err


def test_the_fleet_simulation_gives_the_traffic_what_the_pins_leave() -> None:
    engine = EngineConfig(model="m", dtype="bfloat16", device="cpu", lora_memory=1 << 30)
    pinned = plan(pinned=10)
    settings = ReplicaSettings.from_plan(pinned, engine)
    free = ReplicaSettings.from_plan(plan(pinned=0), engine)
    assert settings.lora_budget_bytes == free.lora_budget_bytes - 10 * QV_R16
    assert settings.lora_slots == free.lora_slots - 10
    assert settings.scheduler_config().max_loras == free.lora_slots - 10
