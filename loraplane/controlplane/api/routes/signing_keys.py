"""Signing keys: the public keys a tenant signs its adapters with (docs/security.md, "Signed
adapters"). Tenant routes at `/v1/signing-keys` (the caller's own keys); the admin's at
`/v1/tenants/{tenant}/signing-keys` (the same work for any tenant)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from loraplane.controlplane.api.deps import AdminDep, CallerDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.crud import signing_keys as crud
from loraplane.controlplane.crud.tenants import get_tenant
from loraplane.controlplane.errors import Forbidden
from loraplane.controlplane.schemas.tenants import SigningKeyCreate, SigningKeyPublic

router = APIRouter(tags=["tenant: signing keys"], responses=errors(400, 401))
TENANT = "/v1/signing-keys"
ADMIN = "/v1/tenants/{tenant}/signing-keys"
CREATED = {
    **errors(409),
    200: {"model": SigningKeyPublic, "description": "that key was already registered"},
}


@router.post(
    TENANT,
    response_model=SigningKeyPublic,
    status_code=status.HTTP_201_CREATED,
    responses={**CREATED, **errors(403)},
)
def register_key(
    body: SigningKeyCreate, response: Response, session: SessionDep, caller: CallerDep
) -> SigningKeyPublic:
    """Register a public key (PEM, ECDSA P-256 or Ed25519) to sign adapters with: 201 with its
    `key_id`; 200 when it is registered already; 409 for a key that was revoked; 403
    SigningKeysByAdmin when the admin registers this tenant's keys (`signing_keys_by_admin`)."""
    if caller.tenant.signing_keys_by_admin:
        raise Forbidden(
            f"signing keys of tenant {caller.tenant.name!r} are registered by the admin "
            "(signing_keys_by_admin): ask the admin to add this key "
            f"(POST /v1/tenants/{caller.tenant.name}/signing-keys)",
            code="SigningKeysByAdmin",
        )
    row, created = crud.register_key(
        session, tenant=caller.tenant, public_key=body.public_key, name=body.name,
        actor=caller.actor,
    )  # fmt: skip
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return SigningKeyPublic.model_validate(row)


@router.get(TENANT, response_model=list[SigningKeyPublic])
def list_keys(session: SessionDep, caller: CallerDep) -> list[SigningKeyPublic]:
    """The caller's signing keys, revoked ones included."""
    rows = crud.list_keys(session, tenant=caller.tenant)
    return [SigningKeyPublic.model_validate(k) for k in rows]


@router.delete(TENANT + "/{key_id}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404))
def revoke_key(key_id: str, session: SessionDep, caller: CallerDep) -> None:
    """Revoke a signing key: signatures by it are refused from now on (versions it signed
    stay recorded and served)."""
    crud.revoke_key(session, tenant=caller.tenant, key_id=key_id, actor=caller.actor)


@router.post(
    ADMIN,
    response_model=SigningKeyPublic,
    status_code=status.HTTP_201_CREATED,
    responses={**CREATED, **errors(404)},
    tags=["admin: tenants"],
)
def admin_register_key(
    tenant: str, body: SigningKeyCreate, response: Response, session: SessionDep, actor: AdminDep
) -> SigningKeyPublic:
    """Register a signing key for a tenant (as the tenant's own route does)."""
    owner = get_tenant(session, name=tenant)
    row, created = crud.register_key(
        session, tenant=owner, public_key=body.public_key, name=body.name, actor=actor
    )
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return SigningKeyPublic.model_validate(row)


@router.get(
    ADMIN,
    response_model=list[SigningKeyPublic],
    responses=errors(404),
    tags=["admin: tenants"],
)
def admin_list_keys(tenant: str, session: SessionDep, _: AdminDep) -> list[SigningKeyPublic]:
    """A tenant's signing keys, revoked ones included."""
    owner = get_tenant(session, name=tenant)
    return [SigningKeyPublic.model_validate(k) for k in crud.list_keys(session, tenant=owner)]


@router.delete(
    ADMIN + "/{key_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=errors(404),
    tags=["admin: tenants"],
)
def admin_revoke_key(tenant: str, key_id: str, session: SessionDep, actor: AdminDep) -> None:
    """Revoke a tenant's signing key."""
    owner = get_tenant(session, name=tenant)
    crud.revoke_key(session, tenant=owner, key_id=key_id, actor=actor)
