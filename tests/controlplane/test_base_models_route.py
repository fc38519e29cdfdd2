"""GET /v1/base-models: what a tenant may upload adapters for, with its limits."""

from __future__ import annotations

from typing import Any

from tests.controlplane.conftest import ADMIN_H, BASE, BASE_NAME, Api, bearer


def _pending_pool(api: Api, name: str, base_model: str) -> None:
    body: dict[str, Any] = {
        "name": name,
        "base_model": {"name": base_model, "uri": "/models/x", "config_from_replicas": True},
    }
    r = api.client.post("/v1/pools", json=body, headers=ADMIN_H)
    assert r.status_code == 201, r.text


def test_a_tenant_lists_the_base_models_it_may_upload_for(api: Api) -> None:
    api.pool("pool-a", max_lora_rank=32)
    api.pool("pool-b", max_lora_rank=16)  # the same base model: an upload must fit both
    _pending_pool(api, "pool-c", "waiting-model")
    key = api.tenant("acme", max_rank=8, max_bytes=1 << 20)
    r = api.client.get("/v1/base-models", headers=bearer(key))
    assert r.status_code == 200, r.text
    assert r.json() == [
        {
            "name": BASE_NAME,
            "ready": True,
            "model_type": BASE.model_type,
            "num_layers": BASE.num_layers,
            "hidden_size": BASE.hidden_size,
            "max_lora_rank": 8,
            "max_adapter_bytes": 1 << 20,
        },
        {
            "name": "waiting-model",
            "ready": False,
            "model_type": None,
            "num_layers": None,
            "hidden_size": None,
            "max_lora_rank": None,
            "max_adapter_bytes": None,
        },
    ]
    # the pools' lowest rank when the tenant's quota is higher; nothing of the pools shows
    other = api.tenant("globex", max_rank=64)
    body = api.client.get("/v1/base-models", headers=bearer(other)).json()
    assert body[0]["max_lora_rank"] == 16
    assert "pool" not in r.text and "/models/x" not in r.text and "namespace" not in r.text


def test_the_listed_name_is_what_an_upload_takes(api: Api) -> None:
    api.pool()
    key = api.tenant("acme")
    (offer,) = api.client.get("/v1/base-models", headers=bearer(key)).json()
    r = api.upload(key, "first", api.adapter_dir(), base_model=offer["name"])
    assert r.status_code in (201, 202), r.text


def test_no_pool_means_an_empty_list(api: Api) -> None:
    key = api.tenant("acme")
    r = api.client.get("/v1/base-models", headers=bearer(key))
    assert (r.status_code, r.json()) == (200, [])


def test_the_list_needs_a_tenant_key(api: Api) -> None:
    api.pool()
    r = api.client.get("/v1/base-models")
    assert r.status_code == 401
    assert r.json()["error"]["message"]
    r = api.client.get("/v1/base-models", headers=ADMIN_H)
    assert r.status_code == 401, r.text
