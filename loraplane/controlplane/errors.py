"""Domain errors, and the one place that maps every error to an HTTP answer.

Code deep in the control plane (crud, ingest, auth) raises the exceptions at the top of this
module and knows nothing of HTTP. `install_error_handlers` turns each into
`{"error": {"code": ..., "message": ...}}` with the status in `STATUS`, adds Retry-After where
a retry helps (429, 503), and answers anything unforeseen with a generic 500 that carries no
stack trace. A refused request body or parameter (pydantic's errors) becomes 400 InvalidRequest
whose message names each field and what it must be, in words (`describe_errors`: the rules of
`schemas/common.py` and the error types below), with `errors` listing them for programs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.adapters.errors import AdapterRejected, ReasonCode, StoreError
from loraplane.controlplane.schemas.common import rule_for_pattern
from loraplane.redact import redact

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
    """The request was refused as sent: a field's value, the body's shape, its content type
    or its multipart parts (the message names the field and what it must be).

    `problems` lists each refused field for programs (the answer's `errors`), when known.
    """

    code = "InvalidRequest"

    def __init__(
        self, message: str, *, code: str | None = None, problems: list[dict[str, str]] | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.problems = problems


class Unauthorized(ControlPlaneError):
    """No credential, an unknown one, or one of the wrong kind for this route."""

    code = "Unauthorized"


class Forbidden(ControlPlaneError):
    """The caller is known but this action is not theirs to take (the message says whose)."""

    code = "Forbidden"


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


class PinsDoNotFit(ControlPlaneError):
    """Pinned versions would not fit on the pool's replicas (the message names the numbers)."""

    code = "PinsDoNotFit"


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
    Forbidden: 403,
    NotFound: 404,
    AlreadyExists: 409,
    Conflict: 409,
    QuotaExceeded: 409,
    PinsDoNotFit: 409,
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
    403: "Forbidden",
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


# pydantic's error types, in words (after the field's name); the table's rules have their own
_WORDS = {
    "missing": "required",
    "extra_forbidden": "not a field of this request (unknown fields are refused)",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
    "list_type": "must be a list",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "string_too_short": "must be at least {min_length} characters",
    "string_too_long": "must be at most {max_length} characters",
}
_SOURCES = ("body", "query", "path", "header", "cookie")
MAX_GOT = 80  # characters of a refused value echoed back
MAX_SHOWN = 5  # refused fields named in the message


def got(value: Any) -> str:
    """A refused value as the message echoes it: a string in double quotes (cut at MAX_GOT
    characters; anything shaped like a key masked), a number or true/false/null as in JSON."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    text = str(value)
    cut = text[:MAX_GOT] + ("..." if len(text) > MAX_GOT else "")
    shown = f'"{cut}"' if cut.isprintable() else json.dumps(cut)
    return redact(shown, ())


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = list(loc)
    if parts and parts[0] in _SOURCES:
        parts = parts[1:]
    return ".".join(str(p) for p in parts) or "body"


def _problem(err: Mapping[str, Any]) -> dict[str, str]:
    """One pydantic error as {field, message, type, detail}: the message in words."""
    kind = str(err.get("type", ""))
    ctx = err.get("ctx") or {}
    raw = str(err.get("msg", "invalid"))
    field = _field(err.get("loc", ()))
    echo = True
    if kind == "invalid_value":  # a rule of the table (schemas/common.py): already in words
        words, raw = raw, str(ctx.get("detail", raw))
    elif kind == "json_invalid":
        field, echo = "body", False
        words = f"not valid JSON ({ctx.get('error', 'decode error')})"
    elif kind == "string_pattern_mismatch":
        rule = rule_for_pattern(str(ctx.get("pattern", "")))
        words = f"must be {rule.words}" if rule else "is not in the form this field takes"
    elif kind in _WORDS:
        try:
            words = _WORDS[kind].format(**ctx)
        except (KeyError, IndexError, ValueError):
            words = raw
        echo = kind not in ("missing", "extra_forbidden") and not kind.endswith("_type")
    else:
        words = raw
    if echo and "input" in err:
        words += f" (got {got(err['input'])})"
    return {"field": field, "message": words, "type": kind, "detail": raw}


def describe_errors(errors: Sequence[Mapping[str, Any]]) -> InvalidRequest:
    """The InvalidRequest for pydantic's errors: a message naming each field (the first
    MAX_SHOWN) and what it must be, in words, and every problem for programs."""
    problems = [_problem(e) for e in errors]
    parts = [f"{p['field']}: {p['message']}" for p in problems[:MAX_SHOWN]]
    if len(problems) > MAX_SHOWN:
        parts.append(f"and {len(problems) - MAX_SHOWN} more")
    return InvalidRequest("; ".join(parts) or "invalid request", problems=problems)


def invalid_response(exc: InvalidRequest) -> JSONResponse:
    """400 InvalidRequest with the refused fields listed (`errors`) beside the message."""
    body = error_body(exc.code, exc.message)
    if exc.problems is not None:
        body["error"]["errors"] = exc.problems
    return JSONResponse(body, status_code=STATUS[InvalidRequest])


def install_error_handlers(app: FastAPI, *, retry_after: int) -> None:
    """Map every error to its JSON answer on `app` (the only HTTP mapping there is)."""

    async def domain(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlPlaneError)
        if isinstance(exc, InvalidRequest) and exc.problems is not None:
            return invalid_response(exc)
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
        return invalid_response(describe_errors(exc.errors()))

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
