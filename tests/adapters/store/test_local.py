"""LocalStore specifics: hard-link creation, a clean staging folder, errors as StoreError."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraplane.adapters.errors import ObjectExists, StoreError
from loraplane.adapters.store import LocalStore, open_store


def _staging_files(store: LocalStore) -> list[str]:
    return sorted(p.name for p in store.staging_dir().iterdir())


def test_put_bytes_leaves_no_temp_file_in_staging_after_success_or_ObjectExists(
    local_store: LocalStore,
) -> None:
    local_store.put_bytes("a/b", b"one")
    assert _staging_files(local_store) == []

    with pytest.raises(ObjectExists):
        local_store.put_bytes("a/b", b"two")
    assert _staging_files(local_store) == []


def test_put_file_copy_leaves_no_temp_file_in_staging_after_success_or_ObjectExists(
    local_store: LocalStore, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.write_bytes(b"payload")

    local_store.put_file("k", source)
    with pytest.raises(ObjectExists):
        local_store.put_file("k", source)

    assert _staging_files(local_store) == []


def test_put_file_from_staging_links_the_same_inode_and_keeps_the_source(
    local_store: LocalStore,
) -> None:
    staged = local_store.staging_dir() / "adapter.safetensors"
    staged.write_bytes(b"weights")

    local_store.put_file("t/adapter.safetensors", staged)

    obj = Path(local_store.url()) / "t" / "adapter.safetensors"
    assert os.stat(obj).st_ino == os.stat(staged).st_ino
    assert os.stat(obj).st_nlink == 2
    assert staged.read_bytes() == b"weights"


def test_put_file_from_outside_staging_copies_into_a_new_inode(
    local_store: LocalStore, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    source.write_bytes(b"payload")

    local_store.put_file("k", source)

    obj = Path(local_store.url()) / "k"
    assert os.stat(obj).st_ino != os.stat(source).st_ino
    assert os.stat(source).st_nlink == 1


def test_put_file_of_a_missing_source_raises_FileNotFoundError(
    local_store: LocalStore, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError):
        local_store.put_file("k", tmp_path / "nope")

    assert not local_store.exists("k")


def test_an_unsafe_key_is_rejected_before_the_root_is_created(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")

    with pytest.raises(ValueError, match="unsafe"):
        store.put_bytes("../escape", b"x")

    assert not (tmp_path / "root").exists()
    assert not (tmp_path / "escape").exists()


def test_reads_of_a_store_whose_root_does_not_exist_yet_find_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")

    assert store.list_keys("") == []
    assert not store.exists("k")


def test_list_keys_skips_staging_and_dot_files(local_store: LocalStore) -> None:
    local_store.put_bytes("a/k", b"x")
    (local_store.staging_dir() / "leftover").write_bytes(b"tmp")
    (Path(local_store.url()) / "a" / ".partial").write_bytes(b"tmp")

    assert local_store.list_keys("") == ["a/k"]


def test_a_root_that_is_a_file_raises_StoreError_naming_the_key(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_bytes(b"not a folder")
    store = LocalStore(root)

    with pytest.raises(StoreError, match="'adapters/x'") as info:
        store.put_bytes("adapters/x", b"data")

    assert not isinstance(info.value, ObjectExists)


def test_a_key_that_names_a_folder_of_objects_raises_StoreError_not_ObjectExists(
    local_store: LocalStore,
) -> None:
    local_store.put_bytes("a/b", b"x")

    with pytest.raises(StoreError, match="folder") as info:
        local_store.put_bytes("a", b"y")

    assert not isinstance(info.value, ObjectExists)


def test_objects_are_written_under_the_root_at_their_key_path(
    local_store: LocalStore,
) -> None:
    local_store.put_bytes("t1/a1/v1/adapter_config.json", b"{}")

    path = Path(local_store.url()) / "t1" / "a1" / "v1" / "adapter_config.json"
    assert path.read_bytes() == b"{}"


def test_url_is_the_absolute_root_even_for_a_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = LocalStore("rel/store")

    monkeypatch.chdir("/")
    store.put_bytes("k", b"x")

    assert store.url() == str(tmp_path / "rel" / "store")
    assert (tmp_path / "rel" / "store" / "k").read_bytes() == b"x"


def test_staging_dir_is_dot_staging_under_the_root(local_store: LocalStore) -> None:
    assert local_store.staging_dir() == Path(local_store.url()) / ".staging"
    assert local_store.staging_dir().is_dir()


def test_open_store_with_a_path_gives_a_LocalStore(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"))

    assert isinstance(store, LocalStore)
    assert store.url() == str(tmp_path / "s")


@pytest.mark.parametrize("spec", ["gs://bucket/x", "file:///tmp/x", ""])
def test_open_store_refuses_other_schemes_and_an_empty_spec(spec: str) -> None:
    with pytest.raises(ValueError, match="store"):
        open_store(spec)
