"""Admin API: tenants, quotas, keys and pools; credentials and strict bodies."""

from __future__ import annotations

import logging

import pytest

from tests.controlplane.conftest import ADMIN_H, BASE_NAME, SERVICE_H, Api, bearer


def test_tenant_lifecycle_create_get_list_patch_delete(api: Api) -> None:
    c = api.client
    r = c.post("/v1/tenants", json={"name": "acme", "max_rank": 16}, headers=ADMIN_H)
    assert r.status_code == 201
    assert r.json()["namespace"] == "acme" and r.json()["max_rank"] == 16
    assert (
        c.post("/v1/tenants", json={"name": "acme"}, headers=ADMIN_H).json()["error"]["code"]
        == "AlreadyExists"
    )
    assert [t["name"] for t in c.get("/v1/tenants", headers=ADMIN_H).json()] == ["acme"]
    r = c.patch("/v1/tenants/acme", json={"requests_per_minute": 5}, headers=ADMIN_H)
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 5
    assert r.json()["max_rank"] == 16  # untouched
    assert c.delete("/v1/tenants/acme", headers=ADMIN_H).status_code == 204
    assert c.get("/v1/tenants/acme", headers=ADMIN_H).status_code == 404
    assert c.get("/v1/tenants", headers=ADMIN_H).json() == []


def test_weight_defaults_to_1_and_is_set_at_create_and_by_patch(api: Api) -> None:
    c = api.client
    plain = c.post("/v1/tenants", json={"name": "acme"}, headers=ADMIN_H).json()
    assert plain["weight"] == 1.0
    r = c.post("/v1/tenants", json={"name": "heavy", "weight": 2.5}, headers=ADMIN_H)
    assert r.status_code == 201 and r.json()["weight"] == 2.5
    r = c.patch("/v1/tenants/acme", json={"weight": 0.25}, headers=ADMIN_H)
    assert r.status_code == 200 and r.json()["weight"] == 0.25
    r = c.patch("/v1/tenants/acme", json={"max_rank": 8}, headers=ADMIN_H)
    assert r.json()["weight"] == 0.25  # a patch without weight keeps it
    assert c.get("/v1/tenants/acme", headers=ADMIN_H).json()["weight"] == 0.25
    listed = {t["name"]: t["weight"] for t in c.get("/v1/tenants", headers=ADMIN_H).json()}
    assert listed == {"acme": 0.25, "heavy": 2.5}


@pytest.mark.parametrize(
    ("weight", "reason"),
    [
        ("0", "greater than 0"), ("-1", "greater than 0"), ("1000.5", "less than or equal"),
        ("1e999", "finite number"), ("NaN", "finite number"), ('"heavy"', "valid number"),
        ("null", "valid number"),
    ],
)  # fmt: skip
def test_a_weight_not_in_0_to_1000_is_refused_naming_the_field(
    api: Api, weight: str, reason: str
) -> None:
    c = api.client
    json_h = {**ADMIN_H, "Content-Type": "application/json"}
    r = c.post("/v1/tenants", content=f'{{"name": "acme", "weight": {weight}}}', headers=json_h)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "InvalidRequest" and error["message"].startswith(
        "weight: must be a number greater than 0 and at most 1000 (got "
    )
    assert reason in error["errors"][0]["detail"]  # pydantic's own words, for programs
    assert c.get("/v1/tenants", headers=ADMIN_H).json() == []
    assert c.post("/v1/tenants", json={"name": "acme", "weight": 1000}, headers=ADMIN_H).is_success
    if weight != "null":  # null in a patch means "leave it"
        r = c.patch("/v1/tenants/acme", content=f'{{"weight": {weight}}}', headers=json_h)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("weight: ")
    assert c.get("/v1/tenants/acme", headers=ADMIN_H).json()["weight"] == 1000.0


def test_a_namespace_belongs_to_one_live_tenant(api: Api) -> None:
    c = api.client
    assert c.post("/v1/tenants", json={"name": "acme"}, headers=ADMIN_H).status_code == 201
    r = c.post("/v1/tenants", json={"name": "other", "namespace": "acme"}, headers=ADMIN_H)
    assert r.status_code == 409 and r.json()["error"]["code"] == "AlreadyExists"
    assert "tenant 'acme'" in r.json()["error"]["message"]
    body = {"name": "team", "namespace": "team-ns"}
    assert c.post("/v1/tenants", json=body, headers=ADMIN_H).json()["namespace"] == "team-ns"
    # Once its tenant is deleted, a namespace can be given to a new tenant.
    assert c.delete("/v1/tenants/acme", headers=ADMIN_H).status_code == 204
    r = c.post("/v1/tenants", json={"name": "other", "namespace": "acme"}, headers=ADMIN_H)
    assert r.status_code == 201, r.text


def test_deleting_a_tenant_revokes_its_keys_and_stops_its_adapters(ready: Api) -> None:
    key = ready.keys["acme"]
    assert ready.upload(key, "bot", ready.adapter_dir()).status_code == 201
    assert ready.client.delete("/v1/tenants/acme", headers=ADMIN_H).status_code == 204
    assert ready.client.get("/v1/adapters", headers=bearer(key)).status_code == 401
    r = ready.client.get(
        "/internal/v1/resolve", params={"model": "bot"}, headers={**SERVICE_H, "X-Tenant-Key": key}
    )
    assert r.status_code == 401


def test_key_is_shown_once_and_never_again(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key = api.tenant("acme")
    assert key.startswith("lp_") and len(key) >= 40
    listed = api.client.get("/v1/tenants/acme/keys", headers=ADMIN_H)
    assert listed.status_code == 200
    assert key not in listed.text and "hash" not in listed.text
    assert listed.json()[0]["prefix"] == key[:12]
    assert api.client.get("/v1/adapters", headers=bearer(key)).status_code == 200
    assert key not in caplog.text
    assert key[12:] not in caplog.text


def test_revoked_key_stops_working(api: Api) -> None:
    key = api.tenant("acme")
    key_id = api.client.get("/v1/tenants/acme/keys", headers=ADMIN_H).json()[0]["id"]
    assert api.client.delete(f"/v1/tenants/acme/keys/{key_id}", headers=ADMIN_H).status_code == 204
    r = api.client.get("/v1/adapters", headers=bearer(key))
    assert r.status_code == 401 and r.json()["error"]["code"] == "Unauthorized"
    assert api.client.delete("/v1/tenants/acme/keys/999", headers=ADMIN_H).status_code == 404


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/v1/tenants"),
        ("get", "/v1/tenants"),
        ("get", "/v1/tenants/acme"),
        ("patch", "/v1/tenants/acme"),
        ("delete", "/v1/tenants/acme"),
        ("post", "/v1/tenants/acme/keys"),
        ("get", "/v1/tenants/acme/keys"),
        ("delete", "/v1/tenants/acme/keys/1"),
        ("post", "/v1/pools"),
        ("get", "/v1/pools"),
        ("get", "/v1/pools/pool-a"),
        ("patch", "/v1/pools/pool-a"),
    ],
)
def test_admin_routes_refuse_tenant_keys_service_token_and_no_token(
    ready: Api, method: str, path: str
) -> None:
    for headers in (bearer(ready.keys["acme"]), SERVICE_H, {}, {"Authorization": "Basic eA=="}):
        r = ready.client.request(method, path, json={}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "Unauthorized"


def test_tenant_routes_refuse_the_admin_token(ready: Api) -> None:
    r = ready.client.get("/v1/adapters", headers=ADMIN_H)
    assert r.status_code == 401


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/tenants", {"name": "x1", "is_admin": True}),
        ("/v1/tenants/acme/keys", {"name": "k", "tenant": "globex"}),
        ("/v1/pools", {"name": "p2", "base_model": {"name": "m", "uri": "/x", "x": 1}}),
    ],
)
def test_unknown_body_fields_are_refused(ready: Api, path: str, body: dict[str, object]) -> None:
    r = ready.client.post(path, json=body, headers=ADMIN_H)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "InvalidRequest"


def test_unknown_fields_in_patches_are_refused(ready: Api) -> None:
    c = ready.client
    r = c.patch("/v1/tenants/acme", json={"name": "other"}, headers=ADMIN_H)
    assert r.status_code == 400
    r = c.patch("/v1/pools/pool-a", json={"base_model": {"name": "x"}}, headers=ADMIN_H)
    assert r.status_code == 400
    r = c.patch("/v1/adapters/x", json={"current_version": 1, "path": "/"},
                headers=bearer(ready.keys["acme"]))  # fmt: skip
    assert r.status_code == 400


def test_pool_lifecycle(api: Api) -> None:
    pool = api.pool(max_lora_rank=16)
    assert pool["base_model"] == {"name": BASE_NAME, "uri": str(api.base_model_dir)}
    c = api.client
    assert c.get("/v1/pools/pool-a", headers=ADMIN_H).json()["max_lora_rank"] == 16
    r = c.patch("/v1/pools/pool-a", json={"max_loras": 3}, headers=ADMIN_H)
    assert r.status_code == 200 and r.json()["max_loras"] == 3
    assert [p["name"] for p in c.get("/v1/pools", headers=ADMIN_H).json()] == ["pool-a"]
    assert c.get("/v1/pools/nope", headers=ADMIN_H).status_code == 404
    dup = {"name": "pool-a", "base_model": {"name": BASE_NAME, "uri": str(api.base_model_dir)}}
    assert c.post("/v1/pools", json=dup, headers=ADMIN_H).status_code == 409


@pytest.mark.parametrize("uri", ["/nonexistent/model", "/dev/null", "/etc"])
def test_pool_with_unreadable_base_model_is_refused(api: Api, uri: str) -> None:
    body = {"name": "bad", "base_model": {"name": "m", "uri": uri}}
    r = api.client.post("/v1/pools", json=body, headers=ADMIN_H)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "InvalidBaseModel"


def test_every_state_change_is_audited(ready: Api) -> None:
    from loraplane.controlplane.crud.audit import list_events

    ready.client.patch("/v1/tenants/acme", json={"max_rank": 8}, headers=ADMIN_H)
    ready.upload(ready.keys["acme"], "bot", ready.adapter_dir())
    with ready.client.app.state.ctx.sessions() as session:  # type: ignore[attr-defined]
        actions = [e.action for e in list_events(session)]
    assert {"pool.create", "tenant.create", "key.create", "tenant.update"} <= set(actions)
    assert "adapter.version.create" in actions
