"""OpenAPI descriptions of the error answers each route can give."""

from __future__ import annotations

from typing import Any

from loraplane.controlplane.schemas.common import ErrorBody, RequestErrorBody

_WHY = {
    400: "refused as sent (InvalidRequest): the message names each field and what it must be "
    "(`errors` lists them), or what is wrong with the body's shape, content type or parts",
    401: "missing, unknown or wrong kind of credential (Unauthorized)",
    403: "an action the admin keeps for itself for this tenant (Forbidden, or the code named)",
    404: "no such resource for this caller (NotFound)",
    409: "conflicts with existing state (AlreadyExists, Conflict, QuotaExceeded), or "
    "BaseModelPending (retry later)",
    413: "body over the upload size cap (PayloadTooLarge)",
    422: "adapter rejected (its ReasonCode), or UnknownBaseModel, InvalidBaseModel, Source*",
    429: "over the key's requests per minute (RateLimited); see Retry-After",
    503: "database or store unavailable; see Retry-After",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: the error shape under each status it can answer."""
    return {
        s: {"model": RequestErrorBody if s == 400 else ErrorBody, "description": _WHY[s]}
        for s in (*statuses, 503)
    }
