"""Admin routes: tenants, their quotas and their API keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status

from loraplane.controlplane.api.deps import AdminDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.crud import keys as crud_keys
from loraplane.controlplane.crud import tenants as crud
from loraplane.controlplane.schemas.common import INT32
from loraplane.controlplane.schemas.tenants import (
    KeyCreate,
    KeyCreated,
    KeyPublic,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)

router = APIRouter(prefix="/v1/tenants", tags=["admin: tenants"], responses=errors(400, 401))


@router.post(
    "", response_model=TenantPublic, status_code=status.HTTP_201_CREATED, responses=errors(409)
)
def create_tenant(body: TenantCreate, session: SessionDep, actor: AdminDep) -> TenantPublic:
    """Create a tenant with its quotas."""
    tenant = crud.create_tenant(session, data=body, actor=actor)
    return TenantPublic.model_validate(tenant)


@router.get("", response_model=list[TenantPublic])
def list_tenants(session: SessionDep, _: AdminDep) -> list[TenantPublic]:
    """Every tenant."""
    return [TenantPublic.model_validate(t) for t in crud.list_tenants(session)]


@router.get("/{tenant}", response_model=TenantPublic, responses=errors(404))
def get_tenant(tenant: str, session: SessionDep, _: AdminDep) -> TenantPublic:
    """One tenant and its quotas."""
    return TenantPublic.model_validate(crud.get_tenant(session, name=tenant))


@router.patch("/{tenant}", response_model=TenantPublic, responses=errors(404))
def update_tenant(
    tenant: str, body: TenantUpdate, session: SessionDep, actor: AdminDep
) -> TenantPublic:
    """Change a tenant's quotas."""
    row = crud.update_tenant(session, name=tenant, data=body, actor=actor)
    return TenantPublic.model_validate(row)


@router.delete("/{tenant}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404))
def delete_tenant(tenant: str, session: SessionDep, actor: AdminDep) -> None:
    """Delete a tenant: its keys are revoked and its adapters stop serving."""
    crud.delete_tenant(session, name=tenant, actor=actor)


@router.post(
    "/{tenant}/keys",
    response_model=KeyCreated,
    status_code=status.HTTP_201_CREATED,
    responses=errors(404),
)
def create_key(tenant: str, body: KeyCreate, session: SessionDep, actor: AdminDep) -> KeyCreated:
    """Create an API key; the key is in this answer and never shown again."""
    row, secret = crud_keys.create_key(session, tenant=tenant, name=body.name, actor=actor)
    return KeyCreated.model_validate({**KeyPublic.model_validate(row).model_dump(), "key": secret})


@router.get("/{tenant}/keys", response_model=list[KeyPublic], responses=errors(404))
def list_keys(tenant: str, session: SessionDep, _: AdminDep) -> list[KeyPublic]:
    """A tenant's keys (prefixes and dates; never the keys)."""
    return [KeyPublic.model_validate(k) for k in crud_keys.list_keys(session, tenant=tenant)]


@router.delete(
    "/{tenant}/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404)
)
def revoke_key(
    tenant: str,
    key_id: Annotated[int, Path(ge=1, le=INT32)],
    session: SessionDep,
    actor: AdminDep,
) -> None:
    """Revoke a key: it stops working at once."""
    crud_keys.revoke_key(session, tenant=tenant, key_id=key_id, actor=actor)
