"""Resolution, the data plane's hot path: (tenant key, model name[@version]) -> what to load.

One round trip: a single Core statement finds the key by its indexed prefix, its tenant, the
adapter joined to the version it serves, and (as a scalar subquery) whether a pool serves a
base model of that name. Rows come back as plain tuples: no ORM identity map on this path.
An unpinned name under a weighted rollout (crud/rollouts.py) costs a second, prebuilt query
for the split's versions: the answer carries them all with their weights, and the data plane
picks one per request (its cached answer holds the split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Integer, Select, String, and_, bindparam, select, update

from loraplane.controlplane import security
from loraplane.controlplane.crud.keys import LAST_USED_RESOLUTION
from loraplane.controlplane.errors import NotFound, Unauthorized
from loraplane.controlplane.models import Adapter, AdapterVersion, ApiKey, Pool, Tenant, utcnow

_MISSING_HASH = "0" * 64  # hashed against when no key matched, so timing tells nothing


@dataclass(frozen=True, slots=True)
class ResolvedVersion:
    """The adapter version a resolution points at."""

    version: int
    digest: str
    path: str
    rank: int
    alpha: float


@dataclass(frozen=True, slots=True)
class Resolution:
    """An adapter version (adapter set) or the base model (adapter None) for a tenant."""

    tenant: str
    requests_per_minute: int
    tokens_per_minute: int
    weight: float  # the tenant's scheduling weight (its share of a contended replica)
    base_model: str
    adapter: str | None = None
    version: ResolvedVersion | None = None
    # an unpinned name under a weighted rollout: each version of the split and its weight
    # (`version` stays the current one, the rollback target)
    rollout: tuple[tuple[ResolvedVersion, int], ...] = ()


def split_model(model: str) -> tuple[str, int | None]:
    """`name@7` -> ("name", 7); `name` -> ("name", None); NotFound for a bad pin."""
    name, sep, pin = model.rpartition("@")
    if not sep:
        return model, None
    if not pin.isdigit() or len(pin) > 9 or int(pin) < 1:
        raise NotFound(f"model {model!r} not found: a version pin is name@<positive integer>")
    return name, int(pin)


def _statement(*, pinned: bool) -> Select[*tuple[Any, ...]]:
    """The one resolve query; built once per shape (pinned or current), values bound later."""
    name = bindparam("name", type_=String)
    wanted = AdapterVersion.version == (
        bindparam("pin", type_=Integer) if pinned else Adapter.current_version
    )
    serving_base = (
        select(Pool.base_model_name).where(Pool.base_model_name == name).limit(1)
    ).scalar_subquery()
    return (
        select(
            ApiKey.id,
            ApiKey.key_hash,
            ApiKey.revoked_at,
            ApiKey.last_used_at,
            Tenant.name.label("tenant"),
            Tenant.deleted.label("tenant_deleted"),
            Tenant.requests_per_minute,
            Tenant.tokens_per_minute,
            Tenant.weight,
            Adapter.name.label("adapter"),
            Adapter.id.label("adapter_id"),
            Adapter.rollout,
            AdapterVersion.version,
            AdapterVersion.digest,
            AdapterVersion.path,
            AdapterVersion.rank,
            AdapterVersion.alpha,
            AdapterVersion.base_model,
            serving_base.label("served_base_model"),
        )
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .outerjoin(
            Adapter,
            and_(
                Adapter.tenant_id == ApiKey.tenant_id,
                Adapter.name == name,
                Adapter.deleted.is_(False),
            ),
        )
        .outerjoin(AdapterVersion, and_(AdapterVersion.adapter_id == Adapter.id, wanted))
        .where(ApiKey.prefix == bindparam("prefix", type_=String))
    )


# Built once: constructing a statement costs more than running it on this path.
_CURRENT = _statement(pinned=False)
_PINNED = _statement(pinned=True)
_SPLIT = select(
    AdapterVersion.version,
    AdapterVersion.digest,
    AdapterVersion.path,
    AdapterVersion.rank,
    AdapterVersion.alpha,
).where(
    AdapterVersion.adapter_id == bindparam("adapter_id", type_=Integer),
    AdapterVersion.version.in_(bindparam("versions", expanding=True)),
)


def resolve(conn: Connection, *, secret: str, model: str) -> Resolution:
    """What `model` means for the tenant whose key is `secret`.

    Unauthorized for a bad, revoked or deleted tenant's key; NotFound when the tenant has no
    such adapter (or version) and no pool serves a base model of that name. Records the key's
    use at most once a minute.
    """
    name, pin = split_model(model)
    params: dict[str, object] = {"name": name, "prefix": security.key_prefix(secret) or ""}
    if pin is not None:
        params["pin"] = pin
    row = conn.execute(_PINNED if pin is not None else _CURRENT, params).first()
    matches = security.key_matches(secret, row.key_hash if row is not None else _MISSING_HASH)
    if row is None or not matches or row.revoked_at is not None or row.tenant_deleted:
        raise Unauthorized("invalid or revoked API key")
    now = utcnow()
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
        conn.execute(update(ApiKey).where(ApiKey.id == row.id).values(last_used_at=now))
    tenant = (row.tenant, row.requests_per_minute, row.tokens_per_minute, row.weight)
    if row.version is not None:
        found = ResolvedVersion(row.version, row.digest, row.path, row.rank, row.alpha)
        split = _split(conn, row.adapter_id, row.rollout) if pin is None else ()
        return Resolution(
            *tenant, row.base_model, adapter=row.adapter, version=found, rollout=split
        )
    if pin is None and row.served_base_model is not None:
        return Resolution(*tenant, row.served_base_model)
    raise NotFound(f"model {model!r} not found")


def _split(
    conn: Connection, adapter_id: int, rollout: dict[str, Any] | None
) -> tuple[tuple[ResolvedVersion, int], ...]:
    """The versions of a running rollout with their weights, versions ascending (() when none
    runs). Versions are never deleted, so each one of the split is found."""
    if not rollout:
        return ()
    weights = {int(v): int(w) for v, w in rollout.items()}
    rows = conn.execute(_SPLIT, {"adapter_id": adapter_id, "versions": sorted(weights)})
    found = sorted(
        ((ResolvedVersion(*r), weights[r.version]) for r in rows), key=lambda p: p[0].version
    )
    return tuple(found)
