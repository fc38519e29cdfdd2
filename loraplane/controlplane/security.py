"""API keys and tokens: generation, hashing, constant-time comparison.

A tenant key is `lp_` + 43 URL-safe characters (256 bits). The catalog keeps its SHA-256 hash
and its first characters as a lookup prefix; the key itself is shown once, at creation.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_MARKER = "lp_"
PREFIX_LEN = 12  # "lp_" + 9 characters: 54 bits, enough to find one row by index
KEY_LEN = len(KEY_MARKER) + 43


@dataclass(frozen=True, slots=True)
class NewKey:
    """A freshly generated key: the secret (shown once), its lookup prefix and hash."""

    secret: str
    prefix: str
    key_hash: str


def hash_key(secret: str) -> str:
    """The hex SHA-256 of a key (keys are random: no salt or slow hash needed)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def generate_key() -> NewKey:
    """A new tenant API key."""
    secret = KEY_MARKER + secrets.token_urlsafe(32)
    return NewKey(secret=secret, prefix=secret[:PREFIX_LEN], key_hash=hash_key(secret))


def key_prefix(secret: str) -> str | None:
    """The lookup prefix of something that looks like a tenant key, else None."""
    if not secret.startswith(KEY_MARKER) or len(secret) != KEY_LEN:
        return None
    return secret[:PREFIX_LEN]


def key_matches(secret: str, key_hash: str) -> bool:
    """Whether `secret` hashes to `key_hash`, compared in constant time."""
    return hmac.compare_digest(hash_key(secret), key_hash)


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison of a bearer token against a configured token."""
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
