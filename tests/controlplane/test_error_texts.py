"""Error texts that name the actual cause (issue 28): which field and what it must be, in
words (no regex, no pydantic wording at the top), the tenant's rank quota told from the pool's
max_lora_rank, and quotas where 0 means unlimited (the per-minute rates) or is refused with a
reason (adapters, rank, bytes). Each asserted on the app's answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from loraplane.adapters.errors import AdapterRejected
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME, open_adapter_source
from loraplane.controlplane.console.app import reasons
from tests.controlplane.conftest import ADMIN_H, BASE_NAME, Api, bearer

DNS = "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
NAME = "1-63 lowercase letters, digits, '-', '.' or '_', starting and ending with a letter or digit"
NOT_UNLIMITED = "0 is refused: only the per-minute rate limits take 0 for unlimited"


def refused(r: Any) -> dict[str, Any]:
    """The error of a 400 InvalidRequest answer, checked to carry no regex or pydantic text."""
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == "InvalidRequest"
    for raw in ("pattern", "^[", "Input should", "String should", "malformed"):
        assert raw not in error["message"], error["message"]
    return error


def test_a_bad_tenant_name_says_what_a_name_must_be(ready: Api) -> None:
    r = ready.client.post("/v1/tenants", json={"name": "My Tenant"}, headers=ADMIN_H)
    error = refused(r)
    assert error["message"] == f'name: must be {DNS} (got "My Tenant")'
    # programs still get pydantic's own detail, field by field
    (problem,) = error["errors"]
    assert problem["field"] == "name" and problem["type"] == "invalid_value"
    assert problem["detail"].startswith("String should match pattern")


def test_a_bad_adapter_name_is_worded_alike_in_a_form_and_in_json(ready: Api) -> None:
    key = ready.keys["acme"]
    r = ready.upload(key, "My Adapter", ready.adapter_dir())
    assert refused(r)["message"] == f'name: must be {NAME} (got "My Adapter")'
    body = {"name": "My Adapter", "base_model": BASE_NAME, "source_uri": "s3://b/k"}
    r = ready.client.post("/v1/adapters", json=body, headers=bearer(key))
    assert refused(r)["message"] == f'name: must be {NAME} (got "My Adapter")'


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_adapters", -1, f"an integer from 1 to 1000000 ({NOT_UNLIMITED})"),
        ("max_adapters", 0, f"an integer from 1 to 1000000 ({NOT_UNLIMITED})"),
        ("max_rank", 0, f"an integer from 1 to 4096 ({NOT_UNLIMITED})"),
        ("max_bytes", 0, f"an integer from 1 to {1 << 50} (bytes; {NOT_UNLIMITED})"),
        ("requests_per_minute", -5, "an integer from 0 to 1000000000 (0: unlimited)"),
        ("tokens_per_minute", "lots", "an integer from 0 to 1000000000 (0: unlimited)"),
        ("weight", 0, "a number greater than 0 and at most 1000"),
    ],
)
def test_a_bad_quota_says_what_the_quota_must_be(
    ready: Api, field: str, value: object, words: str
) -> None:
    c = ready.client
    shown = json.dumps(value)
    r = c.post("/v1/tenants", json={"name": "newco", field: value}, headers=ADMIN_H)
    assert refused(r)["message"] == f"{field}: must be {words} (got {shown})"
    r = c.patch("/v1/tenants/acme", json={field: value}, headers=ADMIN_H)
    assert refused(r)["message"] == f"{field}: must be {words} (got {shown})"
    assert c.get("/v1/tenants/newco", headers=ADMIN_H).status_code == 404


def test_rates_of_0_are_accepted_as_unlimited(ready: Api) -> None:
    c = ready.client
    body = {"name": "free", "requests_per_minute": 0, "tokens_per_minute": 0}
    r = c.post("/v1/tenants", json=body, headers=ADMIN_H)
    assert r.status_code == 201, r.text
    assert (r.json()["requests_per_minute"], r.json()["tokens_per_minute"]) == (0, 0)
    r = c.patch("/v1/tenants/acme", json={"requests_per_minute": 0}, headers=ADMIN_H)
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 0
    # the control plane's own limiter takes 0 for no limit: a key of that tenant is never 429
    for _ in range(20):
        assert c.get("/v1/adapters", headers=bearer(ready.keys["acme"])).status_code == 200
    # negative control: a limit of 1 is a limit
    assert c.patch("/v1/tenants/globex", json={"requests_per_minute": 1}, headers=ADMIN_H)
    statuses = [c.get("/v1/adapters", headers=bearer(ready.keys["globex"])).status_code]
    statuses.append(c.get("/v1/adapters", headers=bearer(ready.keys["globex"])).status_code)
    assert statuses == [200, 429]


def test_other_refusals_are_worded_too(ready: Api) -> None:
    c = ready.client
    r = c.post("/v1/tenants", json={"name": "x1", "is_admin": True}, headers=ADMIN_H)
    assert refused(r)["message"] == (
        "is_admin: not a field of this request (unknown fields are refused)"
    )
    r = c.post("/v1/tenants", json={}, headers=ADMIN_H)
    assert refused(r)["message"] == "name: required"
    r = c.post(
        "/v1/tenants", content=b'{"name": ', headers={**ADMIN_H, "Content-Type": "application/json"}
    )
    assert refused(r)["message"].startswith("body: not valid JSON (")
    r = c.post("/v1/tenants", json=["acme"], headers=ADMIN_H)
    assert refused(r)["message"] == "body: must be a JSON object"
    r = c.get("/v1/pools/pool-a?namespace=Bad_NS", headers=ADMIN_H)  # a query parameter
    assert refused(r)["message"] == f'namespace: must be {DNS} (got "Bad_NS")'
    pool = {"name": "p2", "base_model": {"name": "m", "uri": "relative/path"}}
    r = c.post("/v1/pools", json=pool, headers=ADMIN_H)
    assert refused(r)["message"] == (
        "base_model.uri: must be an absolute path (/...) or an s3:// URI, without spaces, "
        'at most 1024 characters (got "relative/path")'
    )


def test_two_bad_fields_are_both_named(ready: Api) -> None:
    body = {"name": "ok", "max_rank": 0, "weight": -1}
    error = refused(ready.client.post("/v1/tenants", json=body, headers=ADMIN_H))
    assert error["message"].startswith("max_rank: must be an integer from 1 to 4096")
    weight = "weight: must be a number greater than 0 and at most 1000 (got -1)"
    assert error["message"].endswith(f"; {weight}")
    assert [p["field"] for p in error["errors"]] == ["max_rank", "weight"]


def test_a_refused_value_is_echoed_short_and_never_as_a_key(ready: Api) -> None:
    secretish = "lp_" + "A" * 43
    r = ready.client.post("/v1/tenants", json={"name": secretish}, headers=ADMIN_H)
    message = refused(r)["message"]
    assert secretish not in message and message.startswith("name: must be ")
    long = "x" * 500
    r = ready.client.post("/v1/tenants", json={"name": long}, headers=ADMIN_H)
    assert refused(r)["message"].endswith(f'(got "{"x" * 80}...")')


def test_the_consoles_sentence_for_InvalidRequest_does_not_say_malformed() -> None:
    sentence = reasons()["InvalidRequest"]
    assert "malformed" not in sentence
    assert "names the field and what it must be" in sentence


# -- the tenant's rank quota is not the pool's max_lora_rank ---------------------------------


def test_a_rank_over_the_tenants_quota_names_the_quota(api: Api) -> None:
    api.pool(max_lora_rank=64)
    key = api.tenant("acme", max_rank=4)
    r = api.upload(key, "bot", api.adapter_dir(r=8))
    assert r.status_code == 422 and r.json()["error"]["code"] == "RankTooLarge"
    assert r.json()["error"]["message"] == (
        "rank 8 exceeds your tenant's rank quota (max_rank 4; an admin can raise it)"
    )


def test_a_rank_over_the_pools_max_lora_rank_names_the_pool(api: Api) -> None:
    api.pool("pool-a", max_lora_rank=16)
    api.pool("pool-b", max_lora_rank=4)  # the strictest pool of the base model is named
    key = api.tenant("acme", max_rank=64)
    r = api.upload(key, "bot", api.adapter_dir(r=8))
    assert r.status_code == 422 and r.json()["error"]["code"] == "RankTooLarge"
    assert r.json()["error"]["message"] == (
        "rank 8 exceeds the pool's max_lora_rank 4 (pool default/pool-b)"
    )


def test_at_a_tie_the_pools_limit_is_named(api: Api) -> None:
    api.pool(max_lora_rank=4)
    key = api.tenant("acme", max_rank=4)  # raising the quota alone would not help
    r = api.upload(key, "bot", api.adapter_dir(r=8))
    assert r.json()["error"]["message"] == (
        "rank 8 exceeds the pool's max_lora_rank 4 (pool default/pool-a)"
    )


def test_weights_over_the_tenants_byte_quota_name_the_quota(api: Api) -> None:
    api.pool()
    key = api.tenant("acme", max_bytes=1000)
    folder = api.adapter_dir()
    size = (folder / WEIGHTS_NAME).stat().st_size
    r = api.upload(key, "bot", folder)
    assert r.status_code == 422 and r.json()["error"]["code"] == "TooLarge"
    assert r.json()["error"]["message"] == (
        f"{WEIGHTS_NAME} is {size} bytes, over your tenant's quota of 1000 bytes per adapter "
        "(max_bytes; an admin can raise it)"
    )


# -- a config without its weights -------------------------------------------------------------


def test_a_config_without_weights_says_so_as_the_cli_does_and_names_no_server_path(
    ready: Api, tmp_path: Path
) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    shutil.copy(ready.adapter_dir() / CONFIG_NAME, folder / CONFIG_NAME)
    (folder / "README.md").write_text("a model card, no weights\n")
    # what `loraplane adapters push` says of the tenant's own folder
    with pytest.raises(AdapterRejected) as cli, open_adapter_source(folder, AdapterLimits()):
        pass
    assert cli.value.message == f"{folder} has no {WEIGHTS_NAME} beside {CONFIG_NAME}"
    said = f"the upload has no {WEIGHTS_NAME} beside {CONFIG_NAME}"
    key = ready.keys["acme"]
    r = ready.upload(key, "half", folder)  # both files as parts: the console and REST
    assert r.status_code == 422, r.text
    assert r.json()["error"] == {"code": "UnsupportedFormat", "message": said}
    r = ready.upload(key, "half", folder, headers={"Prefer": "respond-async"})
    assert r.status_code == 202, r.text
    job = ready.wait_upload(key, r.headers["location"])  # a background ingest says the same
    assert job["error"] == {"code": "UnsupportedFormat", "message": said}
