"""Tenant route: the caller's usage, per adapter and day."""

from __future__ import annotations

from datetime import date

from fastapi import APIRouter

from loraplane.controlplane.api.deps import CallerDep, SessionDep
from loraplane.controlplane.api.responses import errors
from loraplane.controlplane.crud.usage import list_usage
from loraplane.controlplane.schemas.adapters import UsagePublic

router = APIRouter(prefix="/v1/usage", tags=["tenant: usage"], responses=errors(400, 401, 429))


@router.get("", response_model=list[UsagePublic])
def get_usage(
    session: SessionDep,
    caller: CallerDep,
    start: date | None = None,
    end: date | None = None,
) -> list[UsagePublic]:
    """Requests and tokens per adapter ("" is the base model) and UTC day, `start` to `end`."""
    rows = list_usage(session, tenant=caller.tenant, start=start, end=end)
    return [UsagePublic.model_validate(r) for r in rows]
