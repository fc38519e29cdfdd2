"""Pools are named by (namespace, name), and a pool whose base model is only on its replicas'
volume takes its config.json from their pressure reports."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from loraplane.controlplane.crud.audit import list_events
from tests.controlplane.conftest import ADMIN_H, BASE_CONFIG, BASE_NAME, SERVICE_H, Api

OTHER = "team-b"


def report(api: Api, pool: str = "pool-a", namespace: str | None = None, **fields: Any) -> Any:
    body = {"pool": pool, "replica": "r0", **fields}
    if namespace is not None:
        body["namespace"] = namespace
    return api.client.post("/internal/v1/pressure", json=body, headers=SERVICE_H)


def volume_pool(api: Api, name: str = "vol-pool", **limits: Any) -> Any:
    """Mirror a pool whose model only its replicas see (the uri is not readable here)."""
    body = {
        "namespace": OTHER,
        "name": name,
        "base_model": {"name": BASE_NAME, "uri": "/models/on-a-pvc", "config_from_replicas": True},
        **limits,
    }
    return api.client.put(
        f"/internal/v1/pools/{name}", params={"namespace": OTHER}, json=body, headers=SERVICE_H
    )


def test_pools_named_alike_in_two_namespaces_are_independent(api: Api) -> None:
    c = api.client
    api.pool("pool-a", max_lora_rank=16)
    body = {
        "namespace": OTHER,
        "name": "pool-a",
        "base_model": {"name": BASE_NAME, "uri": str(api.base_model_dir)},
        "max_lora_rank": 32,
    }
    created = c.post("/v1/pools", json=body, headers=ADMIN_H)
    assert created.status_code == 201, created.text
    assert (created.json()["namespace"], created.json()["max_lora_rank"]) == (OTHER, 32)
    assert c.post("/v1/pools", json=body, headers=ADMIN_H).json()["error"]["code"] == (
        "AlreadyExists"
    )
    listed = c.get("/v1/pools", headers=ADMIN_H).json()
    assert [(p["namespace"], p["name"]) for p in listed] == [
        ("default", "pool-a"),
        (OTHER, "pool-a"),
    ]

    # pressure lands on the named pool only
    assert report(api, namespace=OTHER, deferred=9).json()["namespace"] == OTHER
    mine = c.get("/v1/pools/pool-a", params={"namespace": OTHER}, headers=ADMIN_H).json()
    default = c.get("/v1/pools/pool-a", headers=ADMIN_H).json()
    assert mine["pressure"]["replicas"]["r0"]["deferred"] == 9
    assert default["pressure"] is None and default["max_lora_rank"] == 16
    report(api, deferred=2)  # no namespace: "default"
    mine = c.get("/v1/pools/pool-a", params={"namespace": OTHER}, headers=ADMIN_H).json()
    assert mine["pressure"]["replicas"]["r0"]["deferred"] == 9

    # limits and deletion too
    r = c.patch("/v1/pools/pool-a", params={"namespace": OTHER}, json={"max_loras": 2},
                headers=ADMIN_H)  # fmt: skip
    assert r.json()["max_loras"] == 2
    assert c.get("/v1/pools/pool-a", headers=ADMIN_H).json()["max_loras"] == 8
    r = c.delete("/internal/v1/pools/pool-a", params={"namespace": OTHER}, headers=SERVICE_H)
    assert r.status_code == 204
    r = c.get("/v1/pools/pool-a", params={"namespace": OTHER}, headers=ADMIN_H)
    assert (r.status_code, r.json()["error"]["message"]) == (404, f"pool {OTHER}/pool-a not found")
    assert c.get("/v1/pools/pool-a", headers=ADMIN_H).status_code == 200
    assert report(api, namespace=OTHER).status_code == 404
    with c.app.state.ctx.sessions() as session:  # type: ignore[attr-defined]
        targets = {(e.action, e.target) for e in list_events(session)}
    assert {("pool.create", f"pools/{OTHER}/pool-a"), ("pool.update", f"pools/{OTHER}/pool-a"),
            ("pool.delete", f"pools/{OTHER}/pool-a"), ("pool.create", "pools/default/pool-a")} <= (
        targets
    )  # fmt: skip


def test_a_mirrored_pool_must_name_the_same_namespace_in_body_and_query(api: Api) -> None:
    body = {"namespace": OTHER, "name": "p", "base_model": {"name": BASE_NAME,
            "uri": str(api.base_model_dir)}}  # fmt: skip
    r = api.client.put("/internal/v1/pools/p", json=body, headers=SERVICE_H)  # query: default
    assert r.status_code == 400 and f"{OTHER}/p" in r.json()["error"]["message"]
    r = api.client.get("/v1/pools/p", params={"namespace": "Not_A_Label"}, headers=ADMIN_H)
    assert r.status_code == 400


def test_a_volume_pool_is_registered_without_reading_its_uri_and_learns_its_config(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    key = api.tenant("acme")
    created = volume_pool(api)
    assert created.status_code == 201, created.text
    assert created.json()["base_model_config"] is None

    # every pool of the base model is pending: uploads are refused, to be retried later
    r = api.upload(key, "bot", api.adapter_dir())
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "BaseModelPending"
    assert f"pool {OTHER}/vol-pool" in r.json()["error"]["message"]

    # a report without a config changes nothing; one with it sets the pool's config
    assert report(api, "vol-pool", OTHER).json()["base_model_config_known"] is False
    r = report(api, "vol-pool", OTHER, base_model_config=BASE_CONFIG)
    assert r.status_code == 200 and r.json()["base_model_config_known"] is True
    pool = api.client.get("/internal/v1/pools/vol-pool", params={"namespace": OTHER},
                          headers=SERVICE_H).json()  # fmt: skip
    assert pool["base_model_config"] == BASE_CONFIG
    assert api.upload(key, "bot", api.adapter_dir()).status_code == 201

    # another replica's different config does not replace it (the first stays, with a warning)
    bigger = {**BASE_CONFIG, "hidden_size": 128, "intermediate_size": 256}
    with caplog.at_level(logging.WARNING, logger="loraplane.controlplane.crud.pools"):
        r = report(api, "vol-pool", OTHER, replica="r1", base_model_config=bigger)
    assert r.status_code == 200 and r.json()["base_model_config_known"] is True
    assert "differs" in caplog.text
    pool = api.client.get("/v1/pools/vol-pool", params={"namespace": OTHER},
                          headers=ADMIN_H).json()  # fmt: skip
    assert pool["base_model_config"] == BASE_CONFIG
    assert api.upload(key, "bot", api.adapter_dir(seed=1)).status_code == 201


def test_a_malformed_reported_config_refuses_that_report_only(api: Api) -> None:
    api.tenant("acme")
    assert volume_pool(api).status_code == 201
    usage = [{"tenant": "acme", "requests": 1}]
    r = report(api, "vol-pool", OTHER, base_model_config={"model_type": "gpt2"}, usage=usage)
    assert r.status_code == 422 and r.json()["error"]["code"] == "InvalidBaseModel"
    pool = api.client.get("/v1/pools/vol-pool", params={"namespace": OTHER},
                          headers=ADMIN_H).json()  # fmt: skip
    assert (pool["pressure"], pool["base_model_config"]) == (None, None)  # nothing recorded
    r = report(api, "vol-pool", OTHER, usage=usage)  # the next report, without it
    assert r.status_code == 200 and r.json()["usage_rows"] == 1
    r = report(api, "vol-pool", OTHER, base_model_config={"x": "y" * (1 << 20)})
    assert r.status_code == 400  # over the size of any config.json


def test_a_pending_pool_is_skipped_for_shapes_but_its_rank_limit_holds(api: Api) -> None:
    key = api.tenant("acme")
    api.pool("pool-a", max_lora_rank=64)
    assert volume_pool(api, max_lora_rank=4).status_code == 201
    # shapes come from pool-a; the pending pool will load the adapter too: rank 4 at most
    r = api.upload(key, "bot", api.adapter_dir(r=8))
    assert (r.status_code, r.json()["error"]["code"]) == (422, "RankTooLarge")
    assert api.upload(key, "bot", api.adapter_dir(r=4)).status_code == 201
    # a replica of a pool with a config sends it once, then is told it is known
    assert report(api, base_model_config=BASE_CONFIG).json()["base_model_config_known"] is True


def test_a_pools_host_byte_limit_is_mirrored_patched_and_cleared(api: Api) -> None:
    """`max_cpu_lora_bytes` (ServingPool spec.lora.maxCpuLoraBytes): null by default (no byte
    limit); the operator's PUT sets it as the spec has it, null included; a PATCH leaving it
    out keeps it, one giving null clears it."""
    c = api.client
    base = {"name": BASE_NAME, "uri": str(api.base_model_dir)}
    body = {"name": "pool-h", "base_model": base, "max_cpu_loras": 8}
    made = c.put("/internal/v1/pools/pool-h", json=body, headers=SERVICE_H)
    assert made.status_code == 201 and made.json()["max_cpu_lora_bytes"] is None
    sized = {**body, "max_cpu_lora_bytes": 8 << 30}
    assert c.put("/internal/v1/pools/pool-h", json=sized, headers=SERVICE_H).json()[
        "max_cpu_lora_bytes"
    ] == (8 << 30)
    r = c.patch("/v1/pools/pool-h", json={"max_loras": 4}, headers=ADMIN_H)
    assert (r.json()["max_loras"], r.json()["max_cpu_lora_bytes"]) == (4, 8 << 30)  # kept
    r = c.patch("/v1/pools/pool-h", json={"max_cpu_lora_bytes": None}, headers=ADMIN_H)
    assert r.status_code == 200 and r.json()["max_cpu_lora_bytes"] is None
    assert c.put("/internal/v1/pools/pool-h", json=sized, headers=SERVICE_H).status_code == 200
    unset = c.put("/internal/v1/pools/pool-h", json=body, headers=SERVICE_H)
    assert unset.json()["max_cpu_lora_bytes"] is None  # the spec lost it: so does the pool
    bad = c.patch("/v1/pools/pool-h", json={"max_cpu_lora_bytes": 0}, headers=ADMIN_H)
    assert bad.status_code == 400 and "max_cpu_lora_bytes" in bad.json()["error"]["message"]


def test_the_pool_keeps_each_replicas_host_bytes_and_byte_limit(api: Api) -> None:
    """Reports carry the host tier's bytes (`cpu_bytes`) and its byte limit
    (`cpu_bytes_capacity`, null: none); a report from before them records zero and null."""
    api.pool("pool-a")
    assert report(api, cpu_bytes=3 << 20, cpu_bytes_capacity=8 << 20).status_code == 200
    old = {"pool": "pool-a", "replica": "r1", "deferred": 1, "gpu_bytes": 5}
    assert api.client.post("/internal/v1/pressure", json=old, headers=SERVICE_H).status_code == 200
    replicas = api.client.get("/v1/pools/pool-a", headers=ADMIN_H).json()["pressure"]["replicas"]
    assert (replicas["r0"]["cpu_bytes"], replicas["r0"]["cpu_bytes_capacity"]) == (3 << 20, 8 << 20)
    assert (replicas["r1"]["cpu_bytes"], replicas["r1"]["cpu_bytes_capacity"]) == (0, None)
    assert report(api, cpu_bytes=-1).status_code == 400
