"""Signed LoRAAdapters: `spec.source.signature` (and `signatureKeyId`) checked against the
tenant's signing keys and policy in the control plane before the version is stored; the
status names the refusal (SignatureRequired / SignatureInvalid) and the key id."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from loraplane.adapters import signing
from loraplane.adapters.canonical import digest_of_source
from loraplane.adapters.ingest import list_versions
from loraplane.adapters.store import LocalStore
from tests.operator.conftest import (
    PLATFORM,
    TENANT,
    Cluster,
    ControlPlane,
    StartOperator,
    adapter_body,
    pool_body,
    upload_source,
)
from tests.operator.test_adapters import good_adapter

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

pytestmark = pytest.mark.k8s


def register(controlplane: ControlPlane, key: signing.PrivateKey) -> str:
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    r = controlplane.admin.post(
        f"/v1/tenants/{TENANT}/signing-keys", json={"public_key": pem.decode(), "name": "ci"}
    )
    assert r.status_code == 201, r.text
    key_id: str = r.json()["key_id"]
    return key_id


def test_signatures_good_bad_missing_and_revoked_end_in_their_status(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    r = controlplane.admin.patch(f"/v1/tenants/{TENANT}", json={"require_signature": True})
    assert r.status_code == 200, r.text
    good, revoked, stranger = (
        ec.generate_private_key(ec.SECP256R1()),
        ed25519.Ed25519PrivateKey.generate(),
        ec.generate_private_key(ec.SECP256R1()),
    )
    good_id, revoked_id = register(controlplane, good), register(controlplane, revoked)
    assert controlplane.admin.delete(
        f"/v1/tenants/{TENANT}/signing-keys/{revoked_id}"
    ).status_code == 204  # fmt: skip
    start_operator()
    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))

    def adapter(name: str, seed: int, key: signing.PrivateKey | None, **source: Any) -> None:
        folder = good_adapter(tmp_path, seed=seed)
        body = adapter_body(name, upload_source(s3, folder))
        if key is not None:
            source["signature"] = signing.sign_digest(key, digest_of_source(folder))
        body["spec"]["source"].update(source)
        cluster.create("loraadapters", TENANT, body)

    adapter("signed", 1, good, signatureKeyId=good_id)
    adapter("unsigned", 2, None)
    adapter("stranger", 3, stranger)
    adapter("revoked", 4, revoked)
    expected = {
        "signed": ("Ready", "Ready", ""),
        "unsigned": ("Rejected", "SignatureRequired", f"tenant '{TENANT}' requires"),
        "stranger": ("Rejected", "SignatureInvalid", good_id),
        "revoked": ("Rejected", "SignatureInvalid", f"{revoked_id}, which was revoked"),
    }
    for name, (phase, reason, words) in expected.items():
        status = cluster.wait_phase(name, "Ready", "Rejected", "Failed")["status"]
        assert (status["phase"], status["reason"]) == (phase, reason), (name, status)
        assert words in status["message"], (name, status)
    (version,) = controlplane.versions(TENANT, "signed")
    assert version["signing_key_id"] == good_id
    assert version["signed_digest"] == f"sha256:{version['digest']}"
    store = LocalStore(tmp_path / "store")
    for refused in ("unsigned", "stranger", "revoked"):  # nothing stored for them
        assert list_versions(store, TENANT, refused) == []
