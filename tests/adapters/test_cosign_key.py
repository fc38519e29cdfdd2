"""cosign's encrypted `cosign.key` opened for `loraplane adapters sign`: go-securesystemslib's
own test vectors (the format cosign writes) decrypt to their plaintext; a wrong password, a
damaged file or parameters outside the format's three are refused with the reason; a P-256
key in cosign's PEM block signs what `signing.verify` accepts."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from loraplane.adapters import cosign_key, signing

# go-securesystemslib encrypted/encrypted_test.go: passphrase "supersecret", plaintext
# "reallyimportant"; its KDF vectors were written by Marshal (the plaintext JSON-encoded).
PASSPHRASE = b"supersecret"
DECRYPT_VECTOR = (
    b'{"kdf":{"name":"scrypt","params":{"N":32768,"r":8,"p":1},"salt":"N9a7x5JFGbrtB2uBR81jPwp0eiLR'
    b'4A7FV3mjVAQrg1g="},"cipher":{"name":"nacl/secretbox","nonce":"2h8HxMmgRfuYdpswZBQaU3xJ1nkA/5I'
    b'k"},"ciphertext":"SEW6sUh0jf2wfdjJGPNS9+bkk2uB+Cxamf32zR8XkQ=="}'
)
KDF_VECTORS = {
    32768: ("WO3mVvyTwJ9vwT5/Tk5OW5WPIBUofMjcpEfrLnfY4uA=", "tCy7HcTFr4uxv4Nrg/DWmncuZ148U1MX",
            "08n43p5G5yviPEZpO7tPPF4aZQkWiWjkv4taFdhDBA0tamKH4nw="),
    65536: ("FhzPOt9/bJG4PTq6lQ6ecG6GzaOuOy/ynG5+yRiFlNs=", "aw1ng1jHaDz/tQ7V2gR9O2+IGQ8xJEuE",
            "HycvuLZL4sYH0BrYTh4E/H20VtAW6u5zL5Pr+IBjYLYnCPzDkq8="),
    131072: ("m38E3kouJTtiheLQN22NQ8DTito5hrjpUIskqcd375k=", "Y6PM13yA+o44pE/W1ZBwczeGnTV/m9Zc",
             "6H8sqj1K6B6yDjtH5AQ6lbFigg/C2yDDJc4rYJ79w9aVPImFIPI="),
}  # fmt: skip


def _document(n: int, salt: str, nonce: str, ciphertext: str, r: int = 8, p: int = 1) -> bytes:
    return json.dumps({
        "kdf": {"name": "scrypt", "params": {"N": n, "r": r, "p": p}, "salt": salt},
        "cipher": {"name": "nacl/secretbox", "nonce": nonce},
        "ciphertext": ciphertext,
    }).encode()  # fmt: skip


def test_the_reference_implementations_vectors_decrypt() -> None:
    assert cosign_key.decrypt(DECRYPT_VECTOR, PASSPHRASE) == b"reallyimportant"
    for n, (salt, nonce, ciphertext) in KDF_VECTORS.items():
        plain = cosign_key.decrypt(_document(n, salt, nonce, ciphertext), PASSPHRASE)
        assert json.loads(plain) == base64.b64encode(b"reallyimportant").decode()


def test_a_wrong_password_or_a_damaged_file_is_refused() -> None:
    with pytest.raises(cosign_key.CosignKeyError, match="wrong password"):
        cosign_key.decrypt(DECRYPT_VECTOR, b"Supersecret")
    fields = json.loads(DECRYPT_VECTOR)
    box = bytearray(base64.b64decode(fields["ciphertext"]))
    box[-1] ^= 1
    fields["ciphertext"] = base64.b64encode(bytes(box)).decode()
    with pytest.raises(cosign_key.CosignKeyError, match="damaged"):
        cosign_key.decrypt(json.dumps(fields).encode(), PASSPHRASE)


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        # go-securesystemslib's TestUnsupportedKDFParameters: refused before any scrypt work
        (_document(99, "cZFcQJdwPhPyhU1R4qkl0qVOIjZd4V/7LYYAavq166k=",
                   "7vhRS7j0hEPBWV05skAdgLj81AkGeE7U",
                   "6WYU/YSXVbYzl/NzaeAzmjLyfFhOOjLc0d8/GFV0aBFdJvyCcXc=", r=99, p=99),
         "unsupported scrypt parameters"),
        (_document(1 << 24, "AA==", "AA==", "AA=="), "unsupported scrypt parameters"),
        (_document(32768, "AA==", "AAAA", "AA=="), "nonce is 3 bytes, not 24"),
        (_document(32768, "AA==", "not base64!", "AA=="), "nonce is not base64"),
        (b"not json", "not cosign's encrypted-key JSON"),
        (b'{"kdf": {"name": "argon2", "params": {"N": 1, "r": 1, "p": 1}}, "cipher": '
         b'{"name": "nacl/secretbox"}}', "unsupported key derivation"),
    ],
    ids=["go-vector", "huge-N", "short-nonce", "bad-base64", "not-json", "other-kdf"],
)  # fmt: skip
def test_malformed_documents_are_refused_with_the_reason(document: bytes, reason: str) -> None:
    with pytest.raises(cosign_key.CosignKeyError, match=reason):
        cosign_key.decrypt(document, PASSPHRASE)


def cosign_key_file(key: signing.PrivateKey, password: bytes, pem_type: str) -> bytes:
    """`key` as cosign writes it: PKCS#8 DER sealed in the encrypted JSON, in a PEM block."""
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    body = base64.b64encode(cosign_key.encrypt(der, password, b"s" * 32, b"n" * 24)).decode()
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return "\n".join(
        [f"-----BEGIN {pem_type}-----", *lines, f"-----END {pem_type}-----", ""]
    ).encode()


@pytest.mark.parametrize("pem_type", cosign_key.PEM_TYPES)
@pytest.mark.parametrize("kind", ["p256", "ed25519"])
def test_a_cosign_key_file_signs_what_verify_accepts(pem_type: str, kind: str) -> None:
    key = (
        ec.generate_private_key(ec.SECP256R1())
        if kind == "p256"
        else ed25519.Ed25519PrivateKey.generate()
    )
    data = cosign_key_file(key, b"pw", pem_type)
    assert cosign_key.is_cosign_key(data)
    loaded = signing.load_private_key(data, b"pw")
    digest = "ab" * 32
    signature = signing.sign_digest(loaded, digest)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    info = signing.parse_public_key(public.decode())
    assert signing.public_key_id(loaded) == info.key_id
    assert signing._verifies(info.pem, base64.b64decode(signature), signing.signed_message(digest))
    with pytest.raises(signing.KeyFormatError, match="wrong password"):
        signing.load_private_key(data, b"other")
    with pytest.raises(signing.KeyFormatError, match="COSIGN_PASSWORD"):
        signing.load_private_key(data, None)
