"""Tenants, their quotas, and their API keys."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from loraplane.controlplane.models import DEFAULT_WEIGHT
from loraplane.controlplane.schemas.common import (
    AdapterCount,
    Bytes,
    PerMinute,
    PinnedBytes,
    Public,
    RankQuota,
    Strict,
    TenantName,
    Weight,
)


class TenantCreate(Strict):
    """A new tenant; the namespace defaults to its name (the tenant is the namespace).

    Quotas: `requests_per_minute` and `tokens_per_minute` take 0 for unlimited;
    `max_adapters`, `max_rank` and `max_bytes` (each adapter's weights) are at least 1.
    `require_signature`: every upload must be signed by one of the tenant's signing keys.
    `signing_keys_by_admin`: only the admin registers the tenant's signing keys.
    `max_pinned_bytes`: adapter memory its pins may take (size x replicas; 0: admin pins only).
    """

    name: TenantName
    namespace: TenantName | None = None
    max_adapters: AdapterCount = 100
    max_rank: RankQuota = 64
    max_bytes: Bytes = 1 << 30
    requests_per_minute: PerMinute = 600
    tokens_per_minute: PerMinute = 1_000_000
    weight: Weight = DEFAULT_WEIGHT
    require_signature: bool = False
    signing_keys_by_admin: bool = False
    max_pinned_bytes: PinnedBytes = 0


class TenantUpdate(Strict):
    """New quotas; fields left out keep their value."""

    max_adapters: AdapterCount | None = None
    max_rank: RankQuota | None = None
    max_bytes: Bytes | None = None
    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    weight: Weight | None = None
    require_signature: bool | None = None
    signing_keys_by_admin: bool | None = None
    max_pinned_bytes: PinnedBytes | None = None


class TenantPublic(Public):
    """A tenant and its quotas (`max_bytes` caps each adapter's weights).

    `weight` is the tenant's share of a contended replica's seats and served tokens, relative
    to the other tenants' weights.
    """

    name: str
    namespace: str
    max_adapters: int
    max_rank: int
    max_bytes: int
    requests_per_minute: int
    tokens_per_minute: int
    weight: float
    require_signature: bool = Field(
        description="every upload of this tenant must carry a valid signature by one of its "
        "signing keys (else 422 SignatureRequired)"
    )
    signing_keys_by_admin: bool = Field(
        description="only the admin registers this tenant's signing keys (the tenant's own "
        "POST /v1/signing-keys answers 403 SigningKeysByAdmin); the tenant still lists and "
        "revokes them"
    )
    max_pinned_bytes: int = Field(
        description="adapter memory the tenant may pin: each pin costs its version's size times"
        " its replicas (0: only the admin pins for this tenant)"
    )
    created_at: datetime
    updated_at: datetime


class KeyCreate(Strict):
    """A new API key; `name` is a label for people."""

    name: str = Field(default="", max_length=100)


class KeyPublic(Public):
    """A key as listed: its id, label and prefix, never the key or its hash."""

    id: int
    name: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class KeyCreated(KeyPublic):
    """The answer to creating a key: the only time the key itself is shown."""

    key: str


class SigningKeyCreate(Strict):
    """A public key the tenant signs adapters with: PEM SubjectPublicKeyInfo (`-----BEGIN
    PUBLIC KEY-----`, as `cosign generate-key-pair` and `openssl pkey -pubout` write it),
    ECDSA P-256 or Ed25519; `name` is a label for people."""

    public_key: str = Field(min_length=1, max_length=4096)
    name: str = Field(default="", max_length=100)


class SigningKeyPublic(Public):
    """A registered signing key: `key_id` is the first 16 hex digits of the SHA-256 of its DER
    SubjectPublicKeyInfo; a revoked key verifies nothing from then on."""

    key_id: str
    algorithm: str
    name: str
    public_key: str
    created_at: datetime
    revoked_at: datetime | None
