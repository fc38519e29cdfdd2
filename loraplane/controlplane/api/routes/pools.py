"""Admin routes: serving pools (in a cluster the operator mirrors each ServingPool here).

A pool is named by its namespace and name: `{pool}` is the name, `?namespace=` the namespace
(default "default").
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, status

from loraplane.controlplane import basemodels
from loraplane.controlplane.api.deps import AdminDep, ContextDep, PoolNamespace, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.crud import pools as crud
from loraplane.controlplane.models import DEFAULT_NAMESPACE
from loraplane.controlplane.schemas.pools import PoolCreate, PoolPublic, PoolUpdate

router = APIRouter(prefix="/v1/pools", tags=["admin: pools"], responses=errors(400, 401))


@router.post(
    "",
    response_model=PoolPublic,
    status_code=status.HTTP_201_CREATED,
    responses=errors(409, 422),
)
def create_pool(
    body: PoolCreate, ctx: ContextDep, session: SessionDep, actor: AdminDep
) -> PoolPublic:
    """Register a pool; its base model's config.json is read now (a path or s3://).

    With `base_model.config_from_replicas` it is not: the pool's replicas report it."""
    load = partial(_load_config, s3_endpoint_url=ctx.settings.s3_endpoint_url)
    pool = crud.create_pool(session, data=body, actor=actor, load_config=load)
    return PoolPublic.model_validate(pool)


def _load_config(uri: str, name: str, *, s3_endpoint_url: str | None) -> dict[str, object]:
    return basemodels.load_config(uri, name, s3_endpoint_url=s3_endpoint_url)


@router.get("", response_model=list[PoolPublic])
def list_pools(session: SessionDep, _: AdminDep) -> list[PoolPublic]:
    """Every pool, with the pressure its replicas last reported."""
    return [PoolPublic.model_validate(p) for p in crud.list_pools(session)]


@router.get("/{pool}", response_model=PoolPublic, responses=errors(404))
def get_pool(
    pool: str, session: SessionDep, _: AdminDep, namespace: PoolNamespace = DEFAULT_NAMESPACE
) -> PoolPublic:
    """One pool."""
    return PoolPublic.model_validate(crud.get_pool(session, namespace=namespace, name=pool))


@router.patch("/{pool}", response_model=PoolPublic, responses=errors(404))
def update_pool(
    pool: str,
    body: PoolUpdate,
    session: SessionDep,
    actor: AdminDep,
    namespace: PoolNamespace = DEFAULT_NAMESPACE,
) -> PoolPublic:
    """Change a pool's LoRA limits."""
    row = crud.update_pool(session, namespace=namespace, name=pool, data=body, actor=actor)
    return PoolPublic.model_validate(row)


@router.delete("/{pool}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404))
def delete_pool(
    pool: str, session: SessionDep, actor: AdminDep, namespace: PoolNamespace = DEFAULT_NAMESPACE
) -> None:
    """Forget a pool (stored adapters and their versions are not touched)."""
    crud.delete_pool(session, namespace=namespace, name=pool, actor=actor)
