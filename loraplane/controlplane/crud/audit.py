"""Audit events: who did what to which resource, and how it ended."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from loraplane.controlplane.db import session_scope
from loraplane.controlplane.models import AuditEvent

SUCCESS = "success"


def record(
    session: Session,
    *,
    actor: str,
    action: str,
    target: str,
    outcome: str = SUCCESS,
    detail: dict[str, Any] | None = None,
) -> AuditEvent:
    """Add an audit event to the session's transaction (committed with the change)."""
    event = AuditEvent(actor=actor, action=action, target=target, outcome=outcome, detail=detail)
    session.add(event)
    return event


def record_failure(
    factory: sessionmaker[Session],
    *,
    actor: str,
    action: str,
    target: str,
    outcome: str,
    detail: dict[str, Any] | None = None,
) -> None:
    """Record a refused change in its own transaction (the change itself was rolled back)."""
    with session_scope(factory) as session:
        record(session, actor=actor, action=action, target=target, outcome=outcome, detail=detail)
        session.commit()


def list_events(session: Session, *, limit: int = 100) -> list[AuditEvent]:
    """The newest events first."""
    from sqlalchemy import select

    stmt = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
    return list(session.scalars(stmt))
