"""Signed adapters: what is signed, key ids, and the one verification rule every service uses.

The signed message is the ASCII text `sha256:<hex>` of a version's canonical digest
(`canonical.py`; the 64 lowercase hex digits the catalog stores as `digest`), with no newline:
the bytes `loraplane adapters digest PATH -o FILE` writes, so `cosign sign-blob --key
cosign.key FILE` over that file signs exactly what is verified here. Two key kinds, as cosign
uses them:

- ECDSA P-256: an ASN.1 DER signature of ECDSA with SHA-256 over the message (cosign hashes
  the blob with SHA-256 and signs that; its default key kind);
- Ed25519: a pure Ed25519 signature of the message itself (64 bytes).

Signatures travel base64 (standard alphabet, as cosign prints them; padding optional,
surrounding whitespace ignored). A key id is the first 16 hex digits of the SHA-256 of the
public key's DER SubjectPublicKeyInfo, so the same key has the same id wherever it is
registered and anyone can compute it from the PEM file (`openssl pkey -pubin -outform DER |
sha256sum`).

Needs the `cryptography` package (the controlplane, operator and client extras carry it);
only the code paths that verify or sign import this module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from loraplane.adapters import cosign_key
from loraplane.adapters.errors import AdapterRejected, ReasonCode

KEY_ID_HEX = 16
MAX_SIGNATURE_CHARS = 512  # base64 of the largest signature accepted (P-256 DER is <= 72 bytes)
MAX_PEM_CHARS = 4096
ALGORITHMS = ("ecdsa-p256-sha256", "ed25519")
_DIGEST = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey


class KeyFormatError(ValueError):
    """A PEM that is not a usable public or private key of a supported kind."""


@dataclass(frozen=True, slots=True)
class PublicKeyInfo:
    """A parsed public key: its id, algorithm and canonical PEM (SubjectPublicKeyInfo)."""

    key_id: str
    algorithm: str
    pem: str


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A registered key as the verifier sees it (`revoked` keys never verify)."""

    key_id: str
    pem: str
    revoked: bool = False


@dataclass(frozen=True, slots=True)
class Verified:
    """A signature that verified: the key that made it and the message it signs."""

    key_id: str
    signed_digest: str  # `sha256:<hex>`, the message
    signature: str  # base64, as checked


def signed_message(digest: str) -> bytes:
    """The bytes signed for a version whose canonical digest is `digest` (bare hex or
    `sha256:<hex>`). ValueError for anything else."""
    m = _DIGEST.match(digest.strip().lower())
    if m is None:
        raise ValueError(f"not a sha256 digest: {digest[:80]!r}")
    return f"sha256:{m.group(1)}".encode("ascii")


def _algorithm(key: PublicKey) -> str:
    if isinstance(key, ed25519.Ed25519PublicKey):
        return "ed25519"
    if isinstance(key.curve, ec.SECP256R1):
        return "ecdsa-p256-sha256"
    raise KeyFormatError(f"EC curve {key.curve.name} is not supported: use P-256 or Ed25519")


def key_id_of(key: PublicKey) -> str:
    """The key's id: the first 16 hex digits of sha256(DER SubjectPublicKeyInfo)."""
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()[:KEY_ID_HEX]


def parse_public_key(pem: str) -> PublicKeyInfo:
    """A PEM public key (`-----BEGIN PUBLIC KEY-----`, as cosign and openssl write it), P-256
    or Ed25519. KeyFormatError naming what is wrong otherwise."""
    if len(pem) > MAX_PEM_CHARS:
        raise KeyFormatError(f"public_key is {len(pem)} characters, over {MAX_PEM_CHARS}")
    try:
        key = serialization.load_pem_public_key(pem.strip().encode("ascii"))
    except (ValueError, UnicodeEncodeError, UnsupportedAlgorithm):
        raise KeyFormatError(
            "public_key is not a PEM public key (-----BEGIN PUBLIC KEY-----; a private key or "
            "a certificate is refused)"
        ) from None
    if not isinstance(key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey):
        raise KeyFormatError(f"{type(key).__name__} keys are not supported: use P-256 or Ed25519")
    algorithm = _algorithm(key)
    canonical = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")
    return PublicKeyInfo(key_id_of(key), algorithm, canonical)


def load_private_key(data: bytes, password: bytes | None = None) -> PrivateKey:
    """A PEM private key (PKCS#8 or SEC1, encrypted with `password` or not) or cosign's
    encrypted `cosign.key` (`cosign_key.py`, opened with `password`). KeyFormatError otherwise."""
    try:
        if cosign_key.is_cosign_key(data):
            der = cosign_key.private_key_der(data, password)
            key = serialization.load_der_private_key(der, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=password)
    except TypeError as exc:  # encrypted without a password, or a password for a plain key
        raise KeyFormatError(f"the key file: {exc}") from None
    except cosign_key.CosignKeyError as exc:
        raise KeyFormatError(f"the cosign key file: {exc}") from None
    except (ValueError, UnsupportedAlgorithm):
        raise KeyFormatError(
            "the key file is not a PEM private key (PKCS#8 or SEC1, as openssl writes them) "
            "nor cosign's encrypted cosign.key"
        ) from None
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise KeyFormatError(f"{type(key).__name__} keys are not supported: use P-256 or Ed25519")


def sign_digest(key: PrivateKey, digest: str) -> str:
    """The base64 signature of `digest`'s message, as `cosign sign-blob` would make it."""
    message = signed_message(digest)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        raw = key.sign(message)
    else:
        raw = key.sign(message, ec.ECDSA(hashes.SHA256()))
    return base64.b64encode(raw).decode("ascii")


def public_key_id(key: PrivateKey) -> str:
    """The id the control plane gives the public half of `key`."""
    return key_id_of(key.public_key())


def decode_signature(signature: str) -> bytes:
    """The raw bytes of a base64 signature; SignatureInvalid when it is not base64."""
    text = "".join(signature.split())
    if not text or len(text) > MAX_SIGNATURE_CHARS:
        raise AdapterRejected(
            ReasonCode.SIGNATURE_INVALID,
            f"the signature is {len(text)} characters: expected base64 of at most "
            f"{MAX_SIGNATURE_CHARS}",
        )
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise AdapterRejected(
            ReasonCode.SIGNATURE_INVALID, "the signature is not base64 (as cosign prints it)"
        ) from None


def check_key_id(key_id: str) -> str:
    """`key_id` if it has the form of a key id (16 lowercase hex digits); ValueError else."""
    if not _KEY_ID.match(key_id):
        raise ValueError(f"a key id is 16 lowercase hex digits (got {key_id[:40]!r})")
    return key_id


def _verifies(pem: str, raw: bytes, message: bytes) -> bool:
    key = serialization.load_pem_public_key(pem.encode("ascii"))
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(raw, message)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(raw, message, ec.ECDSA(hashes.SHA256()))
        else:
            return False
    except InvalidSignature:
        return False
    return True


def verify(
    digest: str,
    signature: str | None,
    key_id: str | None,
    keys: Iterable[SigningKey],
    *,
    required: bool,
    policy: str = "signatures are required",
) -> Verified | None:
    """The one rule: a signature given is always checked; none given is fine unless `required`.

    With `key_id`, only that key is tried; without, every live key. A revoked key never
    verifies (the refusal names it when the signature was its). Raises AdapterRejected
    `SignatureRequired` (naming `policy`) or `SignatureInvalid` (naming the key id(s) and the
    digest signed); None when unsigned and not required.
    """
    message = signed_message(digest)
    text = message.decode("ascii")
    if not signature:
        if key_id:
            raise AdapterRejected(
                ReasonCode.SIGNATURE_INVALID, f"key id {key_id} was given without a signature"
            )
        if required:
            raise AdapterRejected(
                ReasonCode.SIGNATURE_REQUIRED,
                f"{policy}: sign {text} with a registered key (`loraplane adapters sign`) and "
                "send the signature with the adapter",
            )
        return None
    raw = decode_signature(signature)
    known = list(keys)
    if key_id:
        known = [k for k in known if k.key_id == key_id]
        if not known:
            raise AdapterRejected(
                ReasonCode.SIGNATURE_INVALID,
                f"key id {key_id} is not a registered signing key of this tenant",
            )
    for key in known:
        if _verifies(key.pem, raw, message):
            if key.revoked:
                raise AdapterRejected(
                    ReasonCode.SIGNATURE_INVALID,
                    f"the signature is by key id {key.key_id}, which was revoked",
                )
            return Verified(key.key_id, text, base64.b64encode(raw).decode("ascii"))
    if key_id:
        raise AdapterRejected(
            ReasonCode.SIGNATURE_INVALID,
            f"the signature does not verify with key id {key_id} over {text}",
        )
    live = [k.key_id for k in known if not k.revoked]
    ids = ", ".join(live) if live else "none registered"
    raise AdapterRejected(
        ReasonCode.SIGNATURE_INVALID,
        f"the signature verifies with no live signing key of this tenant (key ids: {ids}) "
        f"over {text}",
    )
