"""Serving pools: registration, limits, and the pressure their replicas report.

A pool is named by (namespace, name), as the ServingPool it mirrors: pools named alike in two
namespaces are independent. Its base model's config.json is read from the base model's uri
when the pool is registered, or, for a model only on the pool's volume (`config_from_replicas`),
taken from the first pressure report that carries it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplane.controlplane import basemodels
from loraplane.controlplane.crud import audit
from loraplane.controlplane.errors import AlreadyExists, Conflict, NotFound
from loraplane.controlplane.models import Pool, utcnow
from loraplane.controlplane.schemas.pools import PoolCreate, PoolUpdate

log = logging.getLogger(__name__)
MAX_REPLICAS_KEPT = 1000
# a replica that reported within this many seconds counts as live: tenants' rate limits are
# split among the live replicas of a pool (each enforces its share)
LIVE_REPLICA_SECONDS = 30
# limits whose null means "none" (given as null in an update: cleared; left out: kept)
CLEARABLE = frozenset({"max_cpu_lora_bytes"})


def pool_ref(namespace: str, name: str) -> str:
    """`namespace/name`: how messages and audit targets name a pool."""
    return f"{namespace}/{name}"


def create_pool(
    session: Session,
    *,
    data: PoolCreate,
    actor: str,
    load_config: Callable[[str, str], dict[str, Any]],
) -> Pool:
    """Register a pool; its base model's config.json is read now (`load_config(uri, name)`),
    unless its replicas are to report it (then it is pending: None)."""
    ref = pool_ref(data.namespace, data.name)
    if _find(session, namespace=data.namespace, name=data.name) is not None:
        raise AlreadyExists(f"pool {ref} already exists")
    base = data.base_model
    pool = Pool(
        namespace=data.namespace,
        name=data.name,
        base_model_name=base.name,
        base_model_uri=base.uri,
        base_model_config=None if base.config_from_replicas else load_config(base.uri, base.name),
        max_lora_rank=data.max_lora_rank,
        max_loras=data.max_loras,
        max_cpu_loras=data.max_cpu_loras,
        max_cpu_lora_bytes=data.max_cpu_lora_bytes,
        require_signed_adapters=data.require_signed_adapters,
    )
    session.add(pool)
    audit.record(session, actor=actor, action="pool.create", target=f"pools/{ref}")
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise AlreadyExists(f"pool {ref} already exists") from None
    return pool


def put_pool(
    session: Session,
    *,
    data: PoolCreate,
    actor: str,
    load_config: Callable[[str, str], dict[str, Any]],
) -> tuple[Pool, bool]:
    """Create the pool, or bring an existing one's limits to `data` (the operator mirrors
    ServingPools this way). The base model of an existing pool never changes: Conflict."""
    pool = _find(session, namespace=data.namespace, name=data.name)
    if pool is None:
        try:
            return create_pool(session, data=data, actor=actor, load_config=load_config), True
        except AlreadyExists:  # created concurrently: update it below
            pool = get_pool(session, namespace=data.namespace, name=data.name)
    if (pool.base_model_name, pool.base_model_uri) != (data.base_model.name, data.base_model.uri):
        raise Conflict(
            f"pool {pool_ref(pool.namespace, pool.name)} serves base model "
            f"{pool.base_model_name!r} ({pool.base_model_uri}); a pool's base model cannot change"
        )
    limits = PoolUpdate(  # the byte limit as given, null too: a spec without one clears it
        max_lora_rank=data.max_lora_rank, max_loras=data.max_loras,
        max_cpu_loras=data.max_cpu_loras, max_cpu_lora_bytes=data.max_cpu_lora_bytes,
    )  # fmt: skip
    updated = update_pool(
        session, namespace=data.namespace, name=data.name, data=limits, actor=actor
    )
    return updated, False


def delete_pool(session: Session, *, namespace: str, name: str, actor: str) -> None:
    """Forget a pool (uploads for its base model then need another pool)."""
    session.delete(get_pool(session, namespace=namespace, name=name))
    audit.record(
        session, actor=actor, action="pool.delete", target=f"pools/{pool_ref(namespace, name)}"
    )
    session.commit()


def list_pools(session: Session) -> list[Pool]:
    """Every pool, by namespace and name."""
    return list(session.scalars(select(Pool).order_by(Pool.namespace, Pool.name)))


def _find(session: Session, *, namespace: str, name: str, lock: bool = False) -> Pool | None:
    stmt = select(Pool).where(Pool.namespace == namespace, Pool.name == name)
    if lock:  # and re-read: the session may hold the row as it was before the lock
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
    return session.scalar(stmt)


def get_pool(session: Session, *, namespace: str, name: str, lock: bool = False) -> Pool:
    """A pool by namespace and name (`lock`: held for update); NotFound otherwise."""
    pool = _find(session, namespace=namespace, name=name, lock=lock)
    if pool is None:
        raise NotFound(f"pool {pool_ref(namespace, name)} not found")
    return pool


def update_pool(
    session: Session, *, namespace: str, name: str, data: PoolUpdate, actor: str
) -> Pool:
    """Change a pool's LoRA limits (the fields given; a null byte limit clears it)."""
    pool = get_pool(session, namespace=namespace, name=name)
    changes = {
        field: value
        for field, value in data.model_dump(exclude_unset=True).items()
        if value is not None or field in CLEARABLE
    }
    for field, value in changes.items():
        setattr(pool, field, value)
    target = f"pools/{pool_ref(namespace, name)}"
    audit.record(session, actor=actor, action="pool.update", target=target, detail=changes)
    session.commit()
    return pool


def pools_for_base_model(session: Session, *, base_model: str) -> list[Pool]:
    """The pools serving `base_model` (an upload must fit every one of them)."""
    stmt = select(Pool).where(Pool.base_model_name == base_model).order_by(Pool.id)
    return list(session.scalars(stmt))


def record_pressure(
    session: Session,
    *,
    namespace: str,
    name: str,
    replica: str,
    report: dict[str, Any],
    base_model_config: dict[str, Any] | None,
    actor: str,
) -> Pool:
    """Keep a replica's latest report in the pool's pressure (one entry per replica), and the
    base model config it reported if the pool's is pending (`_learn_config`).

    Not audited, unless it sets the config: reports arrive every few seconds and change no
    desired state.
    """
    pool = get_pool(session, namespace=namespace, name=name, lock=True)
    if base_model_config is not None:
        _learn_config(session, pool=pool, config=base_model_config, replica=replica, actor=actor)
    now = utcnow()
    replicas = dict((pool.pressure or {}).get("replicas", {}))
    replicas[replica] = {**report, "time": now.isoformat()}
    if len(replicas) > MAX_REPLICAS_KEPT:  # drop the stalest: replicas come and go
        for old in sorted(replicas, key=lambda r: replicas[r]["time"])[:-MAX_REPLICAS_KEPT]:
            del replicas[old]
    pool.pressure = {"replicas": replicas}
    pool.pressure_at = now
    session.commit()
    return pool


def _learn_config(
    session: Session, *, pool: Pool, config: dict[str, Any], replica: str, actor: str
) -> None:
    """Take the base model config a replica reported (in the caller's transaction): stored if
    the pool's is pending; one that differs from the stored config is ignored with a warning
    (the first one stays: uploads were validated against it). InvalidBaseModel if uploads
    could not be validated against it."""
    basemodels.spec_of(config, pool.base_model_name)
    ref = pool_ref(pool.namespace, pool.name)
    if pool.base_model_config is None:
        pool.base_model_config = config
        audit.record(
            session, actor=actor, action="pool.base_model_config", target=f"pools/{ref}",
            detail={"replica": replica},
        )  # fmt: skip
    elif pool.base_model_config != config:
        log.warning(
            "replica %s of pool %s reports a base model config.json that differs from the "
            "pool's; the pool's is kept",
            replica,
            ref,
        )


def last_usage_batch(pool: Pool, replica: str) -> str | None:
    """The usage batch of `replica`'s last recorded report on `pool`, if any."""
    entry = ((pool.pressure or {}).get("replicas") or {}).get(replica)
    batch = entry.get("usage_batch") if isinstance(entry, dict) else None
    return batch if isinstance(batch, str) else None


def live_replica_reports(
    pool: Pool, *, window_s: float = LIVE_REPLICA_SECONDS
) -> dict[str, dict[str, Any]]:
    """The latest report of each replica of `pool` that reported within `window_s` seconds,
    by replica name."""
    horizon = utcnow().timestamp() - window_s
    live: dict[str, dict[str, Any]] = {}
    for name, entry in ((pool.pressure or {}).get("replicas") or {}).items():
        try:
            if datetime.fromisoformat(str(entry.get("time"))).timestamp() >= horizon:
                live[name] = entry
        except (AttributeError, ValueError):
            continue
    return live


def live_replicas(pool: Pool, *, window_s: float = LIVE_REPLICA_SECONDS) -> int:
    """Replicas of `pool` that reported within `window_s` seconds (at least 1)."""
    return max(1, len(live_replica_reports(pool, window_s=window_s)))
