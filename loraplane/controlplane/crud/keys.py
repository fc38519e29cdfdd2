"""Tenant API keys: created once (the secret is returned, never stored), listed, revoked,
and checked on every tenant request."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplane.controlplane import security
from loraplane.controlplane.crud import audit
from loraplane.controlplane.crud.tenants import get_tenant
from loraplane.controlplane.errors import NotFound, Unauthorized
from loraplane.controlplane.models import ApiKey, Tenant, utcnow

# last_used_at is a hint for people, not an audit record: write it at most this often.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def create_key(session: Session, *, tenant: str, name: str, actor: str) -> tuple[ApiKey, str]:
    """A new key for `tenant`: the row and the secret (shown once, never stored)."""
    owner = get_tenant(session, name=tenant)
    for _ in range(5):
        new = security.generate_key()
        row = ApiKey(tenant_id=owner.id, name=name, prefix=new.prefix, key_hash=new.key_hash)
        session.add(row)
        audit.record(
            session,
            actor=actor,
            action="key.create",
            target=f"tenants/{tenant}/keys/{new.prefix}",
        )
        try:
            session.commit()
        except IntegrityError:  # a prefix collision: astronomically rare, try again
            session.rollback()
            continue
        return row, new.secret
    raise RuntimeError("could not generate a unique key prefix")


def list_keys(session: Session, *, tenant: str) -> list[ApiKey]:
    """A tenant's keys, revoked ones included, oldest first."""
    owner = get_tenant(session, name=tenant)
    stmt = select(ApiKey).where(ApiKey.tenant_id == owner.id).order_by(ApiKey.id)
    return list(session.scalars(stmt))


def revoke_key(session: Session, *, tenant: str, key_id: int, actor: str) -> ApiKey:
    """Revoke a key (idempotent); NotFound if the tenant has no such key."""
    owner = get_tenant(session, name=tenant)
    key = session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == owner.id))
    if key is None:
        raise NotFound(f"key {key_id} not found for tenant {tenant!r}")
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        audit.record(
            session, actor=actor, action="key.revoke", target=f"tenants/{tenant}/keys/{key.prefix}"
        )
        session.commit()
    return key


def authenticate(session: Session, *, secret: str) -> ApiKey:
    """The live key that `secret` is, with its tenant loaded; Unauthorized otherwise.

    One indexed lookup by prefix, then a constant-time hash comparison.
    """
    prefix = security.key_prefix(secret)
    key = None
    if prefix is not None:
        key = session.scalar(
            select(ApiKey).join(Tenant).where(ApiKey.prefix == prefix, Tenant.deleted.is_(False))
        )
    return verify(session, key=key, secret=secret)


def verify(session: Session, *, key: ApiKey | None, secret: str) -> ApiKey:
    """`key` if `secret` is it and it is live (tenant not deleted, not revoked).

    Hashes even when no row matched, so timing does not tell which prefixes exist. Records
    the use (at most once a minute per key). Unauthorized otherwise.
    """
    stored = key.key_hash if key is not None else "0" * 64
    if not security.key_matches(secret, stored) or key is None or key.revoked_at is not None:
        raise Unauthorized("invalid or revoked API key")
    if key.tenant.deleted:
        raise Unauthorized("invalid or revoked API key")
    now = utcnow()
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        session.execute(update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=now))
        session.commit()
        key.last_used_at = now
    return key
