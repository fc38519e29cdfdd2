"""What every ObjectStore promises, checked against LocalStore and S3Store (over moto)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplane.adapters.errors import ObjectExists, ObjectNotFound
from loraplane.adapters.store import ObjectStore
from tests.adapters.conftest import SMALL_MULTIPART

UNSAFE_KEYS = ["", "../x", "/abs", "a//b", "a/./b", "a/../b", "a/", ".hidden", "a\\b", "a b"]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_put_bytes_then_get_bytes_returns_the_same_bytes(store: ObjectStore) -> None:
    store.put_bytes("tenants/t1/adapter.json", b'{"rank": 8}')
    store.put_bytes("empty", b"")

    assert store.get_bytes("tenants/t1/adapter.json") == b'{"rank": 8}'
    assert store.get_bytes("empty") == b""
    assert store.exists("tenants/t1/adapter.json")


def test_second_put_bytes_raises_ObjectExists_and_keeps_the_original(store: ObjectStore) -> None:
    store.put_bytes("k", b"first")

    with pytest.raises(ObjectExists) as info:
        store.put_bytes("k", b"second")

    assert info.value.key == "k"
    assert store.get_bytes("k") == b"first"


def test_put_file_over_an_existing_key_raises_ObjectExists(
    store: ObjectStore, tmp_path: Path
) -> None:
    store.put_file("k", _write(tmp_path / "a", b"first"))

    with pytest.raises(ObjectExists):
        store.put_file("k", _write(tmp_path / "b", b"second"))

    assert store.get_bytes("k") == b"first"


def test_put_file_copies_the_contents_and_leaves_the_source(
    store: ObjectStore, tmp_path: Path
) -> None:
    source = _write(tmp_path / "weights.safetensors", b"\x00\x01" * 1000)

    store.put_file("a/weights.safetensors", source)

    assert store.get_bytes("a/weights.safetensors") == b"\x00\x01" * 1000
    assert source.read_bytes() == b"\x00\x01" * 1000


def test_put_file_from_the_staging_dir_round_trips(store: ObjectStore) -> None:
    staged = _write(store.staging_dir() / "upload.bin", b"staged")

    store.put_file("staged/obj", staged)

    assert store.get_bytes("staged/obj") == b"staged"
    assert staged.exists()


def test_put_file_above_the_multipart_threshold_round_trips_and_is_create_only(
    store: ObjectStore, tmp_path: Path
) -> None:
    # Two full parts and a short last one at the fixture's 5 MiB part size.
    big = os.urandom(2 * SMALL_MULTIPART + 12345)
    other = os.urandom(SMALL_MULTIPART + 1)

    store.put_file("big/model.safetensors", _write(tmp_path / "big", big))

    assert store.get_bytes("big/model.safetensors") == big
    with pytest.raises(ObjectExists):
        store.put_file("big/model.safetensors", _write(tmp_path / "other", other))
    with pytest.raises(ObjectExists):
        store.put_bytes("big/model.safetensors", b"small")
    store.download("big/model.safetensors", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == big


def test_list_keys_returns_exactly_the_keys_under_a_prefix_sorted(store: ObjectStore) -> None:
    for key in ["b/2", "a/x/1", "a/1", "ab/1", "a/x/0", "c"]:
        store.put_bytes(key, key.encode())

    assert store.list_keys("") == ["a/1", "a/x/0", "a/x/1", "ab/1", "b/2", "c"]
    assert store.list_keys("a/") == ["a/1", "a/x/0", "a/x/1"]
    assert store.list_keys("a") == ["a/1", "a/x/0", "a/x/1", "ab/1"]
    assert store.list_keys("a/x/") == ["a/x/0", "a/x/1"]
    assert store.list_keys("a/x/1") == ["a/x/1"]
    assert store.list_keys("zzz/") == []
    assert store.list_keys("d") == []


def test_list_keys_of_an_empty_store_is_empty(store: ObjectStore) -> None:
    assert store.list_keys("") == []


@pytest.mark.parametrize("prefix", ["../", "/abs/", "a//b/", "a/../", "./x"])
def test_list_keys_with_an_unsafe_prefix_raises_ValueError(store: ObjectStore, prefix: str) -> None:
    with pytest.raises(ValueError, match="unsafe"):
        store.list_keys(prefix)


def test_get_bytes_of_a_missing_key_raises_ObjectNotFound(store: ObjectStore) -> None:
    store.put_bytes("a/b", b"x")

    for key in ["missing", "a/missing", "a", "a/b/c"]:
        with pytest.raises(ObjectNotFound) as info:
            store.get_bytes(key)
        assert info.value.key == key
        assert not store.exists(key)


def test_download_of_a_missing_key_raises_ObjectNotFound_and_writes_nothing(
    store: ObjectStore, tmp_path: Path
) -> None:
    with pytest.raises(ObjectNotFound):
        store.download("missing", tmp_path / "dest")

    assert list(tmp_path.iterdir()) == []


def test_download_replaces_dest_and_leaves_no_temp_file(store: ObjectStore, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _write(out / "adapter.bin", b"stale")
    store.put_bytes("k", b"fresh")

    store.download("k", out / "adapter.bin")

    assert (out / "adapter.bin").read_bytes() == b"fresh"
    assert [p.name for p in out.iterdir()] == ["adapter.bin"]


def test_delete_removes_the_object_and_a_missing_key_is_not_an_error(
    store: ObjectStore,
) -> None:
    store.put_bytes("old/v1", b"x")

    store.delete("old/v1")
    store.delete("old/v1")

    assert not store.exists("old/v1")
    assert store.list_keys("old/") == []


def _key_operations(tmp_path: Path) -> dict[str, Callable[[ObjectStore, str], object]]:
    source = _write(tmp_path / "src", b"data")
    return {
        "put_bytes": lambda s, k: s.put_bytes(k, b"data"),
        "put_file": lambda s, k: s.put_file(k, source),
        "get_bytes": lambda s, k: s.get_bytes(k),
        "download": lambda s, k: s.download(k, tmp_path / "dest"),
        "exists": lambda s, k: s.exists(k),
        "delete": lambda s, k: s.delete(k),
    }


@pytest.mark.parametrize("key", UNSAFE_KEYS)
def test_every_operation_rejects_an_unsafe_key_with_ValueError(
    store: ObjectStore, tmp_path: Path, key: str
) -> None:
    for name, operation in _key_operations(tmp_path).items():
        with pytest.raises(ValueError, match="unsafe object key"):
            operation(store, key)
        assert store.list_keys("") == [], name
    assert not (tmp_path / "dest").exists()


def test_racing_creates_of_one_key_have_exactly_one_winner(store: ObjectStore) -> None:
    writers = 8
    barrier = threading.Barrier(writers)
    winners: list[bytes] = []
    losers: list[BaseException] = []
    lock = threading.Lock()

    def create(i: int) -> None:
        data = f"writer {i} ".encode() * 1000
        barrier.wait()
        try:
            store.put_bytes("race/obj", data)
        except BaseException as exc:
            with lock:
                losers.append(exc)
        else:
            with lock:
                winners.append(data)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(winners) == 1
    assert len(losers) == writers - 1
    assert all(isinstance(exc, ObjectExists) for exc in losers), losers
    assert store.get_bytes("race/obj") == winners[0]
