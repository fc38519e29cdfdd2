"""API keys and tokens: generation, hashing, constant-time comparison.

A tenant key is `lp_` + 43 URL-safe characters (256 bits). The catalog keeps its SHA-256 hash
and its first characters as a lookup prefix; the key itself is shown once, at creation.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from loraplane.redact import KEY_LEN as KEY_LEN
from loraplane.redact import KEY_MARKER as KEY_MARKER
from loraplane.redact import key_problem

PREFIX_LEN = 12  # "lp_" + 9 characters: 54 bits, enough to find one row by index


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
    if key_problem(secret) is not None:
        return None
    return secret[:PREFIX_LEN]


def not_a_key(token: str, admin_token: str) -> str:
    """Why a credential that is not a tenant key's form is refused on a tenant route, naming
    what is wrong and never echoing it: the admin token, a mistyped key, something else."""
    if token_matches(token, admin_token):
        return "this route needs a tenant API key, not the admin token"
    problem = key_problem(token)
    if token[:3].lower() in ("lp_", "lp-") and problem is not None:
        return f"malformed API key: {problem}"
    return f"this route needs a tenant API key ({KEY_MARKER}... as `keys create` prints it)"


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
