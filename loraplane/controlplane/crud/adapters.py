"""Adapters and their immutable versions, scoped to one tenant.

A version row's number is the store's (the store's claim protocol hands out unique,
consecutive numbers); recording it is idempotent, so racing uploads and retries converge.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, Select, and_, case, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplane.controlplane.crud import audit
from loraplane.controlplane.errors import Conflict, NotFound, QuotaExceeded
from loraplane.controlplane.models import Adapter, AdapterVersion, Tenant, utcnow


@dataclass(frozen=True, slots=True)
class StoredVersion:
    """What the store holds for one version (from ingest's result or the operator)."""

    version: int
    digest: str
    path: str
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    base_model: str
    created_by: str
    # a verified signature's key, message and base64 signature (None: unsigned)
    signing_key_id: str | None = None
    signed_digest: str | None = None
    signature: str | None = None


@dataclass(frozen=True, slots=True)
class AdapterView:
    """An adapter with its current version row and its newest version number."""

    adapter: Adapter
    current: AdapterVersion | None
    latest_version: int | None


def _live(tenant_id: int, name: str) -> Select[Adapter]:
    return select(Adapter).where(
        Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted.is_(False)
    )


def get_adapter(session: Session, *, tenant: Tenant, name: str) -> Adapter:
    """A live adapter of `tenant`; NotFound otherwise (whoever else owns that name)."""
    adapter: Adapter | None = session.scalar(_live(tenant.id, name))
    if adapter is None:
        raise NotFound(f"adapter {name!r} not found")
    return adapter


def list_adapters(
    session: Session, *, tenant: Tenant, name: str | None = None
) -> list[AdapterView]:
    """A tenant's live adapters with their current versions, in one query."""
    latest = (
        select(AdapterVersion.adapter_id, func.max(AdapterVersion.version).label("latest"))
        .group_by(AdapterVersion.adapter_id)
        .subquery()
    )
    stmt = (
        select(Adapter, AdapterVersion, latest.c.latest)
        .outerjoin(
            AdapterVersion,
            and_(
                AdapterVersion.adapter_id == Adapter.id,
                AdapterVersion.version == Adapter.current_version,
            ),
        )
        .outerjoin(latest, latest.c.adapter_id == Adapter.id)
        .where(Adapter.tenant_id == tenant.id, Adapter.deleted.is_(False))
        .order_by(Adapter.name)
    )
    if name is not None:
        stmt = stmt.where(Adapter.name == name)
    return [AdapterView(a, v, n) for a, v, n in session.execute(stmt)]


def get_adapter_view(session: Session, *, tenant: Tenant, name: str) -> AdapterView:
    """One live adapter with its current version; NotFound otherwise."""
    views = list_adapters(session, tenant=tenant, name=name)
    if not views:
        raise NotFound(f"adapter {name!r} not found")
    return views[0]


def list_versions(session: Session, *, tenant: Tenant, name: str) -> list[AdapterVersion]:
    """Every recorded version of a live adapter, oldest first."""
    adapter = get_adapter(session, tenant=tenant, name=name)
    stmt = (
        select(AdapterVersion)
        .where(AdapterVersion.adapter_id == adapter.id)
        .order_by(AdapterVersion.version)
    )
    return list(session.scalars(stmt))


def set_current_version(
    session: Session, *, tenant: Tenant, name: str, version: int | None, actor: str
) -> Adapter:
    """Serve `version` and hold it (later pushes do not move it); with None, serve the latest
    version and follow later pushes again. Either ends a running rollout (crud/rollouts.py):
    the choice is what serves. NotFound, naming the versions there are, for a version that
    was never recorded."""
    adapter = get_adapter(session, tenant=tenant, name=name)
    if version is not None:
        recorded = list(
            session.scalars(
                select(AdapterVersion.version)
                .where(AdapterVersion.adapter_id == adapter.id)
                .order_by(AdapterVersion.version)
            )
        )
        if version not in recorded:
            raise NotFound(
                f"adapter {name!r} has no version {version}; its versions: "
                f"{version_ranges(recorded)}"
            )
    previous = (adapter.current_version, adapter.follow_latest)
    rollout_before = adapter.rollout
    adapter.rollout = None
    if version is None:  # the newest when the row is written: a push racing this one counts
        newest = select(func.max(AdapterVersion.version)).where(
            AdapterVersion.adapter_id == adapter.id
        )
        session.execute(
            update(Adapter)
            .where(Adapter.id == adapter.id)
            .values(current_version=newest.scalar_subquery(), follow_latest=True, rollout=None)
        )
        session.refresh(adapter)
    else:
        adapter.current_version = version
        adapter.follow_latest = False
    target = adapter.current_version
    audit.record(
        session,
        actor=actor,
        action="adapter.follow_latest" if version is None else "adapter.set_current_version",
        target=f"tenants/{tenant.name}/adapters/{name}",
        detail={
            "from": previous[0],
            "to": target,
            "follow_latest_before": previous[1],
            "follow_latest": adapter.follow_latest,
            **({"rollout_ended": rollout_before} if rollout_before else {}),
        },
    )
    session.commit()
    return adapter


def version_ranges(versions: list[int]) -> str:
    """Sorted version numbers in few words: [1, 2, 3, 5] -> "v1-v3, v5" ("none" if empty)."""
    if not versions:
        return "none"
    runs: list[list[int]] = []
    for v in versions:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"v{a}" if a == b else f"v{a}-v{b}" for a, b in runs)


def delete_adapter(session: Session, *, tenant: Tenant, name: str, actor: str) -> None:
    """Stop serving an adapter; its versions stay recorded and stored."""
    adapter = get_adapter(session, tenant=tenant, name=name)
    adapter.deleted = True
    audit.record(
        session,
        actor=actor,
        action="adapter.delete",
        target=f"tenants/{tenant.name}/adapters/{name}",
    )
    session.commit()


def count_live(session: Session, *, tenant: Tenant) -> int:
    """How many adapters the tenant serves (the max_adapters quota counts these)."""
    stmt = select(func.count(Adapter.id)).where(
        Adapter.tenant_id == tenant.id, Adapter.deleted.is_(False)
    )
    return int(session.scalar(stmt) or 0)


def check_adapter_quota(session: Session, *, tenant: Tenant, name: str) -> None:
    """QuotaExceeded if adding `name` would take the tenant past max_adapters."""
    if session.scalar(_live(tenant.id, name)) is not None:
        return
    if count_live(session, tenant=tenant) >= tenant.max_adapters:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} has reached its quota of {tenant.max_adapters} adapters "
            "(max_adapters); delete one (`loraplane adapters delete NAME` or the console's "
            "Delete) or ask for a higher quota"
        )


def _adapter_row(session: Session, *, tenant: Tenant, name: str, base_model: str) -> Adapter:
    """The tenant's adapter row for `name`, created (or revived) if needed (flushed)."""
    adapter = session.scalar(
        select(Adapter).where(Adapter.tenant_id == tenant.id, Adapter.name == name)
    )
    if adapter is None:
        check_adapter_quota(session, tenant=tenant, name=name)
        adapter = Adapter(tenant_id=tenant.id, name=name, base_model=base_model)
        session.add(adapter)
        session.flush()
    elif adapter.deleted:
        check_adapter_quota(session, tenant=tenant, name=name)
        adapter.deleted = False
        adapter.current_version = None
        adapter.rollout = None
        adapter.follow_latest = True  # a revived name starts afresh: it serves what is pushed
    return adapter


def record_version(
    session: Session, *, tenant: Tenant, name: str, stored: StoredVersion, actor: str
) -> tuple[Adapter, AdapterVersion, bool]:
    """Record a stored version (idempotent): (adapter, version row, whether it is new here).

    The adapter is created or revived if needed; while it follows its latest version, a new
    version becomes current unless a newer one already is; a chosen version (follow_latest
    false) keeps serving. Racing writers meet a unique constraint, roll back and retry, and
    then find the other's rows. Conflict if the number is recorded with another digest.
    """
    for _ in range(5):
        try:
            return _record_once(session, tenant=tenant, name=name, stored=stored, actor=actor)
        except IntegrityError:
            session.rollback()
    raise Conflict(f"adapter {name!r} is being changed concurrently; try again")


def _record_once(
    session: Session, *, tenant: Tenant, name: str, stored: StoredVersion, actor: str
) -> tuple[Adapter, AdapterVersion, bool]:
    adapter = _adapter_row(session, tenant=tenant, name=name, base_model=stored.base_model)
    row = _version_row(session, adapter.id, stored.version)
    created = row is None
    if row is None:
        row = AdapterVersion(adapter_id=adapter.id, **_fields(stored))
        session.add(row)
        session.flush()
    elif row.digest != stored.digest:
        session.rollback()
        raise Conflict(
            f"version {stored.version} of {name!r} is recorded with another digest; "
            "the store and the catalog disagree"
        )
    current = Adapter.current_version
    target: ColumnElement[int]
    if created:  # the newest version serves, whatever order racing uploads commit in
        # decided in the statement, so a version chosen meanwhile (PATCH) is never overridden
        moves = Adapter.follow_latest & (current < stored.version)
        target = case((current.is_(None) | moves, stored.version), else_=current)
    else:
        target = func.coalesce(current, stored.version)
    session.execute(
        update(Adapter)
        .where(Adapter.id == adapter.id)
        .values(current_version=target, updated_at=utcnow())
    )
    audit.record(
        session,
        actor=actor,
        action="adapter.version.create" if created else "adapter.version.match",
        target=f"tenants/{tenant.name}/adapters/{name}/versions/{stored.version}",
        detail={"digest": stored.digest, "signing_key_id": stored.signing_key_id},
    )
    session.commit()
    session.refresh(adapter)
    return adapter, row, created


def _version_row(session: Session, adapter_id: int, version: int) -> AdapterVersion | None:
    return session.scalar(
        select(AdapterVersion).where(
            AdapterVersion.adapter_id == adapter_id, AdapterVersion.version == version
        )
    )


def _fields(stored: StoredVersion) -> dict[str, object]:
    return {
        "version": stored.version,
        "digest": stored.digest,
        "path": stored.path,
        "rank": stored.rank,
        "alpha": stored.alpha,
        "target_modules": list(stored.target_modules),
        "size_bytes": stored.size_bytes,
        "base_model": stored.base_model,
        "created_by": stored.created_by,
        "signing_key_id": stored.signing_key_id,
        "signed_digest": stored.signed_digest,
        "signature": stored.signature,
    }
