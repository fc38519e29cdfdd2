"""Internal routes (service token): resolution for the data plane, pressure reports, and the
operator's: versions it stored, pools it mirrors, adapters whose resource was deleted."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loraplane.controlplane import basemodels
from loraplane.controlplane.api.deps import ContextDep, PoolNamespace, ServiceDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.api.routes.adapters import adapter_public
from loraplane.controlplane.api.routes.pins import pin_public
from loraplane.controlplane.context import AppContext
from loraplane.controlplane.crud import adapters as crud_adapters
from loraplane.controlplane.crud import pins as crud_pins
from loraplane.controlplane.crud import pools as crud_pools
from loraplane.controlplane.crud import rollouts as crud_rollouts
from loraplane.controlplane.crud.pools import pool_ref
from loraplane.controlplane.crud.resolve import Resolution, resolve
from loraplane.controlplane.crud.signing_keys import policy_for
from loraplane.controlplane.crud.tenants import get_tenant_by_namespace
from loraplane.controlplane.crud.usage import add_usage
from loraplane.controlplane.errors import InvalidRequest
from loraplane.controlplane.models import DEFAULT_NAMESPACE, AdapterPin, utcnow
from loraplane.controlplane.schemas.adapters import (
    AdapterPublic,
    RolloutSet,
    UploadResult,
    VersionPublic,
)
from loraplane.controlplane.schemas.internal import (
    PressureAccepted,
    PressureReport,
    Resolved,
    RolloutTarget,
    SigningKeyEntry,
    SigningPolicy,
    VersionRecord,
)
from loraplane.controlplane.schemas.pins import PinAssignment
from loraplane.controlplane.schemas.pools import PoolCreate, PoolInternal, PoolPublic
from loraplane.controlplane.signatures import SignatureClaim, signature_check, signed_fields

router = APIRouter(prefix="/internal/v1", tags=["internal"], responses=errors(400, 401))
TENANT_KEY_HEADER = "X-Tenant-Key"


@router.get("/resolve", response_model=Resolved, responses=errors(404))
async def resolve_model(
    ctx: ContextDep,
    _: ServiceDep,
    model: Annotated[str, Query(min_length=1, max_length=300)],
    tenant_key: Annotated[str, Header(alias=TENANT_KEY_HEADER, max_length=200)],
) -> Resolved:
    """What `model` (`name`, `name@version` or a base model's name) means for the tenant
    whose API key the data plane forwards in the X-Tenant-Key header."""
    # The hot path: one trip through the threadpool and one round trip to the database,
    # at most as many at once as the resolve engine has connections.
    async with ctx.resolve_slots:
        found = await run_in_threadpool(_resolve, ctx, tenant_key, model)
    v = found.version
    return Resolved(
        tenant=found.tenant,
        base_model=found.base_model,
        adapter=found.adapter,
        version=v.version if v else None,
        digest=v.digest if v else None,
        path=v.path if v else None,
        rank=v.rank if v else None,
        alpha=v.alpha if v else None,
        requests_per_minute=found.requests_per_minute,
        tokens_per_minute=found.tokens_per_minute,
        weight=found.weight,
        rollout=[
            RolloutTarget(
                version=r.version,
                weight=w,
                digest=r.digest,
                path=r.path,
                rank=r.rank,
                alpha=r.alpha,
            )
            for r, w in found.rollout
        ]
        or None,
    )


def _resolve(ctx: AppContext, secret: str, model: str) -> Resolution:
    """Resolve on the resolve engine; a connection the database dropped (it restarted) is
    retried once on a fresh one, which is what pre-ping would have done, paid only on failure."""
    for attempt in (1, 2):
        try:
            with ctx.resolve_engine.connect() as conn:
                return resolve(conn, secret=secret, model=model)
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
    raise AssertionError("unreachable")


@router.post("/pressure", response_model=PressureAccepted, responses=errors(404, 422))
def report_pressure(
    body: PressureReport, session: SessionDep, actor: ServiceDep
) -> PressureAccepted:
    """A replica's slot pressure (kept per replica on its pool) and usage since last time,
    counted once per `usage_batch` (a report sent again after a lost answer adds nothing).

    The base model config it reports is kept if the pool's is pending. A config uploads could
    not be validated against is 422 InvalidBaseModel, and nothing of the report is recorded."""
    report = body.model_dump(exclude={"namespace", "pool", "replica", "usage", "base_model_config"})
    pool = crud_pools.get_pool(session, namespace=body.namespace, name=body.pool, lock=True)
    duplicate = body.usage_batch is not None and body.usage_batch == crud_pools.last_usage_batch(
        pool, body.replica
    )
    recorded, skipped = (
        (0, 0) if duplicate else add_usage(session, rows=body.usage, day=utcnow().date())
    )
    pool = crud_pools.record_pressure(
        session, namespace=body.namespace, name=body.pool, replica=body.replica, report=report,
        base_model_config=body.base_model_config, actor=actor,
    )  # fmt: skip
    return PressureAccepted(
        namespace=body.namespace,
        pool=body.pool,
        replica=body.replica,
        usage_rows=recorded,
        usage_skipped=skipped,
        usage_duplicate=duplicate,
        replicas=crud_pools.live_replicas(pool),
        base_model_config_known=pool.base_model_config is not None,
        pins=[
            _assignment(session, p)
            for p in crud_pins.pins_for_replica(session, pool=pool, replica=body.replica)
        ],
    )


def _assignment(session: Session, pin: AdapterPin) -> PinAssignment:
    tenant, adapter = crud_pins.names(session, pin)
    v = pin.version
    return PinAssignment(
        tenant=tenant, adapter=adapter, version=v.version, digest=v.digest, path=v.path
    )


@router.post(
    "/versions",
    response_model=UploadResult,
    status_code=status.HTTP_201_CREATED,
    responses={
        **errors(404, 409, 422),
        200: {"model": UploadResult, "description": "already recorded"},
    },
)
def record_version(
    body: VersionRecord, response: Response, session: SessionDep, actor: ServiceDep
) -> UploadResult:
    """Record a version the operator stored (idempotent: 200 if already recorded); `tenant` is
    the namespace of the LoRAAdapter, which names the tenant it belongs to.

    Its signature is verified again here, against the tenant's keys and the tenant's and
    pools' policy (the operator verified it before storing): 422 SignatureRequired /
    SignatureInvalid, and nothing is recorded."""
    tenant = get_tenant_by_namespace(session, namespace=body.tenant)
    check = signature_check(
        session,
        tenant=tenant,
        base_model=body.base_model,
        claim=SignatureClaim.of(body.signature, body.signature_key_id),
    )
    check(body.digest)
    fields = body.model_dump(exclude={"tenant", "name", "signature", "signature_key_id"})
    stored = crud_adapters.StoredVersion(**fields, **signed_fields(check.verified))
    adapter, row, created = crud_adapters.record_version(
        session, tenant=tenant, name=body.name, stored=stored, actor=actor
    )
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return UploadResult(
        name=adapter.name,
        created=created,
        current_version=adapter.current_version,
        version=VersionPublic.model_validate(row),
    )


@router.get(
    "/tenants/{namespace}/signing-policy", response_model=SigningPolicy, responses=errors(404)
)
def signing_policy(
    namespace: str,
    base_model: Annotated[str, Query(min_length=1, max_length=200)],
    session: SessionDep,
    _: ServiceDep,
) -> SigningPolicy:
    """The signature an adapter in `namespace` for `base_model` must carry, and the tenant's
    keys: the operator verifies a LoRAAdapter's `spec.source.signature` with them before it
    stores the version. 404 when no tenant has that namespace."""
    tenant = get_tenant_by_namespace(session, namespace=namespace)
    policy = policy_for(session, tenant=tenant, base_model=base_model)
    return SigningPolicy(
        tenant=tenant.name,
        required=policy.required,
        reason=policy.reason,
        keys=[SigningKeyEntry(key_id=k.key_id, public_key=k.pem, revoked=k.revoked)
              for k in policy.keys],
    )  # fmt: skip


# -- the operator: pools it mirrors from ServingPools, adapters whose LoRAAdapter is deleted ---


@router.put(
    "/pools/{pool}",
    response_model=PoolPublic,
    responses={**errors(404, 409, 422), 201: {"model": PoolPublic, "description": "created"}},
)
def put_pool(
    pool: str, body: PoolCreate, response: Response, ctx: ContextDep, session: SessionDep,
    actor: ServiceDep, namespace: PoolNamespace = DEFAULT_NAMESPACE,
) -> PoolPublic:  # fmt: skip
    """Create or update a pool (201 or 200); a different base model is 409 Conflict."""
    if (body.namespace, body.name) != (namespace, pool):
        raise InvalidRequest(
            f"body pool {pool_ref(body.namespace, body.name)} differs from the request's "
            f"{pool_ref(namespace, pool)}"
        )
    load = partial(basemodels.load_config, s3_endpoint_url=ctx.settings.s3_endpoint_url)
    row, created = crud_pools.put_pool(session, data=body, actor=actor, load_config=load)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return PoolPublic.model_validate(row)


@router.get("/pools/{pool}", response_model=PoolInternal, responses=errors(404))
def get_pool(
    pool: str, session: SessionDep, _: ServiceDep, namespace: PoolNamespace = DEFAULT_NAMESPACE
) -> PoolInternal:
    """A pool with its replicas' last pressure, its base model config and its pins with what
    the replicas report of each (for the operator).

    The autoscaler reads the pressure, the ServingPool's status the pins; adapters are
    validated against the config."""
    row = crud_pools.get_pool(session, namespace=namespace, name=pool)
    pins = [pin_public(session, p) for p in crud_pins.pool_pins(session, pool=row)]
    public = PoolPublic.model_validate(row).model_dump()
    return PoolInternal.model_validate({**public, "pins": pins})


@router.delete("/pools/{pool}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404))
def delete_pool(
    pool: str, session: SessionDep, actor: ServiceDep, namespace: PoolNamespace = DEFAULT_NAMESPACE
) -> None:
    """Forget a pool whose ServingPool was deleted."""
    crud_pools.delete_pool(session, namespace=namespace, name=pool, actor=actor)


@router.delete(
    "/tenants/{tenant}/adapters/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=errors(404),
)
def delete_adapter(tenant: str, name: str, session: SessionDep, actor: ServiceDep) -> None:
    """Stop serving an adapter whose LoRAAdapter was deleted (its versions are kept);
    `tenant` is the LoRAAdapter's namespace."""
    owner = get_tenant_by_namespace(session, namespace=tenant)
    crud_adapters.delete_adapter(session, tenant=owner, name=name, actor=actor)


@router.put(
    "/tenants/{tenant}/adapters/{name}/rollout",
    response_model=AdapterPublic,
    responses=errors(404),
)
def put_rollout(
    tenant: str, name: str, body: RolloutSet, session: SessionDep, actor: ServiceDep
) -> AdapterPublic:
    """A LoRAAdapter's `spec.rollout` (GitOps): the split to serve, as the tenant's PATCH
    sets it (one version at 100 promotes it), or null: no split (a running one is rolled
    back; none running, nothing changes). `tenant` is the LoRAAdapter's namespace. 404 for
    an adapter or a version the catalog does not have yet (the operator retries)."""
    owner = get_tenant_by_namespace(session, namespace=tenant)
    if body.rollout is not None:
        crud_rollouts.set_rollout(
            session, tenant=owner, name=name, weights=body.rollout, actor=actor
        )
    elif crud_adapters.get_adapter(session, tenant=owner, name=name).rollout:
        crud_rollouts.rollback(session, tenant=owner, name=name, actor=actor)
    return adapter_public(crud_adapters.get_adapter_view(session, tenant=owner, name=name))
