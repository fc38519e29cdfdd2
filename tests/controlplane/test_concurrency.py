"""Twenty uploads of different content to one name at once: versions 1 to 20, no gap, no
duplicate, and the catalog agrees with the store."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from loraplane.adapters.ingest import list_versions
from loraplane.adapters.store import open_store
from loraplane.controlplane.settings import Settings
from tests.controlplane.conftest import Api, bearer

N = 20


def test_parallel_uploads_of_one_name_get_consecutive_versions(
    ready: Api, settings: Settings
) -> None:
    key = ready.keys["acme"]
    sources = [ready.adapter_dir(seed=100 + i) for i in range(N)]
    with ThreadPoolExecutor(max_workers=N) as pool:
        responses = list(pool.map(lambda s: ready.upload(key, "bot", s), sources))
    assert [r.status_code for r in responses] == [201] * N, [r.text for r in responses]
    numbers = sorted(r.json()["version"]["version"] for r in responses)
    assert numbers == list(range(1, N + 1))
    listed = ready.client.get("/v1/adapters/bot/versions", headers=bearer(key)).json()
    db_versions = {v["version"]: v["digest"] for v in listed}
    stored = {
        v.version: v.digest
        for v in list_versions(open_store(settings.effective_store), "acme", "bot")
    }
    assert db_versions == stored
    assert len(set(stored.values())) == N
    current = ready.client.get("/v1/adapters/bot", headers=bearer(key)).json()
    assert current["current_version"] == N


def test_parallel_identical_uploads_make_one_version(ready: Api) -> None:
    key = ready.keys["acme"]
    source = ready.adapter_dir(seed=7)
    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(lambda _: ready.upload(key, "same", source), range(8)))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 7 + [201], [r.text for r in responses]
    assert {r.json()["version"]["version"] for r in responses} == {1}
