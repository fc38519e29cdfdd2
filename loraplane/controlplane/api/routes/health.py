"""Liveness, readiness and metrics (no credentials: they reveal no tenant data)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy import text

from loraplane.controlplane.api.deps import ContextDep
from loraplane.controlplane.errors import DatabaseUnavailable
from loraplane.controlplane.metrics import CONTENT_TYPE

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "the database is unreachable"}})
def readyz(ctx: ContextDep) -> dict[str, str]:
    """The catalog database answers."""
    try:
        with ctx.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        raise DatabaseUnavailable(
            "the catalog database is unavailable", retry_after=ctx.settings.retry_after_seconds
        ) from exc
    return {"status": "ready"}


@router.get("/metrics", response_class=Response)
def metrics(ctx: ContextDep) -> Response:
    """Prometheus text: requests by route, method and status; latency by route."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
