"""The planner under a host byte limit (`--max-cpu-lora-bytes`): the host tier keeps as many
copies as the bytes hold (every simulated copy weighs the same; under tensor parallelism rank 0
keeps every rank's part), a copy larger than the limit is refused, and the simulated replica's
host tier trims to it."""

from __future__ import annotations

import json

import pytest

from loraplane.cli import main
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.sequence import LoRARef
from loraplane.planner.memory import AdapterProfile, MemoryPlan, plan_memory
from loraplane.planner.replica import ReplicaSettings
from loraplane.planner.shapes import named_shape
from loraplane.planner.tiers import SimTiers

H200 = 141 * 10**9


def _plan(n: int = 1, max_cpu_lora_bytes: int | None = None) -> MemoryPlan:
    """Llama-3-8B on an H200, or Llama-3-70B split over `n` of them, 2,000 adapters."""
    config = EngineConfig(model="m", dtype="bfloat16", device="cuda", tensor_parallel_size=n,
                          max_cpu_lora_bytes=max_cpu_lora_bytes)  # fmt: skip
    shape = named_shape("llama-3-70b" if n > 1 else "llama-3-8b")
    return plan_memory(shape, config, H200, AdapterProfile(2000))


def test_the_byte_limit_caps_the_host_copies_and_the_host_tier_bytes() -> None:
    unlimited = _plan()
    copy = unlimited.adapter_bytes
    assert unlimited.host_copies == unlimited.max_cpu_loras == 512
    plan = _plan(max_cpu_lora_bytes=100 * copy + copy // 2)
    assert (plan.max_cpu_loras, plan.host_copies) == (512, 100)
    assert plan.host_tier_bytes == 100 * copy
    roomy = _plan(max_cpu_lora_bytes=10_000 * copy)  # the count is the tighter limit
    assert roomy.host_copies == 512 and roomy.host_tier_bytes == 512 * copy


def test_under_tensor_parallelism_a_copy_weighs_every_ranks_part() -> None:
    whole = _plan(2)
    copy = whole.adapter_bytes * 2  # rank 0 keeps both parts
    plan = _plan(2, max_cpu_lora_bytes=10 * copy)
    assert plan.host_copies == 10 and plan.host_tier_bytes == 10 * copy
    assert _plan(2, max_cpu_lora_bytes=10 * copy - 1).host_copies == 9


def test_a_byte_limit_below_one_copy_is_refused_with_the_numbers() -> None:
    copy = _plan().adapter_bytes
    with pytest.raises(ValueError, match=rf"--max-cpu-lora-bytes \(1024 bytes\).*\({copy} bytes"):
        _plan(max_cpu_lora_bytes=1024)


def test_the_simulated_host_tier_trims_to_the_copies_the_bytes_hold() -> None:
    tiers = SimTiers(slots=4, budget_bytes=4000, device_bytes=1000, max_cpu_loras=8, load_s=0.1,
                     loads_in_flight=2, host_copies=3)  # fmt: skip
    assert (tiers.host_limit, tiers.prefetch_depth) == (
        3,
        4,
    )  # prefetch: the count's, as the engine
    tiers.warm([LoRARef(f"a{i}", "t", f"{i:064x}").key for i in range(6)])
    running = LoRARef("a0", "t", f"{0:064x}").key
    tiers.trim_host({running})
    assert len(tiers.host) == 3 and running in tiers.host  # the oldest idle ones went
    count_only = SimTiers(4, 4000, 1000, 8, 0.1, 2)
    assert count_only.host_limit == 8


def test_under_a_byte_limit_the_simulated_prefetch_loads_ahead_only_into_room() -> None:
    """The engine's room rule (lora/loads.py): the tenant's first adapter loads whatever the
    room, the others only while the copies that must stay and the loads in flight leave room."""
    refs = [LoRARef(f"a{i}", "t", f"{i:064x}") for i in range(6)]

    def run(host_copies: int | None) -> SimTiers:
        tiers = SimTiers(slots=4, budget_bytes=4000, device_bytes=1000, max_cpu_loras=8,
                         load_s=0.1, loads_in_flight=2, host_copies=host_copies)  # fmt: skip
        tiers.prefetch(refs, 0.0)  # the list: the first 4 (max_cpu_loras / 2)
        for step in range(1, 10):
            tiers.advance(step * 0.1)
        return tiers

    limited = run(3)
    assert limited.loads == 3 and list(limited.host) == [r.key for r in refs[:3]]
    assert limited.pending() == set()  # a3 is held back by the room, not awaited
    count_only = run(None)  # no byte limit: the whole list loads
    assert count_only.loads == 4 and len(count_only.host) == 4
    assert count_only.pending() == set()


def test_replica_settings_take_the_byte_limits_copies_from_the_plan() -> None:
    copy = _plan().adapter_bytes
    config = EngineConfig(model="m", dtype="bfloat16", device="cuda", max_cpu_lora_bytes=7 * copy)
    plan = plan_memory(named_shape("llama-3-8b"), config, H200, AdapterProfile(2000))
    assert ReplicaSettings.from_plan(plan, config).host_copies == 7
    plain = EngineConfig(model="m", dtype="bfloat16", device="cuda")
    plan = plan_memory(named_shape("llama-3-8b"), plain, H200, AdapterProfile(2000))
    assert ReplicaSettings.from_plan(plan, plain).host_copies is None


def test_plan_takes_the_flag_and_reports_the_copies(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model-shape", "llama-3-8b", "--gpu", "h200", "--adapters", "2000",
                 "--max-cpu-lora-bytes", "8GiB", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    copy = out["adapter_bytes"]
    assert out["memory"]["max_cpu_lora_bytes"] == 8 << 30
    assert out["memory"]["host_copies"] == (8 << 30) // copy
    assert out["host_tier_bytes"] == (8 << 30) // copy * copy
    assert main(["plan", "--model-shape", "llama-3-8b", "--gpu", "h200",
                 "--max-cpu-lora-bytes", "8GiB"]) == 0  # fmt: skip
    assert f"max_cpu_lora_bytes 8.6 GB: {(8 << 30) // copy} copies fit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model-shape", "llama-3-8b", "--max-cpu-lora-bytes", "half"])
    assert exit_.value.code == 2
    assert main(["plan", "--model-shape", "llama-3-8b", "--gpu", "h200",
                 "--max-cpu-lora-bytes", "1024"]) == 2  # fmt: skip
    assert "every adapter's load would fail" in capsys.readouterr().err
