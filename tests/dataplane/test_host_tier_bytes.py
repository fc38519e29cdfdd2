"""The host tier under a byte limit (`max_cpu_lora_bytes`, `--max-cpu-lora-bytes`).

Real adapters (PEFT, on the tiny model): the tier evicts least recently used copies until both
its count and its bytes are within their limits, never one in a device slot, in use or pinned;
a version larger than the whole limit fails alone with the reason, and is not read again while
the limit stays below its weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.store import LocalStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.lora import registry as registry_module
from loraplane.dataplane.lora.manager import LoRAManager
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.dataplane.snapshot import EngineSnapshot
from loraplane.dataplane.tiers.disk import DiskTier
from loraplane.sizes import parse_bytes
from tests.dataplane.test_lora_manager import NAMES, manager
from tests.dataplane.test_tiers import engine_for, register, stored

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture
def hosted(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> tuple[LoRAManager, dict[str, LoRARef], dict[str, int]]:
    """A manager holding the NAMES adapters in host memory (registered in that order, so the
    first is the least recently used), and each one's host bytes."""
    m = manager(tiny_llama_dir, None)
    refs = {n: m.register(n, peft_adapters[n], "acme") for n in NAMES}
    weights = {n: m.registry.entries[r.key].host_bytes for n, r in refs.items()}
    assert all(w > 0 for w in weights.values()) and m.host.bytes == sum(weights.values())
    return m, refs, weights


def in_host(m: LoRAManager) -> set[str]:
    return {r.name for r in m.in_host}


def copy_bytes(model: Path, adapter: Path) -> int:
    """Host bytes of `adapter`'s copy on the tiny model's CPU pool."""
    probe = manager(model, None)
    return probe.registry.entries[probe.register("probe", adapter).key].host_bytes


def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders the loader threads read adapters from, from now on."""
    seen: list[Path] = []
    real = registry_module.load_lora

    def counted(path: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(registry_module, "load_lora", counted)
    return seen


def test_the_byte_limit_evicts_least_recently_used_copies_until_under_it(
    hosted: tuple[LoRAManager, dict[str, LoRARef], dict[str, int]],
) -> None:
    m, _, weights = hosted
    # room for the two most recent copies and a byte less than the third
    m.max_cpu_lora_bytes = weights["r8-qv"] + weights["r32-mlp"] + weights["r16"] - 1
    m.host.evict()
    assert in_host(m) == {"r8-qv", "r32-mlp"}  # r4 then r16 went, the oldest first
    assert m.host.bytes == weights["r8-qv"] + weights["r32-mlp"] <= m.max_cpu_lora_bytes
    assert m.host_stats.evictions == 2
    assert m.max_cpu_loras == 64  # the count alone would have kept them all


def test_the_byte_limit_never_evicts_a_device_resident_in_use_or_pinned_copy(
    hosted: tuple[LoRAManager, dict[str, LoRARef], dict[str, int]],
) -> None:
    m, refs, weights = hosted
    m.make_resident([refs["r4"].key], in_use=[])  # the oldest copy, now in a device slot
    m.pin(refs["r8-qv"])
    m.max_cpu_lora_bytes = 1  # nothing fits: everything that may go goes
    m.host.evict(needed=[refs["r16"].key])  # r16: a running or waiting request's
    assert in_host(m) == {"r4", "r16", "r8-qv"}  # the tier stays over its limit until they go
    assert m.host.bytes == weights["r4"] + weights["r16"] + weights["r8-qv"]
    m.drop_slot(refs["r4"].key)
    m.host.evict(needed=[refs["r16"].key])
    assert in_host(m) == {"r16", "r8-qv"}


def test_both_limits_hold_the_count_evicts_even_when_the_bytes_fit(
    hosted: tuple[LoRAManager, dict[str, LoRARef], dict[str, int]],
) -> None:
    m, _, weights = hosted
    m.max_cpu_lora_bytes = sum(weights.values())  # every byte fits
    m.max_cpu_loras = 2
    m.host.evict()
    assert in_host(m) == {"r8-qv", "r32-mlp"}


def test_a_static_adapter_larger_than_the_whole_byte_limit_is_refused_as_TooLarge(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    m = manager(tiny_llama_dir, None, max_cpu_lora_bytes=1024)
    with pytest.raises(AdapterRejected) as caught:
        m.register("r64", peft_adapters["r64"], "acme")
    assert caught.value.code is ReasonCode.TOO_LARGE
    assert "more than the whole host adapter limit (1024 bytes" in caught.value.message
    assert "--max-cpu-lora-bytes" in caught.value.message
    assert m.lookup("r64", "acme") is None and m.host.bytes == 0  # nothing recorded


def test_the_host_bytes_stay_under_the_limit_across_loads_of_more_adapters_than_fit(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    versions = stored(store, tiny_llama_dir, {n: peft_adapters[n] for n in NAMES})
    probe = manager(tiny_llama_dir, None)
    weights = {n: probe.registry.entries[probe.register(n, peft_adapters[n]).key].host_bytes
               for n in NAMES}  # fmt: skip
    # one device slot, and room for the largest copy and the one beside it: never all four
    limit = sum(sorted(weights.values())[-2:])
    assert sum(weights.values()) > limit
    engine = engine_for(tiny_llama_dir, DiskTier(store), max_loras=1, max_cpu_loras=8,
                        max_cpu_lora_bytes=limit)  # fmt: skip
    refs = register(engine, versions)
    for _ in range(2):
        for name in NAMES:
            (out,) = engine.generate([[5, 6, 7]], GREEDY, [refs[name]])
            assert out.error is None, out.error
            snap = EngineSnapshot.of(engine)
            assert snap.cpu_bytes_used == engine.loras.host.bytes <= limit, name
            assert snap.cpu_bytes_limit == limit
    assert engine.loras.host_stats.evictions > 0
    engine.loras.close()


def test_a_stored_adapter_larger_than_the_whole_byte_limit_fails_its_request_alone(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    versions = stored(store, tiny_llama_dir, {"r64": peft_adapters["r64"]})
    engine = engine_for(tiny_llama_dir, DiskTier(store), max_cpu_lora_bytes=1024)
    refs = register(engine, versions)
    outs = engine.generate([[5, 6, 7], [5, 6, 7]], GREEDY, [refs["r64"], None])
    assert outs[0].finish_reason == "error" and outs[0].error is not None
    assert "more than the whole host adapter limit (1024 bytes" in outs[0].error
    assert "--max-cpu-lora-bytes" in outs[0].error
    assert outs[1].error is None  # the base model's request went on
    assert engine.loras.host.bytes == 0 and engine.loras.host_stats.failures >= 1
    engine.loras.close()


def test_a_version_too_heavy_for_the_limit_is_read_once_while_the_limit_stays_below_it(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Its requests fail with the reason (`refusal`: a client's error, not a retry) and, with
    the retry window closed at once, later ones fail the same without another read; once the
    limit is raised above its weight it loads and serves."""
    store = LocalStore(tmp_path / "store")
    versions = stored(store, tiny_llama_dir, {"r64": peft_adapters["r64"]})
    engine = engine_for(tiny_llama_dir, DiskTier(store), max_cpu_lora_bytes=1024)
    engine.loras.retry_after_s = 0.0  # a failed load would be tried again at once
    (ref,) = register(engine, versions).values()
    folders = reads(monkeypatch)
    for _ in range(3):
        (out,) = engine.generate([[5, 6, 7]], GREEDY, [ref])
        assert out.error is not None and "(1024 bytes, --max-cpu-lora-bytes)" in out.error
    assert len(folders) == 1  # read once, refused since by its weight
    assert engine.loras.refusal(ref) == engine.loras.failure(ref) == out.error
    weight = engine.loras.registry.entries[ref.key].last_host_bytes
    assert weight is not None and weight > 1024
    engine.loras.max_cpu_lora_bytes = weight - 1  # changed, still too small: still no read
    (out,) = engine.generate([[5, 6, 7]], GREEDY, [ref])
    assert out.error is not None and f"({weight - 1} bytes" in out.error and len(folders) == 1
    engine.loras.max_cpu_lora_bytes = weight
    assert engine.loras.refusal(ref) is None
    (out,) = engine.generate([[5, 6, 7]], GREEDY, [ref])
    assert out.error is None and len(folders) == 2 and engine.loras.host.bytes == weight
    engine.loras.close()


def test_max_cpu_lora_bytes_must_be_a_positive_integer() -> None:
    assert EngineConfig(model="m").max_cpu_lora_bytes is None  # default: no byte limit
    assert EngineConfig(model="m", max_cpu_lora_bytes=4096).max_cpu_lora_bytes == 4096
    for bad in (0, -1, 1.5, True, "8GiB"):
        with pytest.raises(ValueError, match="max_cpu_lora_bytes must be a positive integer"):
            EngineConfig(model="m", max_cpu_lora_bytes=bad)  # type: ignore[arg-type]


def test_the_flag_takes_sizes_as_users_write_them() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1G") == 10**9 and parse_bytes("4096") == 4096 == parse_bytes(4096)
    for bad in ("0.5", "0", "lots", "-1", "8 parsecs"):
        with pytest.raises(ValueError, match="max_cpu_lora_bytes"):
            parse_bytes(bad, "max_cpu_lora_bytes")
    settings = ServerSettings.load(model="m", max_cpu_lora_bytes="512MiB")
    assert settings.engine_config().max_cpu_lora_bytes == 512 * 2**20
    assert ServerSettings.load(model="m").engine_config().max_cpu_lora_bytes is None


def test_serve_takes_the_flag_and_the_variable_and_names_them_when_bad(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from loraplane.dataplane.server.cli import EXIT_USAGE, add_commands, run_serve
    from loraplane.dataplane.server.settings import SettingsError

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--max-cpu-lora-bytes", "half a GiB"])
    assert run_serve(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "LORAPLANE_MAX_CPU_LORA_BYTES / --max-cpu-lora-bytes" in err and "8GiB" in err
    monkeypatch.setenv("LORAPLANE_MAX_CPU_LORA_BYTES", "2GiB")
    assert ServerSettings.load(model="m").engine_config().max_cpu_lora_bytes == 2 << 30
    monkeypatch.setenv("LORAPLANE_MAX_CPU_LORA_BYTES", "0")
    with pytest.raises(SettingsError, match="LORAPLANE_MAX_CPU_LORA_BYTES"):
        ServerSettings.load(model="m")
