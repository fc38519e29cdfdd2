"""The catalog's tables, as SQLAlchemy 2 typed models.

Versions are immutable rows (nothing updates them); tenants and adapters are soft-deleted so
their history (versions, audit, usage) stays whole. Times are timezone-aware UTC everywhere,
SQLite included (`UTCDateTime`).
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    TypeDecorator,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
NAME_LEN = 63  # a DNS label: tenants are Kubernetes namespaces
DEFAULT_NAMESPACE = "default"  # of a pool registered without one (and of pools before 0003)
DEFAULT_WEIGHT = 1.0  # a tenant's scheduling weight unless the admin sets one


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back timezone-aware (SQLite drops zones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime: the catalog stores aware UTC times only")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base with a constraint naming convention (stable migration names)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        date: Date(),
        dict[str, Any]: JSON(),
    }


class Tenant(Base):
    """A tenant (a Kubernetes namespace in a cluster) and its quotas."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    namespace: Mapped[str] = mapped_column(String(NAME_LEN))
    max_adapters: Mapped[int] = mapped_column(Integer)
    max_rank: Mapped[int] = mapped_column(Integer)
    max_bytes: Mapped[int] = mapped_column(BigInteger)
    requests_per_minute: Mapped[int] = mapped_column(Integer)
    tokens_per_minute: Mapped[int] = mapped_column(BigInteger)
    # The tenant's share of a contended replica's seats and served tokens, relative to the
    # other tenants' weights (rows from before 0004 have 1: every tenant alike).
    weight: Mapped[float] = mapped_column(Float, default=DEFAULT_WEIGHT, server_default="1")
    # Every adapter version must carry a valid signature by one of the tenant's signing keys
    # (the admin sets it, as a quota; docs/security.md, "Signed adapters").
    require_signature: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Only the admin registers the tenant's signing keys (rows before 0009: the tenant may);
    # the tenant still lists and revokes its own. A stolen tenant API key then cannot add a
    # key of its own to sign with.
    signing_keys_by_admin: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Bytes of pinned adapter memory the tenant may ask for: each pin costs its version's
    # size times its replicas (0, the default and rows before 0008: pins only by the admin).
    max_pinned_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    deleted: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class SigningKey(Base):
    """A tenant's public key for adapter signatures (loraplane/adapters/signing.py).

    `key_id` is the first 16 hex digits of the SHA-256 of the key's DER SubjectPublicKeyInfo.
    A revoked key stays (the versions it signed name it) and can never be registered again.
    """

    __tablename__ = "signing_keys"
    __table_args__ = (UniqueConstraint("tenant_id", "key_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    key_id: Mapped[str] = mapped_column(String(16))
    algorithm: Mapped[str] = mapped_column(String(32))
    public_key: Mapped[str] = mapped_column(String(4096))  # PEM SubjectPublicKeyInfo
    name: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class ApiKey(Base):
    """A tenant API key: only its SHA-256 hash and a lookup prefix are kept."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(100), default="")
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]

    tenant: Mapped[Tenant] = relationship(lazy="joined", innerjoin=True)


class Adapter(Base):
    """A tenant's named adapter; `current_version` is what an unpinned name resolves to.

    `follow_latest`: a new version becomes current when it is pushed (the default). Serving a
    chosen version clears it, so later pushes leave that version serving until the tenant
    follows the latest again.

    `rollout`: a weighted split of the unpinned name's traffic across versions, `{"3": 90,
    "4": 10}` (version number as text -> integer weight, the weights summing to 100), or None:
    everything to `current_version`, which stays the version a rollback returns to
    (crud/rollouts.py; docs/controlplane.md, "Weighted rollouts").
    """

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    base_model: Mapped[str] = mapped_column(String(200))
    current_version: Mapped[int | None]
    follow_latest: Mapped[bool] = mapped_column(default=True, server_default=true())
    rollout: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    deleted: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class AdapterVersion(Base):
    """One immutable stored version of an adapter (its number comes from the store)."""

    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("adapter_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id"))
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(String(512))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    base_model: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(200), default="")
    # a signed version: the key that signed it, the message verified (`sha256:<hex>` of
    # `digest`) and the signature (base64); None for an unsigned one (and rows before 0006)
    signing_key_id: Mapped[str | None] = mapped_column(String(16))
    signed_digest: Mapped[str | None] = mapped_column(String(71))
    signature: Mapped[str | None] = mapped_column(String(512))


class AuditEvent(Base):
    """Who did what to which resource, and how it ended."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    time: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(100))
    target: Mapped[str] = mapped_column(String(300))
    outcome: Mapped[str] = mapped_column(String(100))
    detail: Mapped[dict[str, Any] | None]


class Usage(Base):
    """Requests and tokens per tenant, adapter ("" for the base model) and UTC day."""

    __tablename__ = "usage"
    __table_args__ = (UniqueConstraint("tenant_id", "adapter", "day"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    adapter: Mapped[str] = mapped_column(String(NAME_LEN))
    day: Mapped[date]
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class Pool(Base):
    """A serving pool: one base model, its LoRA limits and the latest reported pressure.

    A pool is the mirror of a ServingPool, so (namespace, name) names it: two ServingPools
    named alike in two namespaces are two pools, each with its own pressure.
    """

    __tablename__ = "pools"
    __table_args__ = (UniqueConstraint("namespace", "name"), Index(None, "base_model_name"))

    id: Mapped[int] = mapped_column(primary_key=True)
    namespace: Mapped[str] = mapped_column(
        String(NAME_LEN), default=DEFAULT_NAMESPACE, server_default=DEFAULT_NAMESPACE
    )
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    base_model_name: Mapped[str] = mapped_column(String(200))
    base_model_uri: Mapped[str] = mapped_column(String(1024))
    # The base model's config.json: uploads are validated against it without reading the model
    # again. Read from the uri when the pool is registered, or, for a model only on the pods'
    # volume, taken from the first pressure report that carries it (None until then: pending).
    base_model_config: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    max_lora_rank: Mapped[int] = mapped_column(Integer)
    max_loras: Mapped[int] = mapped_column(Integer)
    max_cpu_loras: Mapped[int] = mapped_column(Integer)
    # host bytes a replica's host tier may take (--max-cpu-lora-bytes); None: no byte limit
    max_cpu_lora_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # uploads for this pool's base model must be signed, whatever their tenant's policy
    require_signed_adapters: Mapped[bool] = mapped_column(default=False, server_default=false())
    pressure: Mapped[dict[str, Any] | None]
    pressure_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    @property
    def base_model(self) -> dict[str, str]:
        """The base model as the API shows it: its name and config location."""
        return {"name": self.base_model_name, "uri": self.base_model_uri}

    # loaded only when read (the pool's view for the operator), never with each report
    pins: Mapped[list[AdapterPin]] = relationship(viewonly=True, lazy="select")

    @property
    def pinned_replicas(self) -> int:
        """The most replicas one pin of this pool asks for (0: none pinned): the operator
        keeps at least that many (docs/controlplane.md, "Pinned adapters")."""
        return max((p.replicas for p in self.pins), default=0)


class UploadJob(Base):
    """An upload ingested in the background (embedded mode, big files or `Prefer:
    respond-async`): what the tenant polls at `/v1/uploads/{id}` until it has an outcome."""

    __tablename__ = "upload_jobs"
    __table_args__ = (Index(None, "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # random hex, not guessable
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    adapter: Mapped[str] = mapped_column(String(NAME_LEN))
    base_model: Mapped[str] = mapped_column(String(200))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # pending -> running -> succeeded | failed
    status: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(200))
    version: Mapped[int | None]
    created: Mapped[bool | None]  # a new version (True) or identical to an existing one
    error_code: Mapped[str | None] = mapped_column(String(100))
    error_message: Mapped[str | None] = mapped_column(String(1000))
    # the upload's files beside the adapter (a Trainer checkpoint's artefacts), never opened:
    # the job's answer lists them as the synchronous upload's does (None before 0005)
    ignored: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class AdapterPin(Base):
    """An adapter version kept resident on `replicas` replicas of a pool (docs/dataplane.md,
    "Pinned adapters"): the control plane assigns the copies to the pool's live replicas in
    its pressure answers; a replica keeps the versions assigned to it on the device."""

    __tablename__ = "adapter_pins"
    __table_args__ = (UniqueConstraint("version_id", "pool_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("adapter_versions.id"))
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id"), index=True)
    replicas: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(200), default="")

    version: Mapped[AdapterVersion] = relationship(lazy="joined", innerjoin=True)
    pool: Mapped[Pool] = relationship(lazy="joined", innerjoin=True)
