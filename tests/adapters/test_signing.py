"""Signed adapters' one verification rule (loraplane/adapters/signing.py), the ingest hook that
runs it before anything is stored, and cosign compatibility."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from loraplane.adapters import signing
from loraplane.adapters.canonical import digest_of_source
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store.local import LocalStore
from tests.adapters.crafting import TINY_BASE, lora_config, lora_tensors, write_adapter

DIGEST = "ab" * 32


def _pem(key: signing.PrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def _registered(key: signing.PrivateKey, *, revoked: bool = False) -> signing.SigningKey:
    info = signing.parse_public_key(_pem(key))
    return signing.SigningKey(info.key_id, info.pem, revoked)


def _reason(exc: pytest.ExceptionInfo[AdapterRejected]) -> ReasonCode:
    return exc.value.code


def new_key(kind: str) -> signing.PrivateKey:
    if kind == "p256":
        return ec.generate_private_key(ec.SECP256R1())
    return ed25519.Ed25519PrivateKey.generate()


@pytest.mark.parametrize("kind", ["p256", "ed25519"])
def test_good_signature_verifies_and_names_its_key(kind: str) -> None:
    key = new_key(kind)
    other = ed25519.Ed25519PrivateKey.generate()
    sig = signing.sign_digest(key, DIGEST)
    keys = [_registered(other), _registered(key)]
    found = signing.verify(DIGEST, sig, None, keys, required=True)
    assert found is not None
    assert found.key_id == signing.public_key_id(key)
    assert found.signed_digest == f"sha256:{DIGEST}"
    by_id = signing.verify(f"sha256:{DIGEST}", sig, found.key_id, keys, required=False)
    assert by_id == found


def test_cosign_sign_blob_signature_over_the_digest_file_verifies_as_is() -> None:
    """cosign sign-blob with a P-256 key: ECDSA over SHA-256 of the blob, ASN.1 DER, base64
    with a trailing newline as it prints; the blob is what `adapters digest -o` writes."""
    key = ec.generate_private_key(ec.SECP256R1())
    blob = signing.signed_message(DIGEST)
    assert blob == f"sha256:{DIGEST}".encode()
    der = key.sign(blob, ec.ECDSA(hashes.SHA256()))
    printed = base64.b64encode(der).decode() + "\n"
    found = signing.verify(DIGEST, printed, None, [_registered(key)], required=True)
    assert found is not None and found.key_id == signing.public_key_id(key)


def test_key_id_is_the_spki_sha256_prefix() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    der = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    info = signing.parse_public_key(_pem(key))
    assert info.key_id == hashlib.sha256(der).hexdigest()[:16]
    assert info.algorithm == "ecdsa-p256-sha256"


def test_bad_signature_is_SignatureInvalid_naming_the_key() -> None:
    key, other = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    reg = _registered(key)
    wrong = signing.sign_digest(other, DIGEST)
    with pytest.raises(AdapterRejected) as exc:
        signing.verify(DIGEST, wrong, reg.key_id, [reg], required=False)
    assert _reason(exc) == ReasonCode.SIGNATURE_INVALID
    assert reg.key_id in exc.value.message and DIGEST in exc.value.message
    # another digest's signature, no key id: every live key is named
    other_digest = signing.sign_digest(key, "cd" * 32)
    with pytest.raises(AdapterRejected) as exc:
        signing.verify(DIGEST, other_digest, None, [reg], required=False)
    assert reg.key_id in exc.value.message
    with pytest.raises(AdapterRejected, match="not base64"):
        signing.verify(DIGEST, "!!!", None, [reg], required=False)


def test_missing_signature_is_SignatureRequired_only_when_required() -> None:
    with pytest.raises(AdapterRejected) as exc:
        signing.verify(DIGEST, None, None, [], required=True, policy="tenant 'acme' requires it")
    assert _reason(exc) == ReasonCode.SIGNATURE_REQUIRED
    assert "tenant 'acme'" in exc.value.message and DIGEST in exc.value.message
    assert signing.verify(DIGEST, None, None, [], required=False) is None


def test_revoked_key_never_verifies_and_is_named() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    reg = _registered(key, revoked=True)
    sig = signing.sign_digest(key, DIGEST)
    for key_id in (None, reg.key_id):
        with pytest.raises(AdapterRejected) as exc:
            signing.verify(DIGEST, sig, key_id, [reg], required=False)
        assert _reason(exc) == ReasonCode.SIGNATURE_INVALID
        assert f"{reg.key_id}, which was revoked" in exc.value.message


def test_unknown_key_id_is_SignatureInvalid() -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    sig = signing.sign_digest(key, DIGEST)
    with pytest.raises(AdapterRejected, match="key id 0123456789abcdef is not a registered"):
        signing.verify(DIGEST, sig, "0123456789abcdef", [_registered(key)], required=False)


def test_public_key_parsing_refuses_other_kinds() -> None:
    p384 = ec.generate_private_key(ec.SECP384R1())
    with pytest.raises(signing.KeyFormatError, match="P-256 or Ed25519"):
        signing.parse_public_key(_pem(p384))
    with pytest.raises(signing.KeyFormatError, match="not a PEM public key"):
        signing.parse_public_key("hello")
    private = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(signing.KeyFormatError):
        signing.parse_public_key(private.decode())
    assert signing.load_private_key(private) is not None


def test_ingest_checks_the_digest_before_storing_and_local_digest_agrees(tmp_path: Path) -> None:
    src = write_adapter(tmp_path / "a", lora_config(r=4), lora_tensors(TINY_BASE, 4))
    store = LocalStore(tmp_path / "store")
    local = digest_of_source(src)
    assert digest_of_source(src / "adapter_model.safetensors") == local
    seen: list[str] = []

    def refuse(digest: str) -> None:
        seen.append(digest)
        raise AdapterRejected(ReasonCode.SIGNATURE_REQUIRED, "unsigned")

    with pytest.raises(AdapterRejected):
        ingest(src, "t", "a", TINY_BASE, AdapterLimits(), store, check_digest=refuse)
    assert seen == [local]
    assert store.list_keys("adapters/") == []
    stored = ingest(src, "t", "a", TINY_BASE, AdapterLimits(), store, check_digest=seen.append)
    assert stored.digest == local
