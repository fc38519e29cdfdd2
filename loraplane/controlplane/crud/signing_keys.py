"""A tenant's signing keys (public keys only): registered, listed, revoked; and the signature
policy an adapter of a tenant and base model must meet (docs/security.md, "Signed adapters")."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplane.adapters import signing
from loraplane.controlplane.crud import audit
from loraplane.controlplane.crud.pools import pool_ref, pools_for_base_model
from loraplane.controlplane.errors import AlreadyExists, InvalidRequest, NotFound
from loraplane.controlplane.models import SigningKey, Tenant, utcnow


@dataclass(frozen=True, slots=True)
class Policy:
    """Whether an adapter must be signed, why (for the refusal), and the keys that count."""

    required: bool
    reason: str
    keys: tuple[signing.SigningKey, ...]


def register_key(
    session: Session, *, tenant: Tenant, public_key: str, name: str, actor: str
) -> tuple[SigningKey, bool]:
    """Register a PEM public key: (row, whether it is new). The same live key again answers
    its row; a revoked key cannot come back (AlreadyExists): what it signed stays refused."""
    try:
        info = signing.parse_public_key(public_key)
    except signing.KeyFormatError as exc:
        raise InvalidRequest(f"public_key: {exc}") from None
    target = f"tenants/{tenant.name}/signing-keys/{info.key_id}"
    existing = _find(session, tenant=tenant, key_id=info.key_id)
    if existing is not None:
        if existing.revoked_at is not None:
            raise AlreadyExists(
                f"signing key {info.key_id} was revoked; a revoked key cannot be registered "
                "again (make a new key pair)"
            )
        return existing, False
    row = SigningKey(
        tenant_id=tenant.id,
        key_id=info.key_id,
        algorithm=info.algorithm,
        public_key=info.pem,
        name=name,
    )
    session.add(row)
    audit.record(
        session,
        actor=actor,
        action="signing_key.create",
        target=target,
        detail={"algorithm": info.algorithm, "name": name},
    )
    try:
        session.commit()
    except IntegrityError:  # registered concurrently
        session.rollback()
        found = _find(session, tenant=tenant, key_id=info.key_id)
        if found is None:
            raise
        return found, False
    return row, True


def list_keys(session: Session, *, tenant: Tenant) -> list[SigningKey]:
    """A tenant's signing keys, revoked ones included, oldest first."""
    stmt = select(SigningKey).where(SigningKey.tenant_id == tenant.id).order_by(SigningKey.id)
    return list(session.scalars(stmt))


def revoke_key(session: Session, *, tenant: Tenant, key_id: str, actor: str) -> SigningKey:
    """Revoke a signing key (idempotent): signatures by it are refused from now on. NotFound
    if the tenant has no such key."""
    key = _find(session, tenant=tenant, key_id=key_id)
    if key is None:
        raise NotFound(f"signing key {key_id!r} not found")
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        audit.record(
            session,
            actor=actor,
            action="signing_key.revoke",
            target=f"tenants/{tenant.name}/signing-keys/{key_id}",
        )
        session.commit()
    return key


def policy_for(session: Session, *, tenant: Tenant, base_model: str) -> Policy:
    """What an adapter of `tenant` for `base_model` must carry: a signature when the tenant
    requires one or any pool serving the base model does; the tenant's keys (revoked ones
    too, so a refusal can name them)."""
    reasons = []
    if tenant.require_signature:
        reasons.append(f"tenant {tenant.name!r} requires signed adapters (require_signature)")
    strict = [p for p in pools_for_base_model(session, base_model=base_model)
              if p.require_signed_adapters]  # fmt: skip
    if strict:
        refs = ", ".join(pool_ref(p.namespace, p.name) for p in strict)
        reasons.append(f"pool {refs} requires signed adapters (require_signed_adapters)")
    keys = tuple(
        signing.SigningKey(k.key_id, k.public_key, k.revoked_at is not None)
        for k in list_keys(session, tenant=tenant)
    )
    return Policy(bool(reasons), "; ".join(reasons), keys)


def _find(session: Session, *, tenant: Tenant, key_id: str) -> SigningKey | None:
    return session.scalar(
        select(SigningKey).where(SigningKey.tenant_id == tenant.id, SigningKey.key_id == key_id)
    )
