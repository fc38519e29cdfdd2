"""The ingest pipeline on both stores (a directory, and S3 over HTTP): layout, idempotence,
versions, concurrency and crash recovery."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loraplane.adapters.canonical import digest_files
from loraplane.adapters.errors import StoreError
from loraplane.adapters.ingest import (
    AdapterVersion,
    ingest,
    list_versions,
    version_path,
)
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store.base import ObjectStore
from loraplane.adapters.store.local import LocalStore
from tests.adapters.crafting import lora_config, lora_tensors, write_adapter
from tests.adapters.test_bad_corpus import BASE

LIMITS = AdapterLimits(max_rank=16)


def adapter(tmp: Path, seed: int, **config: object) -> Path:
    return write_adapter(
        tmp / f"src-{seed}", lora_config(**config), lora_tensors(BASE, 8, seed=seed)
    )


def test_layout_is_versioned_and_content_addressed(store: ObjectStore, tmp_path: Path) -> None:
    v = ingest(adapter(tmp_path, 0), "acme", "support-bot", BASE, LIMITS, store, created_by="alice")
    assert v.version == 1 and v.created
    assert v.path == f"adapters/acme/support-bot/v1-{v.digest[:12]}/"
    assert store.list_keys("adapters/") == sorted(
        [
            v.path + "adapter_config.json",
            v.path + "adapter_model.safetensors",
            v.path + "manifest.json",
            "adapters/acme/support-bot/versions/v1.json",
        ]
    )
    manifest = json.loads(store.get_bytes(v.path + "manifest.json"))
    assert manifest["digest"] == v.digest
    assert manifest["rank"] == 8 and manifest["alpha"] == 16
    assert manifest["target_modules"] == ["q_proj", "v_proj"]
    assert manifest["base_model"] == "tiny" and manifest["created_by"] == "alice"
    # the digest is recomputable from the two stored files
    store.download(v.path + "adapter_config.json", tmp_path / "c.json")
    store.download(v.path + "adapter_model.safetensors", tmp_path / "w.safetensors")
    assert digest_files(tmp_path / "c.json", tmp_path / "w.safetensors") == v.digest


def test_identical_content_returns_the_existing_version(store: ObjectStore, tmp_path: Path) -> None:
    first = ingest(adapter(tmp_path, 0), "acme", "bot", BASE, LIMITS, store)
    keys = store.list_keys("")
    again = ingest(adapter(tmp_path / "again", 0), "acme", "bot", BASE, LIMITS, store)
    assert (again.version, again.digest, again.created) == (1, first.digest, False)
    assert store.list_keys("") == keys


def test_new_content_makes_the_next_version_and_old_ones_stay(
    store: ObjectStore, tmp_path: Path
) -> None:
    v1 = ingest(adapter(tmp_path, 0), "acme", "bot", BASE, LIMITS, store)
    v2 = ingest(adapter(tmp_path, 1), "acme", "bot", BASE, LIMITS, store)
    v3 = ingest(adapter(tmp_path, 0, lora_alpha=32), "acme", "bot", BASE, LIMITS, store)
    assert [v1.version, v2.version, v3.version] == [1, 2, 3]
    assert len({v1.digest, v2.digest, v3.digest}) == 3
    # re-uploading v1's content answers v1, not a new version
    assert ingest(adapter(tmp_path, 0), "acme", "bot", BASE, LIMITS, store).version == 1
    assert [v.version for v in list_versions(store, "acme", "bot")] == [1, 2, 3]


def test_tenants_and_names_are_separate_namespaces(store: ObjectStore, tmp_path: Path) -> None:
    src = adapter(tmp_path, 0)
    a = ingest(src, "acme", "bot", BASE, LIMITS, store)
    b = ingest(src, "globex", "bot", BASE, LIMITS, store)
    c = ingest(src, "acme", "other", BASE, LIMITS, store)
    assert {a.version, b.version, c.version} == {1}
    assert len({a.path, b.path, c.path}) == 3


@pytest.mark.parametrize(
    ("tenant", "name"), [("Acme", "bot"), ("acme", "../x"), ("acme", "a@1"), ("", "b")]
)
def test_unsafe_names_are_refused_before_anything_is_read(
    store: ObjectStore, tmp_path: Path, tenant: str, name: str
) -> None:
    with pytest.raises(ValueError, match="must be"):
        ingest(tmp_path / "missing", tenant, name, BASE, LIMITS, store)


def _race(store: ObjectStore, sources: list[Path]) -> list[AdapterVersion]:
    barrier = threading.Barrier(len(sources))

    def one(src: Path) -> AdapterVersion:
        barrier.wait()
        return ingest(src, "acme", "bot", BASE, LIMITS, store)

    with ThreadPoolExecutor(len(sources)) as pool:
        return list(pool.map(one, sources))


def test_eight_threads_ingesting_the_same_content_make_one_version(
    store: ObjectStore, tmp_path: Path
) -> None:
    sources = [adapter(tmp_path / str(i), 0) for i in range(8)]
    results = _race(store, sources)
    assert {(r.version, r.digest) for r in results} == {(1, results[0].digest)}
    assert sum(r.created for r in results) == 1
    assert [v.version for v in list_versions(store, "acme", "bot")] == [1]


def test_eight_threads_with_different_content_make_consecutive_versions(
    store: ObjectStore, tmp_path: Path
) -> None:
    sources = [adapter(tmp_path, seed) for seed in range(8)]
    results = _race(store, sources)
    assert sorted(r.version for r in results) == list(range(1, 9))
    stored = list_versions(store, "acme", "bot")
    assert [v.version for v in stored] == list(range(1, 9))
    # every thread's content is stored under the version it was told
    assert {(r.version, r.digest) for r in results} == {(v.version, v.digest) for v in stored}


class FailingWeightsStore(LocalStore):
    """Dies (like a killed process) when it comes to writing the weights file."""

    def put_file(self, key: str, path: Path) -> None:
        if key.endswith("adapter_model.safetensors"):
            raise StoreError("simulated crash")
        super().put_file(key, path)


def test_an_interrupted_ingest_is_completed_by_the_next_one(tmp_path: Path) -> None:
    src = adapter(tmp_path, 0)
    with pytest.raises(StoreError):
        ingest(src, "acme", "bot", BASE, LIMITS, FailingWeightsStore(tmp_path / "store"))
    store = LocalStore(tmp_path / "store")
    assert list_versions(store, "acme", "bot") == []  # no manifest: not a version yet
    v = ingest(src, "acme", "bot", BASE, LIMITS, store)
    assert (v.version, v.created) == (1, True)
    assert store.exists(version_path("acme", "bot", 1, v.digest) + "manifest.json")
    assert [x.version for x in list_versions(store, "acme", "bot")] == [1]
    assert list((tmp_path / "store" / ".staging").iterdir()) == []


def test_extra_files_are_ignored_never_stored_or_run(store: ObjectStore, tmp_path: Path) -> None:
    src = adapter(tmp_path, 0, auto_map={"AutoModel": "evil.Model"})
    (src / "modeling_evil.py").write_text("raise SystemExit('executed!')\n")
    (src / "tokenizer.json").write_text("{}")
    (src / "README.md").write_text("# my adapter")
    v = ingest(src, "acme", "bot", BASE, LIMITS, store)
    names = {key.rsplit("/", 1)[-1] for key in store.list_keys(v.path)}
    assert names == {"adapter_config.json", "adapter_model.safetensors", "manifest.json"}
    assert b"auto_map" not in store.get_bytes(v.path + "adapter_config.json")


def test_a_version_folder_changed_outside_loraplane_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    v = ingest(adapter(tmp_path, 0), "acme", "bot", BASE, LIMITS, store)
    manifest = Path(store.url()) / v.path / "manifest.json"
    forged = json.loads(manifest.read_text())
    forged["digest"] = "f" * 64
    manifest.chmod(0o644)
    manifest.write_text(json.dumps(forged))
    with pytest.raises(StoreError, match="changed outside loraplane"):
        ingest(adapter(tmp_path / "again", 0), "acme", "bot", BASE, LIMITS, store)
