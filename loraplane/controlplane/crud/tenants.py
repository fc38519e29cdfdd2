"""Tenants and their quotas."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplane.controlplane.crud import audit
from loraplane.controlplane.errors import AlreadyExists, NotFound
from loraplane.controlplane.models import Adapter, ApiKey, Tenant, utcnow
from loraplane.controlplane.schemas.tenants import TenantCreate, TenantUpdate


def create_tenant(session: Session, *, data: TenantCreate, actor: str) -> Tenant:
    """Create a tenant; AlreadyExists if the name was ever used (deleted tenants included)."""
    if session.scalar(select(Tenant.id).where(Tenant.name == data.name)) is not None:
        raise AlreadyExists(f"tenant {data.name!r} already exists")
    fields = data.model_dump()
    fields["namespace"] = namespace = data.namespace or data.name
    # A namespace is one tenant's (the operator finds the tenant by the namespace its
    # LoRAAdapters live in).
    holder = session.scalar(
        select(Tenant.name).where(Tenant.namespace == namespace, Tenant.deleted.is_(False))
    )
    if holder is not None:
        raise AlreadyExists(f"namespace {namespace!r} already belongs to tenant {holder!r}")
    tenant = Tenant(**fields)
    session.add(tenant)
    audit.record(session, actor=actor, action="tenant.create", target=f"tenants/{data.name}")
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise AlreadyExists(f"tenant {data.name!r} already exists") from None
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    """Every live tenant, by name."""
    stmt = select(Tenant).where(Tenant.deleted.is_(False)).order_by(Tenant.name)
    return list(session.scalars(stmt))


def get_tenant(session: Session, *, name: str) -> Tenant:
    """A live tenant by name; NotFound otherwise."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name, Tenant.deleted.is_(False)))
    if tenant is None:
        raise NotFound(f"tenant {name!r} not found")
    return tenant


def get_tenant_by_namespace(session: Session, *, namespace: str) -> Tenant:
    """The live tenant whose namespace this is (where its LoRAAdapters live); NotFound
    otherwise."""
    tenant = session.scalar(
        select(Tenant).where(Tenant.namespace == namespace, Tenant.deleted.is_(False)).limit(1)
    )
    if tenant is None:
        raise NotFound(f"no tenant has namespace {namespace!r}")
    return tenant


def update_tenant(session: Session, *, name: str, data: TenantUpdate, actor: str) -> Tenant:
    """Change a tenant's quotas (the fields given)."""
    tenant = get_tenant(session, name=name)
    changes = data.model_dump(exclude_unset=True, exclude_none=True)
    for field, value in changes.items():
        setattr(tenant, field, value)
    audit.record(
        session, actor=actor, action="tenant.update", target=f"tenants/{name}", detail=changes
    )
    session.commit()
    return tenant


def delete_tenant(session: Session, *, name: str, actor: str) -> None:
    """Delete a tenant: its keys are revoked and its adapters stop serving.

    The row stays (soft delete) so its versions, usage and audit trail remain; the name is
    not reused.
    """
    tenant = get_tenant(session, name=name)
    now = utcnow()
    tenant.deleted = True
    session.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    session.execute(
        update(Adapter)
        .where(Adapter.tenant_id == tenant.id, Adapter.deleted.is_(False))
        .values(deleted=True, updated_at=now)
    )
    audit.record(session, actor=actor, action="tenant.delete", target=f"tenants/{name}")
    session.commit()
