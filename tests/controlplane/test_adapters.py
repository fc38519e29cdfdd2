"""Tenant API: uploads, versions, pinning, deletion, quotas, limits and usage."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load_file

from loraplane.controlplane.settings import Settings
from tests.adapters.crafting import TINY_BASE, dora_tensors, lora_config, write_adapter
from tests.controlplane.conftest import ADMIN_H, SERVICE_H, Api, bearer, make_settings


def store_files(settings: Settings) -> list[Path]:
    root = Path(settings.effective_store) / "adapters"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_new_content_is_201_identical_is_200_next_content_is_next_version(ready: Api) -> None:
    key = ready.keys["acme"]
    first = ready.adapter_dir(seed=1)
    r1 = ready.upload(key, "bot", first)
    assert r1.status_code == 201, r1.text
    body = r1.json()
    assert body["created"] is True and body["version"]["version"] == 1
    assert body["version"]["rank"] == 8 and len(body["version"]["digest"]) == 64
    assert "path" not in body["version"]  # storage paths are internal
    r2 = ready.upload(key, "bot", first)
    assert r2.status_code == 200 and r2.json()["version"]["version"] == 1
    r3 = ready.upload(key, "bot", ready.adapter_dir(seed=2))
    assert r3.status_code == 201 and r3.json()["version"]["version"] == 2
    assert r3.json()["current_version"] == 2
    versions = ready.client.get("/v1/adapters/bot/versions", headers=bearer(key)).json()
    assert [v["version"] for v in versions] == [1, 2]


def test_archive_upload_is_accepted(ready: Api) -> None:
    src = ready.adapter_dir(seed=3)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(src.iterdir()):
            tar.add(p, arcname=p.name)
    archive = ready.work / "adapter.tar.gz"
    archive.write_bytes(buf.getvalue())
    r = ready.upload(ready.keys["acme"], "packed", archive)
    assert r.status_code == 201, r.text


def test_a_dora_adapter_is_accepted_and_stored_with_its_magnitude_vectors(
    ready: Api, settings: Settings
) -> None:
    """The upload path runs the shared validator: DoRA (use_dora with a magnitude vector per
    module) is a new version like any adapter, its magnitudes in the stored weights."""
    key = ready.keys["acme"]
    out = ready.work / "dora"
    tensors = dora_tensors(TINY_BASE, 8, seed=4)
    r = ready.upload(key, "dora-bot", write_adapter(out, lora_config(use_dora=True), tensors))
    assert r.status_code == 201, r.text
    assert r.json()["version"]["rank"] == 8
    stored = [p for p in store_files(settings) if p.name == "adapter_model.safetensors"]
    assert len(stored) == 1
    names = load_file(stored[0]).keys()
    assert sum(n.endswith(".lora_magnitude_vector") for n in names) == len(tensors) // 3


def test_get_list_patch_pin_and_rollback(ready: Api) -> None:
    key = ready.keys["acme"]
    ready.upload(key, "bot", ready.adapter_dir(seed=1))
    ready.upload(key, "bot", ready.adapter_dir(seed=2))
    c, h = ready.client, bearer(key)
    got = c.get("/v1/adapters/bot", headers=h).json()
    assert got["current_version"] == 2 and got["latest_version"] == 2
    assert got["current"]["version"] == 2
    r = c.patch("/v1/adapters/bot", json={"current_version": 1}, headers=h)
    assert r.status_code == 200 and r.json()["current_version"] == 1
    assert r.json()["current"]["version"] == 1
    r = c.patch("/v1/adapters/bot", json={"current_version": 9}, headers=h)
    assert r.status_code == 404
    r = c.patch("/v1/adapters/bot", json={"current_version": 0}, headers=h)
    assert r.status_code == 400
    assert [a["name"] for a in c.get("/v1/adapters", headers=h).json()] == ["bot"]


def test_delete_stops_serving_keeps_versions_and_reupload_revives(ready: Api) -> None:
    key = ready.keys["acme"]
    c, h = ready.client, bearer(key)
    src = ready.adapter_dir(seed=1)
    ready.upload(key, "bot", src)
    assert c.delete("/v1/adapters/bot", headers=h).status_code == 204
    assert c.get("/v1/adapters/bot", headers=h).status_code == 404
    assert c.get("/v1/adapters", headers=h).json() == []
    resolve = c.get(
        "/internal/v1/resolve", params={"model": "bot"}, headers={**SERVICE_H, "X-Tenant-Key": key}
    )
    assert resolve.status_code == 404
    r = ready.upload(key, "bot", src)
    assert r.status_code == 200 and r.json()["current_version"] == 1
    r = ready.upload(key, "bot", ready.adapter_dir(seed=2))
    assert r.status_code == 201 and r.json()["version"]["version"] == 2


def test_unknown_base_model_is_422_and_stores_nothing(ready: Api, settings: Settings) -> None:
    r = ready.upload(ready.keys["acme"], "bot", ready.adapter_dir(), base_model="other-model")
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "UnknownBaseModel"
    assert store_files(settings) == []


def test_rank_over_tenant_quota_is_RankTooLarge(api: Api, settings: Settings) -> None:
    api.pool(max_lora_rank=64)
    key = api.tenant("acme", max_rank=4)
    r = api.upload(key, "bot", api.adapter_dir(r=8))
    assert r.status_code == 422 and r.json()["error"]["code"] == "RankTooLarge"
    assert store_files(settings) == []


def test_rank_over_pool_max_is_RankTooLarge(api: Api) -> None:
    api.pool(max_lora_rank=4)
    key = api.tenant("acme", max_rank=64)
    r = api.upload(key, "bot", api.adapter_dir(r=8))
    assert r.status_code == 422 and r.json()["error"]["code"] == "RankTooLarge"
    assert "4" in r.json()["error"]["message"]


def test_bytes_over_tenant_quota_is_TooLarge(api: Api) -> None:
    api.pool()
    key = api.tenant("acme", max_bytes=1000)
    r = api.upload(key, "bot", api.adapter_dir())
    assert r.status_code == 422 and r.json()["error"]["code"] == "TooLarge"


def test_adapter_count_quota_is_409_QuotaExceeded(api: Api) -> None:
    api.pool()
    key = api.tenant("acme", max_adapters=1)
    assert api.upload(key, "one", api.adapter_dir(seed=1)).status_code == 201
    assert api.upload(key, "one", api.adapter_dir(seed=2)).status_code == 201  # same adapter
    r = api.upload(key, "two", api.adapter_dir(seed=3))
    assert r.status_code == 409 and r.json()["error"]["code"] == "QuotaExceeded"
    assert "max_adapters" in r.json()["error"]["message"]


def test_upload_over_size_cap_is_413(api: Api, tmp_path: Path, database_url: str) -> None:
    from loraplane.controlplane.main import create_app

    app = create_app(make_settings(tmp_path / "capped", database_url, max_upload_bytes=2048))
    try:
        with TestClient(app) as client:
            capped = Api(client, api.base_model_dir, api.work)
            capped.pool()
            key = capped.tenant("acme")
            r = capped.upload(key, "bot", capped.adapter_dir())
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "PayloadTooLarge"
    finally:
        app.state.ctx.close()


@pytest.mark.parametrize(
    ("data", "files", "code"),
    [
        ({"name": "bot"}, [("files", ("a.json", b"{}"))], "InvalidRequest"),
        ({"name": "Bad Name!", "base_model": "m"}, [("files", ("a.zip", b"x"))], "InvalidRequest"),
        ({"name": "bot", "base_model": "tiny"}, [], "InvalidRequest"),
        ({"name": "bot", "base_model": "tiny", "tenant": "x"}, [], "InvalidRequest"),
        ({"name": "bot", "base_model": "tiny"}, [("files", ("..", b"1"))], "InvalidRequest"),
        ({"name": "bot", "base_model": "tiny"}, [("other", ("x.zip", b"1"))], "InvalidRequest"),
    ],
)
def test_malformed_uploads_are_400(
    ready: Api, data: dict[str, str], files: list[object], code: str
) -> None:
    r = ready.client.post(
        "/v1/adapters", data=data, files=files or None, headers=bearer(ready.keys["acme"])
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


def test_upload_with_another_content_type_is_400(ready: Api) -> None:
    r = ready.client.post(
        "/v1/adapters",
        content=b"x",
        headers={**bearer(ready.keys["acme"]), "Content-Type": "text/plain"},
    )
    assert r.status_code == 400


def test_usage_is_fed_by_pressure_reports(ready: Api) -> None:
    key = ready.keys["acme"]
    report = {
        "pool": "pool-a",
        "replica": "r0",
        "usage": [
            {"tenant": "acme", "adapter": "bot", "requests": 2, "prompt_tokens": 10,
             "completion_tokens": 5},
            {"tenant": "acme", "adapter": "bot", "requests": 1, "prompt_tokens": 1,
             "completion_tokens": 1},
            {"tenant": "globex", "requests": 7},
        ],
    }  # fmt: skip
    for _ in range(2):
        r = ready.client.post("/internal/v1/pressure", json=report, headers=SERVICE_H)
        assert r.status_code == 200, r.text
    rows = ready.client.get("/v1/usage", headers=bearer(key)).json()
    assert len(rows) == 1
    assert rows[0]["adapter"] == "bot"
    assert (rows[0]["requests"], rows[0]["prompt_tokens"], rows[0]["completion_tokens"]) == (
        6, 22, 12,
    )  # fmt: skip
    day = rows[0]["day"]
    assert ready.client.get("/v1/usage", params={"start": day, "end": day},
                            headers=bearer(key)).json() == rows  # fmt: skip
    assert ready.client.get("/v1/usage", params={"start": "2999-01-01"},
                            headers=bearer(key)).json() == []  # fmt: skip
    globex = ready.client.get("/v1/usage", headers=bearer(ready.keys["globex"])).json()
    assert [(g["adapter"], g["requests"]) for g in globex] == [("", 14)]
    _ = ADMIN_H


def test_an_upload_holds_no_database_connection_while_its_body_streams(
    ready: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Authentication uses the database; the body may take minutes to arrive: the request
    must give its connection back before reading it (a pool of connections serves everyone)."""
    from loraplane.controlplane.api.routes import adapters as route

    ctx = ready.client.app.state.ctx  # type: ignore[attr-defined]
    held: list[int] = []
    receive = route.receive_multipart

    async def watching(*args: Any, **kwargs: Any) -> Any:
        held.append(ctx.engine.pool.checkedout())
        return await receive(*args, **kwargs)

    monkeypatch.setattr(route, "receive_multipart", watching)
    # a first call records the key's last use; within the next minute auth only reads
    assert ready.client.get("/v1/adapters", headers=bearer(ready.keys["acme"])).status_code == 200
    r = ready.client.post(
        "/v1/adapters", data={"name": "bot"}, files=[("files", ("a.json", b"{}"))],
        headers=bearer(ready.keys["acme"]),
    )  # fmt: skip
    assert r.status_code == 400  # (a malformed upload: what matters is the body's reading)
    assert held == [0]
