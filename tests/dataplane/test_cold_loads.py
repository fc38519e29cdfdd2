"""Cold loads that cannot hang everyone: a silent store fails a load within the S3 client's
bound, one tenant's hung objects never hold another tenant's loads, and a request whose
adapter does not arrive in time fails alone.

Stored versions are ingested for real into an S3 API over HTTP (moto's server); the "silent"
store is a TCP port that accepts connections and never answers, as a hung S3 endpoint does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.adapters import s3read
from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore, S3Store
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import ADAPTER_LOAD_TIMEOUT, RequestOutput
from loraplane.dataplane.lora.manager import LoRAManager, State
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import FILES, DiskTier
from loraplane.dataplane.tiers.load_order import in_turn, next_tenant
from tests import s3server
from tests.dataplane.test_lora_manager import manager
from tests.dataplane.test_tiers import PROMPT, engine_for


class SilentEndpoint:
    """A local port that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self.connections.append(conn)  # held open, never answered

    def close(self) -> None:
        self._sock.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with s3server.moto_s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def silent() -> Iterator[SilentEndpoint]:
    endpoint = SilentEndpoint()
    yield endpoint
    endpoint.close()


def store_at(endpoint: str, bucket: str, read_timeout_s: float = s3read.READ_TIMEOUT_S) -> S3Store:
    """An S3Store on `endpoint` with the project's client configuration (test credentials)."""
    config = s3read.client_config(read_timeout_s=read_timeout_s)
    client = s3read.make_client(
        endpoint, access_key_id="test", secret_access_key="test",
        region_name=s3server.REGION, config=config,
    )  # fmt: skip
    return S3Store(bucket, "root", client=client)


def ingested(store: S3Store, model: Path, adapters: dict[str, Path], tenant: str,
             names: list[str]) -> dict[str, AdapterVersion]:  # fmt: skip
    spec = BaseModelSpec.from_dir(model)
    return {n: ingest(adapters[n], tenant, n, spec, AdapterLimits(), store) for n in names}


def test_the_store_and_the_disk_tier_use_the_one_short_timeout_configuration() -> None:
    config = S3Store("any-bucket")._client.meta.config
    assert config.connect_timeout == s3read.CONNECT_TIMEOUT_S <= 5
    assert config.read_timeout == s3read.READ_TIMEOUT_S <= 20
    assert config.retries == {"total_max_attempts": 2, "mode": "standard"}
    disk = DiskTier(S3Store("any-bucket"))
    # a silent store fails a load inside the default request deadline: the disk tier's tries
    # times the client's attempts times its timeouts (and the backoffs: boto3's under 1 s)
    attempts = (disk.retries + 1) * s3read.MAX_ATTEMPTS
    worst = attempts * (config.connect_timeout + config.read_timeout + 1) + disk.backoff_s
    assert worst < EngineConfig(model="m").adapter_load_timeout_s


def test_a_silent_store_endpoint_fails_a_load_within_the_clients_bound(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], s3_endpoint: str,
    silent: SilentEndpoint, tmp_path: Path,
) -> None:  # fmt: skip
    s3server.s3_client(s3_endpoint).create_bucket(Bucket="silent")
    live = store_at(s3_endpoint, "silent")
    (version,) = ingested(live, tiny_llama_dir, peft_adapters, "acme", ["r4"]).values()
    # the same objects, behind an endpoint that accepts and never answers; reads time out
    # after 0.5 s here (10 s in service) so that the test is quick
    dead = store_at(silent.url, "silent", read_timeout_s=0.5)
    disk = DiskTier(dead, tmp_path / "disk", backoff_s=0.05)
    m = manager(tiny_llama_dir, None, disk=disk)
    ref = m.register_stored(LoRARef("r4", "acme", version.digest), version.path)
    start = time.monotonic()
    m.prefetch([ref])
    assert m.wait_for([ref], timeout=30)
    elapsed = time.monotonic() - start
    message = m.failure(ref)
    m.close()
    assert message is not None and "timeout" in message.lower(), message
    # told to the tenant's clients: neither the bucket, nor the endpoint, nor a URL
    assert "://" not in message and "127.0.0.1" not in message and "silent/" not in message
    # every try of every attempt reached the endpoint once, and no more tries were made
    attempts = (disk.retries + 1) * s3read.MAX_ATTEMPTS
    assert len(silent.connections) == attempts == 4
    assert elapsed < 30, elapsed  # not boto3's 60 s per read (each try ~1.5 s here)


class HangingStore(S3Store):
    """An S3Store whose downloads of one tenant's objects wait until `release` is set (a
    tenant whose objects hang); every other key downloads at once."""

    hung_tenant = ""
    release: threading.Event

    def download(self, key: str, dest: Path) -> None:
        if f"/{self.hung_tenant}/" in f"/{key}":
            self.release.wait(timeout=60)
        super().download(key, dest)


@pytest.fixture
def hanging(s3_endpoint: str, tiny_llama_dir: Path, peft_adapters: dict[str, Path]) -> Iterator[
    tuple[HangingStore, dict[str, AdapterVersion], dict[str, AdapterVersion]]
]:  # fmt: skip
    """Tenant "hung": three stored adapters whose objects hang; tenant "fine": one whose
    objects download (other content, so no digest is shared with "hung")."""
    bucket = f"hang-{time.monotonic_ns()}"
    s3server.s3_client(s3_endpoint).create_bucket(Bucket=bucket)
    store = HangingStore(bucket, "root", client=s3server.s3_client(s3_endpoint))
    store.hung_tenant, store.release = "hung", threading.Event()
    hung = ingested(store, tiny_llama_dir, peft_adapters, "hung", ["r4", "r16", "r8-qv"])
    fine = ingested(store, tiny_llama_dir, peft_adapters, "fine", ["r8-layer1"])
    yield store, hung, fine
    store.release.set()


def refs_of(m: LoRAManager, versions: dict[str, AdapterVersion]) -> list[LoRARef]:
    return [m.register_stored(LoRARef(n, v.tenant, v.digest), v.path) for n, v in versions.items()]


def test_a_tenant_whose_objects_hang_does_not_hold_another_tenants_load(
    hanging: tuple[HangingStore, dict[str, AdapterVersion], dict[str, AdapterVersion]],
    tiny_llama_dir: Path, tmp_path: Path,
) -> None:  # fmt: skip
    store, hung_versions, fine_versions = hanging
    m = manager(tiny_llama_dir, None, disk=DiskTier(store, tmp_path / "disk"))
    hung, (fine,) = refs_of(m, hung_versions), refs_of(m, fine_versions)
    assert m.max_loads_in_flight == 2
    m.prefetch(hung)  # alone, the tenant takes both loader threads: both of its loads hang
    assert m.loads._tenant_loads["hung"] == 2
    start = time.monotonic()
    m.prefetch([*hung, fine])  # its requests are older, but the other tenant's load starts
    assert m.wait_for([fine], timeout=60)  # the hung loads never end until released below
    assert m.in_host_memory(fine), time.monotonic() - start
    # and the hung tenant starts no third load while over its share
    assert [m.in_host_memory(r) for r in hung] == [False] * 3
    assert (
        m.loads._tenant_loads["hung"] == 2 and m.registry.entries[hung[2].key].state is State.COLD
    )
    store.release.set()
    assert m.wait_for(hung, timeout=30)
    assert all(m.in_host_memory(r) for r in hung)
    m.close()


def test_the_loader_takes_tenants_in_turn_and_the_depth_is_shared(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    m = manager(tiny_llama_dir, None, disk=DiskTier(store), max_loads_in_flight=1,
                prefetch_depth=4)  # fmt: skip
    refs = []
    for tenant, names in (("a", ["r4", "r16", "r8-qv", "r32-mlp"]), ("b", ["r8-layer1"])):
        for n in names:
            v = ingest(peft_adapters[n], tenant, n, spec, AdapterLimits(), store)
            refs.append(m.register_stored(LoRARef(n, tenant, v.digest), v.path))
    order: list[str] = []
    real = m.registry.read

    def recording(entry: Any) -> Any:
        order.append(f"{entry.ref.tenant}/{entry.ref.name}")
        return real(entry)

    m.registry.read = recording  # type: ignore[method-assign]
    m.prefetch(refs)  # a's four are older than b's one, and the depth is four
    assert m.wait_for(refs, timeout=30)
    # b's adapter second, not after a's (nor left out by the depth): a's fourth waits instead
    assert order == ["a/r4", "b/r8-layer1", "a/r16", "a/r8-qv"]
    m.close()


def test_a_request_whose_adapter_never_arrives_fails_alone_after_the_deadline(
    hanging: tuple[HangingStore, dict[str, AdapterVersion], dict[str, AdapterVersion]],
    tiny_llama_dir: Path, tmp_path: Path,
) -> None:  # fmt: skip
    store, hung_versions, fine_versions = hanging
    engine = engine_for(tiny_llama_dir, DiskTier(store, tmp_path / "disk"),
                        adapter_load_timeout_s=5)  # fmt: skip
    (hung, *_), (fine,) = refs_of(engine.loras, hung_versions), refs_of(engine.loras, fine_versions)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    start = time.monotonic()
    engine.add_request("late", PROMPT, params, hung)
    engine.add_request("fine", PROMPT, params, fine)
    engine.add_request("base", PROMPT, params)
    ended: dict[str, float] = {}
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished and time.monotonic() - start < 30:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            if out.finished:
                ended[out.request_id] = time.monotonic() - start
    (late,) = outs["late"]
    assert late.finished and late.error_code == ADAPTER_LOAD_TIMEOUT
    assert late.error == "adapter r4 was not loaded within 5 s"
    assert 5 <= ended["late"] < 15, ended
    # the others were served meanwhile, untouched by the deadline
    for rid in ("fine", "base"):
        assert [o.error for o in outs[rid]] == [None] * 4 and outs[rid][-1].finished, rid
        assert ended[rid] < ended["late"], ended
    store.release.set()
    engine.loras.close()


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "60"])
def test_an_adapter_load_timeout_that_is_not_a_positive_number_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="adapter_load_timeout_s"):
        EngineConfig(model="m", adapter_load_timeout_s=value)


def test_a_hung_download_never_holds_another_tenants_read_of_the_same_bytes(
    hanging: tuple[HangingStore, dict[str, AdapterVersion], dict[str, AdapterVersion]],
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
) -> None:  # fmt: skip
    store, hung_versions, _ = hanging
    (same,) = ingested(store, tiny_llama_dir, peft_adapters, "fine", ["r4"]).values()
    hung = hung_versions["r4"]
    assert same.digest == hung.digest and same.path != hung.path  # one digest, two tenants
    disk = DiskTier(store, tmp_path / "disk")
    seen: list[bytes] = []

    def read_hung() -> None:
        with disk.reading(hung.path, hung.digest) as folder:
            seen.append((folder / FILES[1]).read_bytes())

    reader = threading.Thread(target=read_hung)
    reader.start()
    time.sleep(0.2)  # the hung tenant's download has begun and waits
    start = time.monotonic()
    with disk.reading(same.path, same.digest) as folder:  # not behind it
        assert time.monotonic() - start < 5
        data = (folder / FILES[1]).read_bytes()
        store.release.set()  # the hung download ends while this copy is held
        reader.join(30)
        assert (folder / FILES[1]).read_bytes() == data  # the held folder was not replaced
    assert seen == [data] and disk.loads_total == 1  # the late copy was dropped


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 4),
    events=st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 3)), max_size=50),
)
def test_the_loader_threads_are_shared_fairly_and_stay_bounded(
    limit: int, events: list[tuple[str, int]]
) -> None:
    """Tenants ask for loads (k > 0) or one of their loads ends (k == 0), in any order; after
    each event the loader starts what `next_tenant` allows."""
    wants: Counter[str] = Counter()  # loads each tenant still has to start
    loading: Counter[str] = Counter()
    last: dict[str, int] = {}
    for clock, (tenant, k) in enumerate(events):
        if k == 0 and loading[tenant]:
            loading[tenant] -= 1
        wants[tenant] += k
        while (t := next_tenant([u for u in wants if wants[u]], loading, last, limit)) is not None:
            assert wants[t] > 0
            wants[t] -= 1
            loading[t] += 1
            last[t] = clock
        waiting = [u for u in wants if wants[u]]
        active = set(waiting) | {u for u, n in loading.items() if n}
        assert sum(loading.values()) <= 2 * limit  # the pool's threads
        if len(active) == 1 and waiting:  # alone: every thread (work-conserving)
            assert loading[waiting[0]] == limit
        elif active and len(active) <= limit:  # nobody waits below its share
            share = limit // len(active)
            assert all(loading[u] >= share for u in waiting), (loading, waiting)
        elif waiting:  # more tenants than threads: one each, what was lent counted out
            within = sum(min(n, 1) for n in loading.values())
            assert all(loading[u] >= 1 for u in waiting) or within >= limit


def test_tenants_are_taken_in_turn_each_in_its_own_order() -> None:
    assert in_turn([[1, 2, 3], [10], [20, 21]]) == [1, 10, 20, 2, 21, 3]
    assert in_turn([]) == []


def test_the_next_load_goes_to_the_fewest_in_flight_then_the_longest_unserved() -> None:
    assert next_tenant(["a", "b"], {"a": 1}, {}, limit=4) == "b"
    assert next_tenant(["a", "b"], {}, {"a": 5, "b": 2}, limit=1) == "b"
    assert next_tenant(["a", "b"], {}, {"a": 5}, limit=1) == "b"  # b never served
    assert next_tenant(["a"], {"b": 1}, {}, limit=1) is None  # the one thread is taken
    assert next_tenant([], {}, {}, limit=2) is None
