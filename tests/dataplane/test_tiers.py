"""Adapter tiers: object store -> disk -> host -> device, with prefetch and faults.

Stored versions are ingested for real (the adapter core into a LocalStore or an S3 API over
HTTP) and served by a real engine on the tiny model.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore, S3Store
from loraplane.adapters.store.base import ObjectStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import LOAD_WAIT_S, Engine
from loraplane.dataplane.lora.loader import load_lora
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import DiskTier
from tests import s3server

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 17, 33, 60, 101, 7]


def stored(store: ObjectStore, model: Path, adapters: dict[str, Path]) -> dict[str, AdapterVersion]:
    base = BaseModelSpec.from_dir(model)
    return {
        name: ingest(path, "acme", name, base, AdapterLimits(), store)
        for name, path in adapters.items()
    }


def engine_for(model: Path, disk: DiskTier | None, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256,
                                "block_size": 4, "max_loras": 2}  # fmt: skip
    settings.update(overrides)
    return Engine(EngineConfig(model=str(model), **settings), disk=disk)


def register(engine: Engine, versions: dict[str, AdapterVersion]) -> dict[str, LoRARef]:
    return {
        name: engine.loras.register_stored(LoRARef(name, v.tenant, v.digest), v.path)
        for name, v in versions.items()
    }


def tokens(engine: Engine, ref: LoRARef | None) -> list[int]:
    (out,) = engine.generate([PROMPT], GREEDY, [ref])
    assert out.error is None, out.error
    return out.token_ids


@pytest.fixture
def expected(tiny_llama_dir: Path, peft_adapters: dict[str, Path]) -> dict[str, list[int]]:
    """Each adapter's greedy tokens when registered statically (read straight from its folder)."""
    engine = engine_for(tiny_llama_dir, None, max_loras=8)
    return {n: tokens(engine, engine.register_lora(n, p, "acme")) for n, p in peft_adapters.items()}


def test_stored_versions_from_a_local_store_serve_like_static_ones(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    expected: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    versions = stored(store, tiny_llama_dir, peft_adapters)
    disk = DiskTier(store)
    engine = engine_for(tiny_llama_dir, disk, max_cpu_loras=3)
    refs = register(engine, versions)
    for name, ref in refs.items():
        assert tokens(engine, ref) == expected[name], name
    assert len(engine.loras.in_host) <= 3  # the host tier is an LRU of max_cpu_loras
    assert engine.loras.host_stats.evictions > 0
    assert engine.loras.device_stats.evictions > 0


@pytest.fixture(scope="module")
def s3_endpoint() -> Any:
    with s3server.moto_s3_server() as endpoint:
        yield endpoint


def s3_store(endpoint: str, bucket: str, **config: Any) -> S3Store:
    client = s3server.s3_client(endpoint, **config)
    return S3Store(bucket, "adapters-root", client=client)


def test_s3_versions_are_downloaded_once_and_a_corrupted_copy_is_fetched_again(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    expected: dict[str, list[int]],
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    s3server.s3_client(s3_endpoint).create_bucket(Bucket="tiers-a")
    store = s3_store(s3_endpoint, "tiers-a")
    versions = stored(store, tiny_llama_dir, {"r16": peft_adapters["r16"]})
    disk = DiskTier(store, tmp_path / "disk")
    engine = engine_for(tiny_llama_dir, disk)
    ref = register(engine, versions)["r16"]
    assert tokens(engine, ref) == expected["r16"]
    assert disk.loads_total == 1
    # corrupt the local copy, evict the host and device copies: the next read must notice
    weights = tmp_path / "disk" / ref.digest / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    engine.loras.unregister("r16", "acme")
    ref = register(engine, versions)["r16"]
    assert tokens(engine, ref) == expected["r16"]
    assert disk.loads_total == 2  # downloaded again after the digest check failed


def test_a_corrupted_stored_version_fails_only_its_requests(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    expected: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    versions = stored(store, tiny_llama_dir, {k: peft_adapters[k] for k in ("r4", "r16")})
    bad = Path(store.url()) / versions["r4"].path / "adapter_model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x01
    bad.chmod(0o644)
    bad.write_bytes(bytes(data))
    engine = engine_for(tiny_llama_dir, DiskTier(store))
    refs = register(engine, versions)
    outs = engine.generate([PROMPT] * 3, GREEDY, [refs["r4"], refs["r16"], None])
    assert outs[0].finish_reason == "error"
    assert "does not match" in (outs[0].error or "")
    assert outs[1].token_ids == expected["r16"]
    assert outs[2].error is None and len(outs[2].token_ids) == 8


def test_an_unreachable_store_fails_only_its_requests_and_recovery_is_automatic(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    expected: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3server.s3_client(endpoint).create_bucket(Bucket="tiers-b")
    fast = {"connect_timeout": 0.5, "read_timeout": 2, "retries": {"max_attempts": 1}}
    store = s3_store(endpoint, "tiers-b", **fast)
    versions = stored(store, tiny_llama_dir, {"r8-qv": peft_adapters["r8-qv"]})
    server.stop()  # the store goes away
    disk = DiskTier(store, tmp_path / "disk", retries=1, backoff_s=0.01)
    engine = engine_for(tiny_llama_dir, disk)
    engine.loras.retry_after_s = 0.2
    ref = register(engine, versions)["r8-qv"]
    outs = engine.generate([PROMPT, PROMPT], GREEDY, [ref, None])
    assert outs[0].finish_reason == "error"
    assert "cannot fetch" in (outs[0].error or "")
    assert len(outs[1].token_ids) == 8  # the base model kept serving
    # the store comes back on the same address (moto keeps its data in-process)
    again = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    again.start()
    try:
        time.sleep(0.25)  # past retry_after_s
        assert tokens(engine, ref) == expected["r8-qv"]
    finally:
        again.stop()


class GatedStore(S3Store):
    """An S3Store whose downloads wait for a gate: a slow, cold adapter."""

    gate: threading.Event

    def download(self, key: str, dest: Path) -> None:
        self.gate.wait(timeout=60)
        super().download(key, dest)


def gated_engine(
    bucket: str,
    name: str,
    model: Path,
    adapters: dict[str, Path],
    s3_endpoint: str,
    tmp_path: Path,
) -> tuple[Engine, GatedStore, LoRARef]:
    """An engine whose one stored adapter `name` is cold and whose download is held until
    `store.gate` is set."""
    client = s3server.s3_client(s3_endpoint)
    client.create_bucket(Bucket=bucket)
    store = GatedStore(bucket, "root", client=client)
    store.gate = threading.Event()
    store.gate.set()
    versions = stored(store, model, {name: adapters[name]})
    store.gate.clear()
    engine = engine_for(model, DiskTier(store, tmp_path / "disk"))
    return engine, store, register(engine, versions)[name]


def test_a_cold_load_does_not_stall_running_requests(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    expected: dict[str, list[int]],
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    engine, store, ref = gated_engine(
        "tiers-c", "r32-mlp", tiny_llama_dir, peft_adapters, s3_endpoint, tmp_path
    )
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("base", PROMPT, long)
    engine.add_request("cold", PROMPT, GREEDY, ref)
    seen: list[str] = []

    def ten_steps() -> None:
        for _ in range(10):
            seen.extend(out.request_id for out in engine.step())

    # the download is blocked: steps must still complete, and the base request keep generating
    stepper = threading.Thread(target=ten_steps)
    stepper.start()
    stepper.join(timeout=20)
    stalled = stepper.is_alive()
    store.gate.set()
    stepper.join()
    assert not stalled, "a step waited for the cold adapter's download"
    assert seen == ["base"] * 10
    cold: list[int] = []
    deadline = time.monotonic() + 30
    while engine.has_unfinished and time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == "cold":
                cold += out.token_ids
    assert cold == expected["r32-mlp"]


def test_device_pool_byte_budget_is_respected(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], expected: dict[str, list[int]]
) -> None:
    probe = engine_for(tiny_llama_dir, None, max_loras=4)
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    sizes = {
        n: probe.runner.pool.bytes_needed(load_lora(p, spec)) for n, p in peft_adapters.items()
    }
    budget = sizes["r64"] + sizes["r4"]  # room for r64 and a small one, not two large ones
    engine = engine_for(tiny_llama_dir, None, max_loras=4, lora_memory=budget)
    for name in ("r64", "r4", "r32-mlp", "r64", "r16"):
        ref = engine.register_lora(name, peft_adapters[name], "acme")
        assert tokens(engine, ref) == expected[name]
        assert engine.runner.pool.bytes_used <= budget


def test_pool_memory_is_rank_exact_whatever_the_max_rank(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    used = []
    for max_rank in (8, 64):
        engine = engine_for(tiny_llama_dir, None, max_lora_rank=max_rank)
        ref = engine.register_lora("a", peft_adapters["r8-qv"])
        tokens(engine, ref)
        used.append(engine.runner.pool.bytes_used)
    assert used[0] == used[1] > 0


def test_an_engine_with_only_cold_requests_waits_for_the_load_instead_of_spinning(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    expected: dict[str, list[int]],
    s3_endpoint: str,
    tmp_path: Path,
) -> None:
    engine, store, ref = gated_engine(
        "tiers-w", "r16", tiny_llama_dir, peft_adapters, s3_endpoint, tmp_path
    )
    engine.add_request("cold", PROMPT, GREEDY, ref)
    # Nothing can run while the download is held: each step waits (up to LOAD_WAIT_S) for a
    # load to end instead of returning at once, so half a second holds a few dozen steps at
    # most, not the many thousands a spinning loop would make.
    steps, end = 0, time.monotonic() + 0.5
    while time.monotonic() < end:
        assert engine.step() == []
        steps += 1
    assert steps <= 0.5 / LOAD_WAIT_S + 10, steps
    store.gate.set()
    out: list[int] = []
    deadline = time.monotonic() + 30
    while engine.has_unfinished and time.monotonic() < deadline:
        for o in engine.step():
            out += o.token_ids
    assert out == expected["r16"]
