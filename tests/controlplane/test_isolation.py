"""A tenant sees only its own resources: every tenant-scoped endpoint, pointed at another
tenant's adapter, answers 404 (never 403) and changes nothing."""

from __future__ import annotations

import pytest

from tests.controlplane.conftest import SERVICE_H, Api, bearer

ENDPOINTS = [
    ("get", "/v1/adapters/{name}", None),
    ("get", "/v1/adapters/{name}/versions", None),
    ("patch", "/v1/adapters/{name}", {"current_version": 1}),
    ("delete", "/v1/adapters/{name}", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_another_tenants_adapter_is_404(
    ready: Api, method: str, path: str, body: dict[str, int] | None
) -> None:
    owner, other = ready.keys["acme"], ready.keys["globex"]
    assert ready.upload(owner, "secret-bot", ready.adapter_dir(seed=1)).status_code == 201
    url = path.format(name="secret-bot")
    r = ready.client.request(method, url, json=body, headers=bearer(other))
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "NotFound"
    # the owner's adapter is untouched
    mine = ready.client.get("/v1/adapters/secret-bot", headers=bearer(owner))
    assert mine.status_code == 200 and mine.json()["current_version"] == 1


def test_lists_usage_and_resolve_show_only_the_callers_own(ready: Api) -> None:
    owner, other = ready.keys["acme"], ready.keys["globex"]
    ready.upload(owner, "secret-bot", ready.adapter_dir(seed=1))
    report = {
        "pool": "pool-a",
        "replica": "r",
        "usage": [{"tenant": "acme", "adapter": "secret-bot", "requests": 3}],
    }
    ready.client.post("/internal/v1/pressure", json=report, headers=SERVICE_H)
    assert ready.client.get("/v1/adapters", headers=bearer(other)).json() == []
    assert ready.client.get("/v1/usage", headers=bearer(other)).json() == []
    for model in ("secret-bot", "secret-bot@1"):
        r = ready.client.get(
            "/internal/v1/resolve",
            params={"model": model},
            headers={**SERVICE_H, "X-Tenant-Key": other},
        )
        assert r.status_code == 404, model


def test_same_adapter_name_in_two_tenants_is_two_adapters(ready: Api) -> None:
    a, g = ready.keys["acme"], ready.keys["globex"]
    ra = ready.upload(a, "bot", ready.adapter_dir(seed=1))
    rg = ready.upload(g, "bot", ready.adapter_dir(seed=1))
    assert ra.status_code == rg.status_code == 201
    assert ra.json()["version"]["version"] == rg.json()["version"]["version"] == 1
    for key, tenant in ((a, "acme"), (g, "globex")):
        r = ready.client.get(
            "/internal/v1/resolve",
            params={"model": "bot"},
            headers={**SERVICE_H, "X-Tenant-Key": key},
        )
        assert r.json()["tenant"] == tenant
        assert f"/{tenant}/bot/" in r.json()["path"]
