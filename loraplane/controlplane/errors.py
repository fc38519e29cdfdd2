"""Domain errors, and the one place that maps every error to an HTTP answer.

Code deep in the control plane (crud, ingest, auth) raises the exceptions at the top of this
module and knows nothing of HTTP. `install_error_handlers` turns each into
`{"error": {"code": ..., "message": ...}}` with the status in `STATUS`, adds Retry-After where
a retry helps (429, 503), and answers anything unforeseen with a generic 500 that carries no
stack trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.adapters.errors import AdapterRejected, ReasonCode, StoreError

log = logging.getLogger(__name__)


class ControlPlaneError(Exception):
    """Base of the control plane's domain errors: a machine-readable code and a message."""

    code = "Error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequest(ControlPlaneError):
    """The request is malformed (body shape, content type, multipart parts)."""

    code = "InvalidRequest"


class Unauthorized(ControlPlaneError):
    """No credential, an unknown one, or one of the wrong kind for this route."""

    code = "Unauthorized"


class NotFound(ControlPlaneError):
    """No such resource for this caller (another tenant's resource is not found either)."""

    code = "NotFound"


class AlreadyExists(ControlPlaneError):
    """A resource with this name exists already."""

    code = "AlreadyExists"


class Conflict(ControlPlaneError):
    """The request contradicts recorded state (e.g. another digest for a version number)."""

    code = "Conflict"


class BaseModelPending(Conflict):
    """Every pool serving the base model waits for a replica to report its config.json (the
    model is only on the pools' volumes): uploads cannot be validated yet; retry later."""

    code = "BaseModelPending"


class QuotaExceeded(ControlPlaneError):
    """A tenant quota that is not a property of one adapter (the adapter count) is used up."""

    code = "QuotaExceeded"


class UnknownBaseModel(ControlPlaneError):
    """No pool serves the requested base model."""

    code = "UnknownBaseModel"


class InvalidBaseModel(ControlPlaneError):
    """A pool's base model config.json cannot be read or is not a supported architecture."""

    code = "InvalidBaseModel"


class SourceNotAllowed(ControlPlaneError):
    """An import source outside the allowlisted S3 buckets."""

    code = "SourceNotAllowed"


class SourceNotFound(ControlPlaneError):
    """An allowlisted import source that holds no adapter."""

    code = "SourceNotFound"


class PayloadTooLarge(ControlPlaneError):
    """The request body is over the upload size cap."""

    code = "PayloadTooLarge"


class RetryLater(ControlPlaneError):
    """A condition that passes with time; the answer carries Retry-After."""

    def __init__(self, message: str, *, retry_after: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = max(1, retry_after)


class RateLimited(RetryLater):
    """The key used up its requests per minute."""

    code = "RateLimited"


class DatabaseUnavailable(RetryLater):
    """The catalog database cannot be reached."""

    code = "DatabaseUnavailable"


# The one registry: domain error -> HTTP status.
STATUS: dict[type[ControlPlaneError], int] = {
    InvalidRequest: 400,
    Unauthorized: 401,
    NotFound: 404,
    AlreadyExists: 409,
    Conflict: 409,
    QuotaExceeded: 409,
    PayloadTooLarge: 413,
    UnknownBaseModel: 422,
    InvalidBaseModel: 422,
    SourceNotAllowed: 422,
    SourceNotFound: 422,
    RetryLater: 503,  # a dependency that comes back (the database, the Kubernetes API)
    RateLimited: 429,
    DatabaseUnavailable: 503,
}
# Adapter core errors, by the same table's rules.
REJECTED_STATUS = 422
STORE_UNAVAILABLE = ("StoreUnavailable", 503)
HTTP_CODES = {
    400: "InvalidRequest",
    401: "Unauthorized",
    404: "NotFound",
    405: "MethodNotAllowed",
    413: "PayloadTooLarge",
    415: "UnsupportedMediaType",
}


def status_of(exc: ControlPlaneError) -> int:
    """The HTTP status of a domain error (the nearest registered class wins)."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_body(code: str, message: str) -> dict[str, Any]:
    """The JSON shape of every error answer."""
    return {"error": {"code": code, "message": message}}


def error_response(
    status: int, code: str, message: str, retry_after: int | None = None
) -> JSONResponse:
    """An error answer; Retry-After when the client should come back later."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI, *, retry_after: int) -> None:
    """Map every error to its JSON answer on `app` (the only HTTP mapping there is)."""

    async def domain(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlPlaneError)
        later = exc.retry_after if isinstance(exc, RetryLater) else None
        return error_response(status_of(exc), exc.code, exc.message, later)

    async def rejected(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, AdapterRejected)
        return error_response(REJECTED_STATUS, ReasonCode(exc.code).value, exc.message)

    async def store(_: Request, exc: Exception) -> JSONResponse:
        log.warning("object store error: %s", exc)
        code, status = STORE_UNAVAILABLE
        return error_response(status, code, "the adapter store is unavailable", retry_after)

    async def database(_: Request, exc: Exception) -> JSONResponse:
        lost = isinstance(exc, OperationalError | DisconnectionError | PoolTimeout)
        if isinstance(exc, DBAPIError) and not lost and not exc.connection_invalidated:
            return await unexpected(_, exc)
        log.warning("database unavailable: %s", type(exc).__name__)
        return error_response(
            503, "DatabaseUnavailable", "the catalog database is unavailable", retry_after
        )

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(400, "InvalidRequest", _describe_validation(exc))

    async def http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = HTTP_CODES.get(exc.status_code, "Error")
        return error_response(exc.status_code, code, str(exc.detail))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return error_response(500, "InternalError", "internal error")

    app.add_exception_handler(ControlPlaneError, domain)
    app.add_exception_handler(AdapterRejected, rejected)
    app.add_exception_handler(StoreError, store)
    for db_error in (OperationalError, DisconnectionError, PoolTimeout, DBAPIError):
        app.add_exception_handler(db_error, database)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http)
    app.add_exception_handler(Exception, unexpected)
