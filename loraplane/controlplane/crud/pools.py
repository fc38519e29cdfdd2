"""Serving pools: registration, limits, and the pressure their replicas report."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplane.controlplane.crud import audit
from loraplane.controlplane.errors import AlreadyExists, Conflict, NotFound
from loraplane.controlplane.models import Pool, utcnow
from loraplane.controlplane.schemas.pools import PoolCreate, PoolUpdate

MAX_REPLICAS_KEPT = 1000
# a replica that reported within this many seconds counts as live: tenants' rate limits are
# split among the live replicas of a pool (each enforces its share)
LIVE_REPLICA_SECONDS = 30


def create_pool(
    session: Session,
    *,
    data: PoolCreate,
    actor: str,
    load_config: Callable[[str, str], dict[str, Any]],
) -> Pool:
    """Register a pool; its base model's config.json is read now (`load_config(uri, name)`)."""
    if session.scalar(select(Pool.id).where(Pool.name == data.name)) is not None:
        raise AlreadyExists(f"pool {data.name!r} already exists")
    config = load_config(data.base_model.uri, data.base_model.name)
    pool = Pool(
        name=data.name,
        base_model_name=data.base_model.name,
        base_model_uri=data.base_model.uri,
        base_model_config=config,
        max_lora_rank=data.max_lora_rank,
        max_loras=data.max_loras,
        max_cpu_loras=data.max_cpu_loras,
    )
    session.add(pool)
    audit.record(session, actor=actor, action="pool.create", target=f"pools/{data.name}")
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise AlreadyExists(f"pool {data.name!r} already exists") from None
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
    pool = session.scalar(select(Pool).where(Pool.name == data.name))
    if pool is None:
        try:
            return create_pool(session, data=data, actor=actor, load_config=load_config), True
        except AlreadyExists:  # created concurrently: update it below
            pool = get_pool(session, name=data.name)
    if (pool.base_model_name, pool.base_model_uri) != (data.base_model.name, data.base_model.uri):
        raise Conflict(
            f"pool {data.name!r} serves base model {pool.base_model_name!r} "
            f"({pool.base_model_uri}); a pool's base model cannot change"
        )
    limits = PoolUpdate(
        max_lora_rank=data.max_lora_rank, max_loras=data.max_loras, max_cpu_loras=data.max_cpu_loras
    )
    return update_pool(session, name=data.name, data=limits, actor=actor), False


def delete_pool(session: Session, *, name: str, actor: str) -> None:
    """Forget a pool (uploads for its base model then need another pool)."""
    pool = get_pool(session, name=name)
    session.delete(pool)
    audit.record(session, actor=actor, action="pool.delete", target=f"pools/{name}")
    session.commit()


def list_pools(session: Session) -> list[Pool]:
    """Every pool, by name."""
    return list(session.scalars(select(Pool).order_by(Pool.name)))


def get_pool(session: Session, *, name: str) -> Pool:
    """A pool by name; NotFound otherwise."""
    pool = session.scalar(select(Pool).where(Pool.name == name))
    if pool is None:
        raise NotFound(f"pool {name!r} not found")
    return pool


def update_pool(session: Session, *, name: str, data: PoolUpdate, actor: str) -> Pool:
    """Change a pool's LoRA limits (the fields given)."""
    pool = get_pool(session, name=name)
    changes = data.model_dump(exclude_unset=True, exclude_none=True)
    for field, value in changes.items():
        setattr(pool, field, value)
    audit.record(session, actor=actor, action="pool.update", target=f"pools/{name}", detail=changes)
    session.commit()
    return pool


def pools_for_base_model(session: Session, *, base_model: str) -> list[Pool]:
    """The pools serving `base_model` (an upload must fit every one of them)."""
    stmt = select(Pool).where(Pool.base_model_name == base_model).order_by(Pool.id)
    return list(session.scalars(stmt))


def record_pressure(session: Session, *, name: str, replica: str, report: dict[str, Any]) -> Pool:
    """Keep a replica's latest report in the pool's pressure (one entry per replica).

    Not audited: reports arrive every few seconds and change no desired state.
    """
    pool = session.scalar(select(Pool).where(Pool.name == name).with_for_update())
    if pool is None:
        raise NotFound(f"pool {name!r} not found")
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


def live_replicas(pool: Pool, *, window_s: float = LIVE_REPLICA_SECONDS) -> int:
    """Replicas of `pool` that reported within `window_s` seconds (at least 1)."""
    horizon = utcnow().timestamp() - window_s
    live = 0
    for entry in ((pool.pressure or {}).get("replicas") or {}).values():
        try:
            if datetime.fromisoformat(str(entry.get("time"))).timestamp() >= horizon:
                live += 1
        except (AttributeError, ValueError):
            continue
    return max(1, live)
