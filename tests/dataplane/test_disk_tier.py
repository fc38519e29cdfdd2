"""The disk tier under concurrency: a folder being read is never evicted, replaced or deleted;
readers that miss the same digest share one download; unsafe catalog paths touch nothing.

Versions are ingested for real into an S3 API over HTTP (moto's server) and downloaded by the
tier, the way a data plane replica in a cluster gets them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import StoreError
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import S3Store
from loraplane.dataplane.tiers.disk import FILES, DiskTier
from tests import s3server


@pytest.fixture(scope="module")
def versions(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> Iterator[tuple[S3Store, dict[str, AdapterVersion]]]:
    with s3server.moto_s3_server() as endpoint:
        client = s3server.s3_client(endpoint)
        client.create_bucket(Bucket="disk-tier")
        store = S3Store("disk-tier", "root", client=client)
        spec = BaseModelSpec.from_dir(tiny_llama_dir)
        yield (
            store,
            {
                n: ingest(peft_adapters[n], "acme", n, spec, AdapterLimits(), store)
                for n in ("r4", "r16", "r64")
            },
        )


def size(version: AdapterVersion, disk: DiskTier) -> int:
    with disk.reading(version.path, version.digest) as folder:
        return sum((folder / f).stat().st_size for f in FILES)


def test_a_folder_being_read_is_not_evicted_by_another_download(
    versions: tuple[S3Store, dict[str, AdapterVersion]], tmp_path: Path
) -> None:
    store, v = versions
    probe = DiskTier(store, tmp_path / "probe")
    budget = max(size(v["r4"], probe), size(v["r16"], probe))  # room for one of them
    disk = DiskTier(store, tmp_path / "disk", budget_bytes=budget)
    with disk.reading(v["r4"].path, v["r4"].digest) as held:
        with disk.reading(v["r16"].path, v["r16"].digest) as other:
            # over budget for now: the held folder stays whole
            assert all((held / f).is_file() for f in FILES)
            assert all((other / f).is_file() for f in FILES)
        assert (held / FILES[1]).read_bytes()  # still readable
    assert disk.evictions_total == 0
    # once nobody holds them, the next download evicts what is over the budget
    with disk.reading(v["r64"].path, v["r64"].digest):
        pass
    assert not held.exists() and not other.exists()
    assert disk.evictions_total == 2


def test_readers_missing_the_same_digest_share_one_download(
    versions: tuple[S3Store, dict[str, AdapterVersion]], tmp_path: Path
) -> None:
    store, v = versions
    disk = DiskTier(store, tmp_path / "disk")
    real = store.download
    calls: list[str] = []

    def slow(key: str, path: Path) -> None:
        calls.append(key)
        time.sleep(0.05)
        real(key, path)

    store.download = slow  # type: ignore[method-assign]
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with disk.reading(v["r16"].path, v["r16"].digest) as folder:
                seen.append((folder / FILES[1]).read_bytes())
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        store.download = real  # type: ignore[method-assign]
    assert not errors
    assert len(seen) == 4 and len(set(seen)) == 1
    assert disk.loads_total == 1 and len(calls) == len(FILES)  # one download of two files


def test_a_discarded_copy_still_being_read_stays_until_its_reader_lets_go(
    versions: tuple[S3Store, dict[str, AdapterVersion]], tmp_path: Path
) -> None:
    store, v = versions
    disk = DiskTier(store, tmp_path / "disk")
    digest = v["r4"].digest
    with disk.reading(v["r4"].path, digest) as folder:
        disk.discard(digest)  # another reader found it corrupted
        assert (folder / FILES[1]).is_file()  # this reader is not pulled from under
        with (
            pytest.raises(StoreError, match="still being read"),
            disk.reading(v["r4"].path, digest),
        ):
            pass
    assert not folder.exists()  # deleted with its last reader
    with disk.reading(v["r4"].path, digest) as again:  # and fetched anew
        assert all((again / f).is_file() for f in FILES)
    assert disk.loads_total == 2


@pytest.mark.parametrize(
    ("path", "digest"),
    [("../../etc/", "d" * 64), ("root/a/../../b/", "d" * 64), ("ok/", "../../tmp"), ("ok/", "")],
)
def test_unsafe_catalog_paths_and_digests_are_refused_before_any_file_is_touched(
    versions: tuple[S3Store, dict[str, AdapterVersion]], tmp_path: Path, path: str, digest: str
) -> None:
    store, _ = versions
    disk = DiskTier(store, tmp_path / "disk")
    with pytest.raises(ValueError, match="unsafe object key"), disk.reading(path, digest):
        pass
    assert disk.loads_total == 0 and not any((tmp_path / "disk").iterdir())
