"""Internal API (service token): resolve, pressure reports, operator-recorded versions."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from tests.controlplane.conftest import ADMIN_H, BASE_NAME, SERVICE_H, Api, bearer


def resolve(api: Api, key: str, model: str, token: dict[str, str] = SERVICE_H) -> object:
    return api.client.get(
        "/internal/v1/resolve", params={"model": model}, headers={**token, "X-Tenant-Key": key}
    )


def test_resolve_current_pinned_and_base(ready: Api) -> None:
    key = ready.keys["acme"]
    v1 = ready.upload(key, "bot", ready.adapter_dir(seed=1)).json()["version"]
    ready.upload(key, "bot", ready.adapter_dir(seed=2))
    r = resolve(ready, key, "bot")
    body = r.json()  # type: ignore[attr-defined]
    assert body["version"] == 2 and body["tenant"] == "acme" and body["adapter"] == "bot"
    assert body["path"].startswith("adapters/acme/bot/v2-") and body["rank"] == 8
    assert body["base_model"] == BASE_NAME and body["requests_per_minute"] == 600
    pinned = resolve(ready, key, "bot@1").json()  # type: ignore[attr-defined]
    assert pinned["version"] == 1 and pinned["digest"] == v1["digest"]
    base = resolve(ready, key, BASE_NAME).json()  # type: ignore[attr-defined]
    assert base["adapter"] is None and base["base_model"] == BASE_NAME and base["path"] is None
    # rolling back changes what the unpinned name resolves to
    ready.client.patch("/v1/adapters/bot", json={"current_version": 1}, headers=bearer(key))
    assert resolve(ready, key, "bot").json()["version"] == 1  # type: ignore[attr-defined]


def test_resolve_carries_the_tenants_weight_in_its_one_query(ready: Api) -> None:
    key = ready.keys["acme"]
    ready.upload(key, "bot", ready.adapter_dir(seed=1))
    assert resolve(ready, key, "bot").json()["weight"] == 1.0  # type: ignore[attr-defined]
    r = ready.client.patch("/v1/tenants/acme", json={"weight": 4.5}, headers=ADMIN_H)
    assert r.status_code == 200
    engine = ready.client.app.state.ctx.resolve_engine  # type: ignore[attr-defined]
    statements: list[str] = []
    listen = ("before_cursor_execute", lambda *a: statements.append(a[2]))
    event.listen(engine, *listen)
    try:
        for model in ("bot", "bot@1", BASE_NAME):
            body = resolve(ready, key, model).json()  # type: ignore[attr-defined]
            assert (body["tenant"], body["weight"]) == ("acme", 4.5), model
    finally:
        event.remove(engine, *listen)
    # the key's use was recorded by the first resolve: one statement per resolution
    assert len(statements) == 3 and all(s.lstrip().startswith("SELECT") for s in statements)
    other = resolve(ready, ready.keys["globex"], BASE_NAME).json()  # type: ignore[attr-defined]
    assert other["weight"] == 1.0  # another tenant's weight is its own


@pytest.mark.parametrize("model", ["nope", "bot@3", "bot@0", "bot@x", "@1", "bot@99999999999"])
def test_resolve_unknown_model_or_version_is_404(ready: Api, model: str) -> None:
    key = ready.keys["acme"]
    ready.upload(key, "bot", ready.adapter_dir(seed=1))
    r = resolve(ready, key, model)
    assert r.status_code == 404, r.text  # type: ignore[attr-defined]


def test_resolve_needs_the_service_token_and_a_valid_tenant_key(ready: Api) -> None:
    key = ready.keys["acme"]
    assert resolve(ready, key, "x", ADMIN_H).status_code == 401  # type: ignore[attr-defined]
    assert resolve(ready, key, "x", bearer(key)).status_code == 401  # type: ignore[attr-defined]
    bad = "lp_" + "A" * 43
    assert resolve(ready, bad, BASE_NAME).status_code == 401  # type: ignore[attr-defined]
    assert resolve(ready, "junk", BASE_NAME).status_code == 401  # type: ignore[attr-defined]
    r = ready.client.get("/internal/v1/resolve", params={"model": "x"}, headers=SERVICE_H)
    assert r.status_code == 400  # no tenant key header


def test_pressure_is_kept_per_replica_on_the_pool(ready: Api) -> None:
    c = ready.client
    for replica, deferred in (("r0", 3), ("r1", 5), ("r0", 4)):
        body = {
            "pool": "pool-a", "replica": replica, "deferred": deferred, "waiting_adapters": 2,
            "running_adapters": 4, "slots_used": 4, "gpu_bytes": 1 << 20, "kv_usage": 0.5,
            "adapters_waiting": [{"tenant": "acme", "adapter": "bot", "waiting_requests": 2}],
        }  # fmt: skip
        r = c.post("/internal/v1/pressure", json=body, headers=SERVICE_H)
        assert r.status_code == 200, r.text
    assert r.json()["replicas"] == 2  # live replicas: each enforces half a tenant's limits
    pool = c.get("/v1/pools/pool-a", headers=ADMIN_H).json()
    replicas = pool["pressure"]["replicas"]
    assert {k: v["deferred"] for k, v in replicas.items()} == {"r0": 4, "r1": 5}
    assert replicas["r0"]["adapters_waiting"][0]["waiting_requests"] == 2
    assert pool["pressure_at"] is not None
    r = c.post("/internal/v1/pressure", json={"pool": "nope", "replica": "r"}, headers=SERVICE_H)
    assert r.status_code == 404
    r = c.post("/internal/v1/pressure", json={"pool": "pool-a", "replica": "r"}, headers=ADMIN_H)
    assert r.status_code == 401


def test_replicas_that_stopped_reporting_no_longer_share_the_rate_limits(
    ready: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import timedelta

    from loraplane.controlplane.crud import pools as crud_pools

    c = ready.client

    def report(replica: str) -> int:
        r = c.post("/internal/v1/pressure", json={"pool": "pool-a", "replica": replica},
                   headers=SERVICE_H)  # fmt: skip
        assert r.status_code == 200, r.text
        return int(r.json()["replicas"])

    assert [report(r) for r in ("gone", "a", "b")] == [1, 2, 3]
    later = crud_pools.utcnow() + timedelta(seconds=crud_pools.LIVE_REPLICA_SECONDS + 1)
    monkeypatch.setattr(crud_pools, "utcnow", lambda: later)
    assert report("a") == 1  # "gone" and "b" have not reported for over 30 s
    assert report("b") == 2


def test_operator_recorded_version_is_idempotent_and_conflicts_are_409(ready: Api) -> None:
    record = {
        "tenant": "acme", "name": "gitops", "version": 1, "digest": "a" * 64,
        "path": "adapters/acme/gitops/v1-aaaaaaaaaaaa/", "rank": 8, "alpha": 16.0,
        "target_modules": ["q_proj"], "size_bytes": 123, "base_model": BASE_NAME,
    }  # fmt: skip
    c = ready.client
    assert c.post("/internal/v1/versions", json=record, headers=SERVICE_H).status_code == 201
    assert c.post("/internal/v1/versions", json=record, headers=SERVICE_H).status_code == 200
    clash = {**record, "digest": "b" * 64}
    r = c.post("/internal/v1/versions", json=clash, headers=SERVICE_H)
    assert r.status_code == 409 and r.json()["error"]["code"] == "Conflict"
    assert resolve(ready, ready.keys["acme"], "gitops").json()["version"] == 1  # type: ignore[attr-defined]
    r = c.post("/internal/v1/versions", json={**record, "tenant": "nobody"}, headers=SERVICE_H)
    assert r.status_code == 404
    r = c.post("/internal/v1/versions", json={**record, "path": None}, headers=SERVICE_H)
    assert r.status_code == 400


def test_operator_mirrors_pools_with_the_service_token(ready: Api) -> None:
    c = ready.client
    body = {"name": "pool-b", "base_model": {"name": BASE_NAME, "uri": str(ready.base_model_dir)},
            "max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 8}  # fmt: skip
    assert c.put("/internal/v1/pools/pool-b", json=body, headers=ADMIN_H).status_code == 401
    assert c.put("/internal/v1/pools/pool-b", json=body, headers=SERVICE_H).status_code == 201
    changed = {**body, "max_lora_rank": 32}
    r = c.put("/internal/v1/pools/pool-b", json=changed, headers=SERVICE_H)
    assert r.status_code == 200
    assert r.json()["max_lora_rank"] == 32
    r = c.get("/internal/v1/pools/pool-b", headers=SERVICE_H)
    assert r.status_code == 200
    assert r.json()["max_lora_rank"] == 32
    other = {**body, "base_model": {"name": "other-model", "uri": str(ready.base_model_dir)}}
    r = c.put("/internal/v1/pools/pool-b", json=other, headers=SERVICE_H)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "Conflict"
    r = c.put("/internal/v1/pools/pool-c", json=body, headers=SERVICE_H)
    assert r.status_code == 400  # the body names another pool
    assert c.delete("/internal/v1/pools/pool-b", headers=SERVICE_H).status_code == 204
    assert c.get("/internal/v1/pools/pool-b", headers=SERVICE_H).status_code == 404
    assert c.delete("/internal/v1/pools/pool-b", headers=SERVICE_H).status_code == 404


def test_operator_deletes_an_adapter_and_keeps_its_versions(ready: Api) -> None:
    c = ready.client
    key = ready.keys["acme"]
    assert ready.upload(key, "bot", ready.adapter_dir(seed=3)).status_code == 201
    path = "/internal/v1/tenants/acme/adapters/bot"
    assert c.delete(path, headers=bearer(key)).status_code == 401
    assert c.delete(path, headers=SERVICE_H).status_code == 204
    assert c.get("/v1/adapters/bot", headers=bearer(key)).status_code == 404
    assert resolve(ready, key, "bot").status_code == 404  # type: ignore[attr-defined]
    assert c.delete(path, headers=SERVICE_H).status_code == 404
    assert (
        c.delete("/internal/v1/tenants/nobody/adapters/bot", headers=SERVICE_H).status_code == 404
    )


def test_admin_can_delete_a_pool(ready: Api) -> None:
    c = ready.client
    assert c.delete("/v1/pools/pool-a", headers=bearer(ready.keys["acme"])).status_code == 401
    assert c.delete("/v1/pools/pool-a", headers=ADMIN_H).status_code == 204
    assert c.get("/v1/pools/pool-a", headers=ADMIN_H).status_code == 404


def test_a_usage_batch_sent_again_is_counted_once(ready: Api) -> None:
    """The first answer was lost and the replica sends the same batch again: the usage counts
    once; the next batch counts; another replica's batch of the same id counts too."""
    c, key = ready.client, ready.keys["acme"]
    row = {"tenant": "acme", "adapter": "bot", "requests": 2, "prompt_tokens": 10,
           "completion_tokens": 4}  # fmt: skip

    def report(replica: str, batch: str) -> dict[str, object]:
        body = {"pool": "pool-a", "replica": replica, "usage": [row], "usage_batch": batch}
        r = c.post("/internal/v1/pressure", json=body, headers=SERVICE_H)
        assert r.status_code == 200, r.text
        answer: dict[str, object] = r.json()
        return answer

    assert report("r0", "b1")["usage_duplicate"] is False
    assert report("r0", "b1")["usage_duplicate"] is True
    assert report("r0", "b2")["usage_duplicate"] is False
    assert report("r1", "b2")["usage_duplicate"] is False
    rows = c.get("/v1/usage", headers=bearer(key)).json()
    rows = rows if isinstance(rows, list) else rows.get("items", rows.get("usage", []))
    assert sum(r["requests"] for r in rows if r["adapter"] == "bot") == 6  # 3 batches, not 4
    bad = {"pool": "pool-a", "replica": "r0", "usage_batch": "no spaces allowed"}
    assert c.post("/internal/v1/pressure", json=bad, headers=SERVICE_H).status_code == 400
