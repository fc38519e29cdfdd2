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
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.adapters import s3read
from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import S3Store
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.tiers.disk import DiskTier
from tests import s3server
from tests.dataplane.test_lora_manager import manager


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
    m.wait_for([ref], timeout=30)
    elapsed = time.monotonic() - start
    message = m.failure(ref)
    m.close()
    assert message is not None and "timeout" in message.lower(), message
    # every try of every attempt reached the endpoint once, and no more tries were made
    attempts = (disk.retries + 1) * s3read.MAX_ATTEMPTS
    assert len(silent.connections) == attempts == 4
    assert elapsed < attempts * (0.5 + 1) + 1, elapsed  # not boto3's 60 s per read
