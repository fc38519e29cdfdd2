"""Usage counters per tenant, adapter and UTC day, fed by the data plane's reports."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from loraplane.controlplane.models import Tenant, Usage
from loraplane.controlplane.schemas.internal import AdapterUsage


def add_usage(session: Session, *, rows: Sequence[AdapterUsage], day: date) -> tuple[int, int]:
    """Add counters to the day's rows (an atomic upsert each): (recorded, skipped).

    Rows for tenants the catalog does not know are skipped, not errors: a report must not
    fail because one tenant was deleted meanwhile.
    """
    names = {r.tenant for r in rows}
    if not names:
        return 0, 0
    ids = dict(session.execute(select(Tenant.name, Tenant.id).where(Tenant.name.in_(names))).all())
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    recorded = 0
    for r in rows:
        tenant_id = ids.get(r.tenant)
        if tenant_id is None:
            continue
        stmt = insert(Usage).values(
            tenant_id=tenant_id,
            adapter=r.adapter,
            day=day,
            requests=r.requests,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[Usage.tenant_id, Usage.adapter, Usage.day],
            set_={
                "requests": Usage.requests + stmt.excluded.requests,
                "prompt_tokens": Usage.prompt_tokens + stmt.excluded.prompt_tokens,
                "completion_tokens": Usage.completion_tokens + stmt.excluded.completion_tokens,
            },
        )
        session.execute(stmt)
        recorded += 1
    return recorded, len(rows) - recorded


def list_usage(
    session: Session, *, tenant: Tenant, start: date | None = None, end: date | None = None
) -> list[Usage]:
    """A tenant's usage rows from `start` to `end` (inclusive), by day then adapter."""
    stmt = select(Usage).where(Usage.tenant_id == tenant.id)
    if start is not None:
        stmt = stmt.where(Usage.day >= start)
    if end is not None:
        stmt = stmt.where(Usage.day <= end)
    return list(session.scalars(stmt.order_by(Usage.day, Usage.adapter)))
