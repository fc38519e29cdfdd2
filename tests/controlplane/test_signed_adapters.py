"""Signed adapters through the REST API: signing keys (register, list, revoke, audit), the
tenant's and the pools' policy, and uploads signed well, badly, not at all, by a revoked or
an unknown key; the operator's record of a version is verified the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from loraplane.adapters import signing
from loraplane.adapters.canonical import digest_of_source
from loraplane.controlplane.models import AuditEvent
from loraplane.controlplane.settings import Settings
from tests.controlplane.conftest import ADMIN_H, SERVICE_H, Api, bearer


def new_key(kind: str) -> signing.PrivateKey:
    if kind == "p256":
        return ec.generate_private_key(ec.SECP256R1())
    return ed25519.Ed25519PrivateKey.generate()


def pem(key: signing.PrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def register(api: Api, tenant: str, key: signing.PrivateKey, name: str = "ci") -> str:
    r = api.client.post(
        "/v1/signing-keys", json={"public_key": pem(key), "name": name},
        headers=bearer(api.keys[tenant]),
    )  # fmt: skip
    assert r.status_code == 201, r.text
    key_id: str = r.json()["key_id"]
    assert key_id == signing.public_key_id(key)
    return key_id


def signed(key: signing.PrivateKey, folder: Path, key_id: str | None = None) -> dict[str, str]:
    fields = {"signature": signing.sign_digest(key, digest_of_source(folder))}
    return {**fields, "signature_key_id": key_id} if key_id else fields


def refusal(r: Any) -> tuple[int, str, str]:
    error = r.json()["error"]
    return r.status_code, error["code"], error["message"]


@pytest.mark.parametrize("kind", ["p256", "ed25519"])
def test_good_signature_is_stored_with_the_version_and_shown(ready: Api, kind: str) -> None:
    key = new_key(kind)
    key_id = register(ready, "acme", key)
    folder = ready.adapter_dir(seed=1)
    r = ready.upload(ready.keys["acme"], "bot", folder, fields=signed(key, folder))
    assert r.status_code == 201, r.text
    version = r.json()["version"]
    assert version["signing_key_id"] == key_id
    assert version["signed_digest"] == f"sha256:{version['digest']}"
    assert version["digest"] == digest_of_source(folder)  # the CLI's digest is the server's
    h = bearer(ready.keys["acme"])
    (listed,) = ready.client.get("/v1/adapters/bot/versions", headers=h).json()
    assert listed["signing_key_id"] == key_id
    current = ready.client.get("/v1/adapters/bot", headers=h).json()["current"]
    assert current["signing_key_id"] == key_id
    # an unsigned upload is fine while nothing requires a signature, and shows no signer
    r = ready.upload(ready.keys["acme"], "plain", ready.adapter_dir(seed=2))
    assert r.status_code == 201 and r.json()["version"]["signing_key_id"] is None


def test_keys_register_list_revoke_are_the_tenants_own_and_audited(
    ready: Api, settings: Settings
) -> None:
    key = new_key("p256")
    key_id = register(ready, "acme", key)
    acme, globex = bearer(ready.keys["acme"]), bearer(ready.keys["globex"])
    again = ready.client.post("/v1/signing-keys", json={"public_key": pem(key)}, headers=acme)
    assert again.status_code == 200 and again.json()["key_id"] == key_id
    assert ready.client.get("/v1/signing-keys", headers=globex).json() == []
    assert ready.client.delete(f"/v1/signing-keys/{key_id}", headers=globex).status_code == 404
    (listed,) = ready.client.get("/v1/signing-keys", headers=acme).json()
    assert listed["algorithm"] == "ecdsa-p256-sha256" and listed["revoked_at"] is None
    assert ready.client.delete(f"/v1/signing-keys/{key_id}", headers=acme).status_code == 204
    (listed,) = ready.client.get("/v1/tenants/acme/signing-keys", headers=ADMIN_H).json()
    assert listed["revoked_at"] is not None
    # a revoked key cannot come back: what it signed stays refused
    back = ready.client.post("/v1/signing-keys", json={"public_key": pem(key)}, headers=acme)
    assert back.status_code == 409 and key_id in back.json()["error"]["message"]
    bad = ready.client.post("/v1/signing-keys", json={"public_key": "nope"}, headers=acme)
    assert bad.status_code == 400 and "public_key" in bad.json()["error"]["message"]
    engine = create_engine(settings.effective_database_url)
    with Session(engine) as session:
        actions = list(session.scalars(select(AuditEvent.action).order_by(AuditEvent.id)))
    engine.dispose()
    assert actions.count("signing_key.create") == 1 and actions.count("signing_key.revoke") == 1


def test_required_signature_missing_bad_unknown_and_revoked_are_refused(ready: Api) -> None:
    assert ready.client.patch(
        "/v1/tenants/acme", json={"require_signature": True}, headers=ADMIN_H
    ).json()["require_signature"] is True  # fmt: skip
    key, other = new_key("ed25519"), new_key("p256")
    key_id = register(ready, "acme", key)
    folder, k = ready.adapter_dir(seed=3), ready.keys["acme"]
    digest = digest_of_source(folder)

    status, code, message = refusal(ready.upload(k, "bot", folder))
    assert (status, code) == (422, "SignatureRequired")
    assert "tenant 'acme' requires signed adapters" in message and digest in message

    status, code, message = refusal(
        ready.upload(k, "bot", folder, fields=signed(other, folder, key_id))
    )
    assert (status, code) == (422, "SignatureInvalid") and key_id in message

    other_id = signing.public_key_id(other)
    status, code, message = refusal(
        ready.upload(k, "bot", folder, fields=signed(other, folder, other_id))
    )
    assert (status, code) == (422, "SignatureInvalid")
    assert f"key id {other_id} is not a registered signing key" in message

    assert ready.client.delete(f"/v1/signing-keys/{key_id}", headers=bearer(k)).status_code == 204
    status, code, message = refusal(ready.upload(k, "bot", folder, fields=signed(key, folder)))
    assert (status, code) == (422, "SignatureInvalid") and f"{key_id}, which was revoked" in message
    assert ready.client.get("/v1/adapters/bot", headers=bearer(k)).status_code == 404

    # a bad signature is refused even where none is required
    g = ready.keys["globex"]
    status, code, _ = refusal(ready.upload(g, "bot", folder, fields={"signature": "AAAA"}))
    assert (status, code) == (422, "SignatureInvalid")


def test_a_pools_policy_requires_signatures_for_its_base_model(ready: Api) -> None:
    r = ready.client.patch(
        "/v1/pools/pool-a", json={"require_signed_adapters": True}, headers=ADMIN_H
    )
    assert r.status_code == 200 and r.json()["require_signed_adapters"] is True
    folder, k = ready.adapter_dir(seed=4), ready.keys["globex"]
    status, code, message = refusal(ready.upload(k, "bot", folder))
    assert (status, code) == (422, "SignatureRequired") and "pool default/pool-a" in message
    key = new_key("p256")
    register(ready, "globex", key)
    assert ready.upload(k, "bot", folder, fields=signed(key, folder)).status_code == 201


def test_background_upload_is_verified_as_a_synchronous_one(ready: Api) -> None:
    ready.client.patch("/v1/tenants/acme", json={"require_signature": True}, headers=ADMIN_H)
    key = new_key("ed25519")
    key_id = register(ready, "acme", key)
    folder, k = ready.adapter_dir(seed=5), ready.keys["acme"]
    later = {"Prefer": "respond-async"}
    r = ready.upload(k, "bot", folder, headers=later)
    assert r.status_code == 202
    job = ready.wait_upload(k, r.headers["Location"])
    assert job["status"] == "failed" and job["error"]["code"] == "SignatureRequired"
    r = ready.upload(k, "bot", folder, headers=later, fields=signed(key, folder))
    job = ready.wait_upload(k, r.headers["Location"])
    assert job["status"] == "succeeded", job
    assert job["result"]["version"]["signing_key_id"] == key_id


def test_operator_versions_and_signing_policy_use_the_same_rule(ready: Api) -> None:
    key = new_key("p256")
    key_id = register(ready, "acme", key)
    ready.client.patch("/v1/tenants/acme", json={"require_signature": True}, headers=ADMIN_H)
    r = ready.client.get(
        "/internal/v1/tenants/acme/signing-policy", params={"base_model": "tiny"},
        headers=SERVICE_H,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    policy = r.json()
    assert policy["required"] is True
    assert [(e["key_id"], e["revoked"]) for e in policy["keys"]] == [(key_id, False)]
    digest = "ef" * 32
    record = {
        "tenant": "acme", "name": "op", "version": 1, "digest": digest,
        "path": f"adapters/acme/op/v1-{digest[:12]}/", "rank": 8, "alpha": 16.0,
        "target_modules": ["q_proj"], "size_bytes": 10, "base_model": "tiny",
    }  # fmt: skip
    r = ready.client.post("/internal/v1/versions", json=record, headers=SERVICE_H)
    assert refusal(r)[:2] == (422, "SignatureRequired")
    sig = signing.sign_digest(new_key("p256"), digest)
    r = ready.client.post(
        "/internal/v1/versions", json={**record, "signature": sig}, headers=SERVICE_H
    )
    assert refusal(r)[:2] == (422, "SignatureInvalid")
    good = {**record, "signature": signing.sign_digest(key, digest), "signature_key_id": key_id}
    r = ready.client.post("/internal/v1/versions", json=good, headers=SERVICE_H)
    assert r.status_code == 201, r.text
    assert r.json()["version"]["signing_key_id"] == key_id


def test_signing_keys_by_admin_keeps_registration_to_the_admin(ready: Api) -> None:
    """With `signing_keys_by_admin`, a tenant's API key (perhaps stolen) cannot register a key
    to sign with (403 SigningKeysByAdmin, nothing stored); the admin can, and the tenant still
    lists and revokes its keys. Off again, the tenant registers its own."""
    acme = bearer(ready.keys["acme"])
    turned = ready.client.patch(
        "/v1/tenants/acme", json={"signing_keys_by_admin": True}, headers=ADMIN_H
    )
    assert turned.status_code == 200 and turned.json()["signing_keys_by_admin"] is True
    thief = new_key("ed25519")
    refused = ready.client.post("/v1/signing-keys", json={"public_key": pem(thief)}, headers=acme)
    status, code, message = refusal(refused)
    assert (status, code) == (403, "SigningKeysByAdmin")
    assert "/v1/tenants/acme/signing-keys" in message
    assert ready.client.get("/v1/signing-keys", headers=acme).json() == []

    key = new_key("p256")
    added = ready.client.post(
        "/v1/tenants/acme/signing-keys", json={"public_key": pem(key)}, headers=ADMIN_H
    )
    assert added.status_code == 201, added.text
    key_id = added.json()["key_id"]
    assert [k["key_id"] for k in ready.client.get("/v1/signing-keys", headers=acme).json()] == [
        key_id
    ]
    folder = ready.adapter_dir(seed=5)
    stored = ready.upload(ready.keys["acme"], "bot", folder, fields=signed(key, folder, key_id))
    assert stored.status_code == 201, stored.text
    assert ready.client.delete(f"/v1/signing-keys/{key_id}", headers=acme).status_code == 204

    ready.client.patch("/v1/tenants/acme", json={"signing_keys_by_admin": False}, headers=ADMIN_H)
    register(ready, "acme", thief)
