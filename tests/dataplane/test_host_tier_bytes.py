"""The host tier under a byte limit (`max_cpu_lora_bytes`, `--max-cpu-lora-bytes`).

Real adapters (PEFT, on the tiny model): the tier evicts least recently used copies until both
its count and its bytes are within their limits, never one in a device slot, in use or pinned;
a version larger than the whole limit fails alone with the reason, and is not read again while
the limit stays below its weight. Loads ahead of need (prefetch) start only into room and a
copy read ahead is kept only where it fits: under a burst of cold adapters the tier never
holds more than the limit, while the adapter each tenant's next admission needs still loads.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.lora import registry as registry_module
from loraplane.dataplane.lora.entry import State
from loraplane.dataplane.lora.manager import LoRAManager
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.dataplane.snapshot import EngineSnapshot
from loraplane.dataplane.tiers.disk import DiskTier
from loraplane.sizes import format_bytes, parse_bytes
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


def test_loads_ahead_never_take_the_tier_over_the_byte_limit_and_every_request_runs(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Twelve requests at once, each for its own adapter (one file stored under twelve names:
    every copy weighs the same), one device slot, a byte limit of three copies, and room in
    the count for eight loaded ahead (`max_cpu_loras / 2`). A thread samples the tier's bytes
    throughout and a step observer the gauge's value: never above the limit. Every request
    runs, each adapter loaded when its request came first."""
    store = LocalStore(tmp_path / "store")
    names = [f"bot{i:02d}" for i in range(12)]
    versions = stored(store, tiny_llama_dir, dict.fromkeys(names, peft_adapters["r16"]))
    limit = 3 * copy_bytes(tiny_llama_dir, peft_adapters["r16"])
    engine = engine_for(tiny_llama_dir, DiskTier(store), max_loras=1, max_cpu_loras=16,
                        max_cpu_lora_bytes=limit)  # fmt: skip
    assert engine.loras.prefetch_depth == 8  # what the count alone lets load ahead
    refs = register(engine, versions)
    sampled, gauge = [0], [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            sampled.append(engine.loras.host.bytes)
            time.sleep(0.0001)

    engine.observers.append(lambda _: gauge.append(EngineSnapshot.of(engine).cpu_bytes_used))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        outs = engine.generate([[5, 6, 7]] * len(names), GREEDY, [refs[n] for n in names])
    finally:
        stop.set()
        sampler.join()
        engine.loras.close()
    assert [o.error for o in outs] == [None] * len(names)
    assert len(sampled) > 100 and len(gauge) >= len(names)
    assert max(sampled) <= limit and max(gauge) <= limit, (max(sampled), max(gauge), limit)
    assert engine.loras.host_stats.loads >= len(names)


def test_the_adapter_a_tenants_next_request_needs_loads_the_ones_behind_it_wait_for_room(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """acme's waiting copies fill the byte limit: its next adapter in line is not read, while
    globex's first one (its next admission's) loads anyway, over the limit: one tenant's
    copies never hold another's requests back. Skipped loads are not pending (the engine does
    not wait for them)."""
    store = LocalStore(tmp_path / "store")
    copy = copy_bytes(tiny_llama_dir, peft_adapters["r16"])
    m = manager(tiny_llama_dir, None, disk=DiskTier(store), max_cpu_lora_bytes=2 * copy,
                max_loads_in_flight=1)  # fmt: skip
    base, refs = BaseModelSpec.from_dir(tiny_llama_dir), {}
    for name, tenant in (("a1", "acme"), ("a2", "acme"), ("a3", "acme"), ("g1", "globex")):
        v = ingest(peft_adapters["r16"], tenant, name, base, AdapterLimits(), store)
        refs[name] = m.register_stored(LoRARef(name, tenant, v.digest), v.path)
    folders = reads(monkeypatch)
    acme = [refs["a1"], refs["a2"], refs["a3"]]
    m.prefetch(acme)
    assert m.wait_for(acme, 30)
    assert in_host(m) == {"a1", "a2"} and m.host.bytes == 2 * copy  # a3: no room
    assert len(folders) == 2 and m.registry.entries[refs["a3"].key].state is State.COLD
    assert refs["a3"].key not in m.pending()  # skipped: the engine does not wait for it
    m.prefetch([*acme, refs["g1"]])  # globex's first request arrives
    assert m.wait_for([refs["g1"]], 30)
    assert in_host(m) == {"a1", "a2", "g1"} and len(folders) == 3  # a3 still not read
    m.close()


def test_the_trim_after_a_step_keeps_the_copy_a_waiting_request_needs_over_the_limit(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Room for one copy and one slot: acme's adapter runs for several steps while globex's
    request waits with its copy loaded (its next admission needs it: over the limit). The
    host tier's trim after each step keeps that copy, so it is read once, not once a step."""
    store = LocalStore(tmp_path / "store")
    copy = copy_bytes(tiny_llama_dir, peft_adapters["r16"])
    engine = engine_for(tiny_llama_dir, DiskTier(store), max_loras=1, max_cpu_loras=16,
                        max_cpu_lora_bytes=copy)  # fmt: skip
    base, refs = BaseModelSpec.from_dir(tiny_llama_dir), []
    for tenant in ("acme", "globex"):
        v = ingest(peft_adapters["r16"], tenant, "bot", base, AdapterLimits(), store)
        refs.append(engine.loras.register_stored(LoRARef("bot", tenant, v.digest), v.path))
    folders = reads(monkeypatch)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = engine.generate([[5, 6, 7], [5, 6, 7]], long, refs)
    engine.loras.close()
    assert [o.error for o in outs] == [None, None]
    assert len(folders) == 2  # each copy read once


def test_a_copy_read_ahead_that_turns_out_too_big_for_the_room_is_dropped_and_not_read_again(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A version never loaded is expected to weigh what the tier's copies weigh on average;
    a larger one read ahead that does not fit beside the waiting copies is not kept (the tier
    stays within the limit), and, its weight known now, is not read again until it fits."""
    store = LocalStore(tmp_path / "store")
    versions = stored(store, tiny_llama_dir, {"small": peft_adapters["r4"],
                                              "big": peft_adapters["r32-mlp"]})  # fmt: skip
    small = copy_bytes(tiny_llama_dir, peft_adapters["r4"])
    big = copy_bytes(tiny_llama_dir, peft_adapters["r32-mlp"])
    assert big > 2 * small
    limit = small + big - 1
    m = manager(tiny_llama_dir, None, disk=DiskTier(store), max_cpu_lora_bytes=limit,
                max_loads_in_flight=1)  # fmt: skip
    refs = [m.register_stored(LoRARef(n, v.tenant, v.digest), v.path) for n, v in versions.items()]
    folders = reads(monkeypatch)
    m.prefetch(refs)  # small first: its tenant's next; big behind it, expected at small's size
    assert m.wait_for(refs, 30)
    entry = m.registry.entries[refs[1].key]
    assert in_host(m) == {"small"} and m.host.bytes == small <= limit
    assert entry.state is State.COLD and entry.last_host_bytes == big and len(folders) == 2
    m.prefetch(refs)
    assert m.wait_for(refs, 30)
    assert len(folders) == 2 and refs[1].key not in m.pending()  # known too big for the room
    m.prefetch(refs[1:])  # small's request ran: its copy may go, so big is first and fits
    assert m.wait_for(refs, 30)
    assert in_host(m) == {"big"} and m.host.bytes == big <= limit and len(folders) == 3
    m.close()


def test_a_copy_read_ahead_leaves_room_for_the_loads_before_it_that_end_later(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Nothing hosted yet, so no load's weight is known when a1 (acme's next), a2 and a3
    start together; a3 ends first, then a1, then a2. a3 is not kept: the room it would take
    is a2's, which comes before it in the list (kept, a2 would be dropped, then load over the
    limit once its request came first, beside a1 in the device slot and a3 waiting)."""
    store = LocalStore(tmp_path / "store")
    names = ["a1", "a2", "a3"]
    versions = stored(store, tiny_llama_dir, dict.fromkeys(names, peft_adapters["r16"]))
    copy = copy_bytes(tiny_llama_dir, peft_adapters["r16"])
    m = manager(tiny_llama_dir, None, disk=DiskTier(store), max_cpu_lora_bytes=2 * copy,
                max_loads_in_flight=3)  # fmt: skip
    refs = [m.register_stored(LoRARef(n, v.tenant, v.digest), v.path) for n, v in versions.items()]
    may_end = {n: threading.Event() for n in names}
    folders: list[str] = []
    read = m.registry.read

    def gated(entry: Any) -> Any:
        folders.append(entry.ref.name)
        whole = read(entry)
        assert may_end[entry.ref.name].wait(30)
        return whole

    def wait_until(predicate: Any) -> None:
        deadline = time.monotonic() + 30
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert predicate()

    m.registry.read = gated  # type: ignore[method-assign]
    assert m.prefetch(refs) == 3  # all three in flight, none weighed yet
    for name in ("a3", "a1", "a2"):
        may_end[name].set()
        wait_until(lambda name=name: name not in {e.ref.name for e in m.registry.entries.values()
                                                  if e.state is State.LOADING})  # fmt: skip
    assert in_host(m) == {"a1", "a2"} and m.host.bytes == 2 * copy
    assert sorted(folders) == names  # a3, weighed now, was not read again while no room
    assert m.registry.entries[refs[2].key].state is State.COLD  # read, not kept
    m.make_resident([refs[0].key], in_use=[refs[0].key])  # a1's request runs
    m.prefetch(refs[1:])  # a2 comes first now, held; a3 has no room beside a1 and a2
    assert m.wait_for(refs, 30)
    assert in_host(m) == {"a1", "a2"} and m.host.bytes == 2 * copy <= 2 * copy
    assert refs[2].key not in m.pending() and len(folders) == 3
    m.close()


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


def test_sizes_read_back_in_the_unit_they_are_written_in() -> None:
    """format_bytes (the CLIs' sizes, `serve`'s startup line) and parse_bytes agree."""
    for text, shown in (("8GiB", "8.00 GiB"), ("512MiB", "512.00 MiB"), ("4096", "4.0 KiB")):
        assert format_bytes(parse_bytes(text)) == shown
    assert format_bytes((1 << 30) - 1) == "1024.00 MiB" and format_bytes(1 << 30) == "1.00 GiB"


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
