"""Pinned adapter versions: kept resident on k replicas of a pool, within the tenant's quota.

A pin is (version, pool, replicas k). Which replicas keep it is not stored: it follows from
the pool's live replicas (those that reported pressure in the last 30 s) by rendezvous
hashing (`assign`): each version ranks the replicas by sha256(digest/replica) and the first k
keep it. Every replica computes the same answer from the same names, the copies of many pins
spread evenly over the pool, and a replica that joins or leaves moves only the pins it takes
or held. Each pressure answer tells the reporting replica the versions it keeps, and its next
reports say what became of each (`pin_states`: held, or refused by its engine and why), which
`replica_states` reads back for the pin's views.

A pin must fit: at most the pool's live replicas; per replica, pins may take at most half its
adapter memory (`gpu_bytes_capacity` in its reports; the versions' stored sizes are counted)
and half its slots (`max_loras`), as the data plane caps them (lora/pins.py); and a tenant
(not the admin) within `max_pinned_bytes`, each pin costing its size times its replicas.
A refusal names the numbers (409 PinsDoNotFit / QuotaExceeded) and is audited.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.crud import audit
from loraplane.controlplane.crud.adapters import get_adapter
from loraplane.controlplane.crud.pools import get_pool, live_replica_reports, pool_ref
from loraplane.controlplane.errors import InvalidRequest, NotFound, PinsDoNotFit, QuotaExceeded
from loraplane.controlplane.models import Adapter, AdapterPin, AdapterVersion, Pool, Tenant

PIN_FRACTION = 0.5  # of a replica's adapter memory and slots, as the data plane caps pins


def assign(digest: str, replicas: Iterable[str], k: int) -> list[str]:
    """The `k` replicas (of `replicas`) that keep version `digest`: rendezvous hashing."""
    ranked = sorted(
        replicas, key=lambda r: hashlib.sha256(f"{digest}/{r}".encode()).digest(), reverse=True
    )
    return ranked[:k]


def placement(pins: Iterable[AdapterPin], replicas: Iterable[str]) -> dict[str, list[AdapterPin]]:
    """Replica -> the pins it keeps (every replica named, with none for some)."""
    names = sorted(set(replicas))
    kept: dict[str, list[AdapterPin]] = {r: [] for r in names}
    for pin in pins:
        for replica in assign(pin.version.digest, names, pin.replicas):
            kept[replica].append(pin)
    return kept


def _target(tenant: Tenant, name: str, version: int, pool: Pool) -> str:
    where = pool_ref(pool.namespace, pool.name)
    return f"tenants/{tenant.name}/adapters/{name}/versions/{version}/pins/{where}"


def _version(session: Session, *, tenant: Tenant, name: str, version: int) -> AdapterVersion:
    adapter = get_adapter(session, tenant=tenant, name=name)
    row = session.scalar(
        select(AdapterVersion).where(
            AdapterVersion.adapter_id == adapter.id, AdapterVersion.version == version
        )
    )
    if row is None:
        raise NotFound(f"adapter {name!r} has no version {version}")
    return row


def pool_pins(session: Session, *, pool: Pool) -> list[AdapterPin]:
    """Every pin on `pool`, oldest first."""
    return list(
        session.scalars(
            select(AdapterPin).where(AdapterPin.pool_id == pool.id).order_by(AdapterPin.id)
        )
    )


def list_pins(session: Session, *, tenant: Tenant) -> list[AdapterPin]:
    """The tenant's pins, oldest first."""
    stmt = select(AdapterPin).where(AdapterPin.tenant_id == tenant.id).order_by(AdapterPin.id)
    return list(session.scalars(stmt))


def _find(session: Session, *, version: AdapterVersion, pool: Pool) -> AdapterPin | None:
    return session.scalar(
        select(AdapterPin).where(AdapterPin.version_id == version.id, AdapterPin.pool_id == pool.id)
    )


def _check_fit(pool: Pool, pins: list[AdapterPin], pin: AdapterPin) -> None:
    """PinsDoNotFit unless `pins` (with `pin` among them) fit on the pool's live replicas."""
    reports = live_replica_reports(pool)
    ref = pool_ref(pool.namespace, pool.name)
    if pin.replicas > len(reports):
        raise PinsDoNotFit(
            f"pin of {pin.replicas} replicas refused: pool {ref} has {len(reports)} live"
            " replicas (those that reported in the last 30 s)"
        )
    slots = max(1, int(pool.max_loras * PIN_FRACTION))
    for replica, kept in placement(pins, reports).items():
        if len(kept) > slots:
            raise PinsDoNotFit(
                f"pin refused: replica {replica} of pool {ref} would keep {len(kept)} pinned"
                f" versions, more than its cap of {slots} (half of its {pool.max_loras} slots)"
            )
        capacity = reports[replica].get("gpu_bytes_capacity")
        if not isinstance(capacity, int) or capacity <= 0:
            continue  # not reported: the replica itself refuses what does not fit
        cap = int(capacity * PIN_FRACTION)
        used = sum(p.version.size_bytes for p in kept)
        if used > cap:
            raise PinsDoNotFit(
                f"pin refused: replica {replica} of pool {ref} would keep {used} bytes of pinned"
                f" versions, more than the {cap} bytes pins may take there (half of its"
                f" {capacity}-byte adapter memory)"
            )


def _check_quota(session: Session, tenant: Tenant, pin: AdapterPin, size: int) -> None:
    others = [p for p in list_pins(session, tenant=tenant) if p.id != pin.id]
    used = sum(p.version.size_bytes * p.replicas for p in others)
    wanted = size * pin.replicas
    if used + wanted > tenant.max_pinned_bytes:
        raise QuotaExceeded(
            f"pin refused: {pin.replicas} replicas of a {size}-byte version take {wanted} bytes"
            f" beside the {used} bytes the tenant has pinned, more than its max_pinned_bytes"
            f" quota of {tenant.max_pinned_bytes}"
        )


def pin_version(
    session: Session,
    *,
    tenant: Tenant,
    name: str,
    version: int,
    namespace: str,
    pool: str,
    replicas: int,
    actor: str,
    admin: bool = False,
) -> AdapterPin:
    """Pin version `version` of the tenant's adapter `name` on `replicas` replicas of the pool
    (a second call changes the count). Within the tenant's quota unless `admin`; refused with
    the numbers when it does not fit (audited either way)."""
    row = _version(session, tenant=tenant, name=name, version=version)
    target = get_pool(session, namespace=namespace, name=pool, lock=True)
    if target.base_model_name != row.base_model:
        raise InvalidRequest(
            f"pool {pool_ref(namespace, pool)} serves {target.base_model_name}, not"
            f" {row.base_model} (the base model of {name} version {version})",
            code="PoolMismatch",
        )
    pin = _find(session, version=row, pool=target)
    created = pin is None
    if pin is None:
        pin = AdapterPin(tenant_id=tenant.id, version_id=row.id, pool_id=target.id, replicas=0)
        pin.version, pin.pool = row, target
    pin.replicas = replicas
    pins = [p for p in pool_pins(session, pool=target) if p.id != pin.id] + [pin]
    where = _target(tenant, name, version, target)
    try:
        if not admin:
            _check_quota(session, tenant, pin, row.size_bytes)
        _check_fit(target, pins, pin)
    except (PinsDoNotFit, QuotaExceeded) as e:
        session.rollback()  # an existing pin keeps its count
        detail = {"replicas": replicas, "reason": e.message}
        audit.record(session, actor=actor, action="adapter.pin", target=where,
                     outcome=f"refused:{e.code}", detail=detail)  # fmt: skip
        session.commit()
        raise
    pin.created_by = pin.created_by or actor
    if created:
        session.add(pin)
    audit.record(session, actor=actor, action="adapter.pin", target=where,
                 detail={"replicas": replicas, "digest": row.digest})  # fmt: skip
    session.commit()
    session.refresh(pin)
    return pin


def unpin_version(
    session: Session, *, tenant: Tenant, name: str, version: int, namespace: str, pool: str,
    actor: str,
) -> None:  # fmt: skip
    """Remove the pin (NotFound when there is none): replicas evict the version like any other."""
    row = _version(session, tenant=tenant, name=name, version=version)
    target = get_pool(session, namespace=namespace, name=pool)
    pin = _find(session, version=row, pool=target)
    if pin is None:
        raise NotFound(
            f"{name} version {version} is not pinned on pool {pool_ref(namespace, pool)}"
        )
    session.delete(pin)
    audit.record(session, actor=actor, action="adapter.unpin",
                 target=_target(tenant, name, version, target))  # fmt: skip
    session.commit()


def pins_for_replica(session: Session, *, pool: Pool, replica: str) -> list[AdapterPin]:
    """The pins `replica` (live: it just reported) keeps."""
    pins = pool_pins(session, pool=pool)
    if not pins:
        return []
    names = set(live_replica_reports(pool)) | {replica}
    return placement(pins, names)[replica]


def names(session: Session, pin: AdapterPin) -> tuple[str, str]:
    """The tenant's and the adapter's name of `pin`."""
    adapter = session.get(Adapter, pin.version.adapter_id)
    tenant = session.get(Tenant, pin.tenant_id)
    if adapter is None or tenant is None:  # pragma: no cover - foreign keys
        raise NotFound("the pin's adapter is gone")
    return tenant.name, adapter.name


def replica_states(pin: AdapterPin, tenant: str, adapter: str) -> list[tuple[str, str]]:
    """(replica, state) for each live replica `pin` is assigned to, the state as its last
    pressure report says (`pin_states`; `pending` when it does not say yet)."""
    reports = live_replica_reports(pin.pool)
    digest = pin.version.digest
    out = []
    for replica in assign(digest, sorted(reports), pin.replicas):
        state = "pending"
        for item in reports[replica].get("pin_states") or []:
            if (item.get("tenant"), item.get("adapter"), item.get("digest")) == (
                tenant, adapter, digest,
            ):  # fmt: skip
                state = str(item.get("state") or "pending")
        out.append((replica, state))
    return out
