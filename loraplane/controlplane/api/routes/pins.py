"""Pinned adapter versions (docs/controlplane.md, "Pinned adapters"): a tenant pins its own
versions within its max_pinned_bytes quota; the admin pins any tenant's, past the quota. Either
way a pin must fit on the pool's replicas (409 PinsDoNotFit naming the numbers)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status
from sqlalchemy.orm import Session

from loraplane.controlplane.api.deps import AdminDep, CallerDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.crud import pins as crud
from loraplane.controlplane.crud.tenants import get_tenant
from loraplane.controlplane.models import DEFAULT_NAMESPACE, AdapterPin, Tenant
from loraplane.controlplane.schemas.common import Namespace, ResourceName
from loraplane.controlplane.schemas.pins import PinCreate, PinPublic, PinReplica

router = APIRouter(tags=["pins"], responses=errors(400, 401))
PIN = "/v1/adapters/{name}/versions/{version}/pin"
ADMIN_PIN = "/v1/tenants/{tenant}/adapters/{name}/versions/{version}/pin"
PoolQuery = Annotated[ResourceName, Query(description="the pool's name")]
NamespaceQuery = Annotated[Namespace, Query(description="the pool's namespace")]


def pin_public(session: Session, pin: AdapterPin) -> PinPublic:
    """The answer for `pin`, with what its assigned replicas' last reports say of it (also
    the operator's pool view: `GET /internal/v1/pools/{pool}`)."""
    tenant, adapter = crud.names(session, pin)
    placement = [
        PinReplica(replica=r, state=state) for r, state in crud.replica_states(pin, tenant, adapter)
    ]
    return PinPublic.of(pin, tenant, adapter, placement)


def _pin(
    session: Session, tenant: Tenant, name: str, version: int, body: PinCreate, actor: str,
    admin: bool,
) -> PinPublic:  # fmt: skip
    pin = crud.pin_version(
        session, tenant=tenant, name=name, version=version, namespace=body.namespace,
        pool=body.pool, replicas=body.replicas, actor=actor, admin=admin,
    )  # fmt: skip
    return pin_public(session, pin)


@router.put(PIN, response_model=PinPublic, responses=errors(404, 409))
def pin_version(
    name: str, version: int, body: PinCreate, session: SessionDep, caller: CallerDep
) -> PinPublic:
    """Keep version `version` of one of the caller's adapters resident on `replicas` replicas
    of the pool, within the tenant's max_pinned_bytes (409 QuotaExceeded) and what the pool's
    replicas hold (409 PinsDoNotFit); again with another count changes it."""
    return _pin(session, caller.tenant, name, version, body, caller.actor, admin=False)


@router.delete(PIN, status_code=status.HTTP_204_NO_CONTENT, responses=errors(404))
def unpin_version(
    name: str,
    version: int,
    session: SessionDep,
    caller: CallerDep,
    pool: PoolQuery,
    namespace: NamespaceQuery = DEFAULT_NAMESPACE,
) -> None:
    """Unpin: the replicas evict the version like any other again."""
    crud.unpin_version(
        session, tenant=caller.tenant, name=name, version=version, namespace=namespace,
        pool=pool, actor=caller.actor,
    )  # fmt: skip


@router.get("/v1/pins", response_model=list[PinPublic])
def list_pins(session: SessionDep, caller: CallerDep) -> list[PinPublic]:
    """The caller's pins, each with the replicas that hold it and those that refused it (with
    the reason), from the replicas' last pressure reports."""
    return [pin_public(session, p) for p in crud.list_pins(session, tenant=caller.tenant)]


@router.put(ADMIN_PIN, response_model=PinPublic, responses=errors(404, 409), tags=["admin: pins"])
def admin_pin_version(
    tenant: str, name: str, version: int, body: PinCreate, session: SessionDep, actor: AdminDep
) -> PinPublic:
    """Pin a tenant's version as the admin: past the tenant's quota, never past the pool's."""
    owner = get_tenant(session, name=tenant)
    return _pin(session, owner, name, version, body, actor, admin=True)


@router.delete(
    ADMIN_PIN, status_code=status.HTTP_204_NO_CONTENT, responses=errors(404),
    tags=["admin: pins"],
)  # fmt: skip
def admin_unpin_version(
    tenant: str,
    name: str,
    version: int,
    session: SessionDep,
    actor: AdminDep,
    pool: PoolQuery,
    namespace: NamespaceQuery = DEFAULT_NAMESPACE,
) -> None:
    """Unpin a tenant's version as the admin."""
    owner = get_tenant(session, name=tenant)
    crud.unpin_version(
        session, tenant=owner, name=name, version=version, namespace=namespace, pool=pool,
        actor=actor,
    )  # fmt: skip
