"""Domain errors of the data plane server, and the one place that maps them to HTTP.

Code below the routes raises the exceptions here and knows nothing of HTTP;
`install_error_handlers` answers each in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with its status (and Retry-After on 429 and
503). Request validation failures (malformed JSON, wrong types) answer 400
`invalid_request_error` as OpenAI does; anything unforeseen answers a 500 without a stack trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client: HTTP status, OpenAI error type and code, a message."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(APIError):
    """A parameter is missing, malformed, out of range or not supported (400)."""


class AdapterRefused(APIError):
    """An adapter this replica refuses, for good: a validation rule or one of its limits (400,
    `code` the adapter reason code, e.g. `RankTooLarge`, or `TooLarge` for a version heavier
    than the whole --max-cpu-lora-bytes). No Retry-After: sending it again cannot help."""


class ContextTooLong(APIError):
    """Prompt plus max_tokens do not fit in the model's context (400)."""

    code = "context_length_exceeded"


class Unauthorized(APIError):
    """No API key, or a wrong one (401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(APIError):
    """The credential is valid but may not use this route (403)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class ModelNotFound(APIError):
    """The model is neither the base model nor one of the caller's adapters (404)."""

    status = 404
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
        )


class ModelUnloading(APIError):
    """The request's adapter is being unloaded from this replica (404): refused at once while
    the requests it already runs finish. The message names the model as the caller sent it."""

    status = 404
    code = "model_unloading"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` is being unloaded from this replica and takes no new"
            " requests; those already running finish.",
            param="model",
        )


class NotFound(APIError):
    """Another resource (a route, an adapter to unload) that does not exist (404)."""

    status = 404
    code = "not_found"


class PinsDoNotFit(APIError):
    """A pin past this replica's cap of pinned adapter memory or slots (409)."""

    status = 409
    code = "PinsDoNotFit"


class RateLimited(APIError):
    """The tenant is over its requests or tokens per minute (429 with Retry-After)."""

    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class Unavailable(APIError):
    """The server is loading, shutting down, or a dependency is unreachable (503)."""

    status = 503
    type = "server_error"
    code = "unavailable"


class UnloadTimeout(APIError):
    """An adapter's running requests did not finish within LORAPLANE_UNLOAD_TIMEOUT_S (503
    with Retry-After): the unload is given up and the adapter served as before."""

    status = 503
    type = "server_error"
    code = "unload_timeout"


class AdapterLoadTimeout(APIError):
    """The request's adapter was not loaded within the engine's deadline (504): the message
    names the adapter, never where it is stored."""

    status = 504
    type = "server_error"
    code = "AdapterLoadTimeout"


class UpstreamError(APIError):
    """The control plane answered something unusable (502)."""

    status = 502
    type = "server_error"
    code = "bad_gateway"


def error_response(error: APIError) -> JSONResponse:
    """The JSON response for `error`, with Retry-After when a retry helps."""
    headers: dict[str, str] = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(error.retry_after + 0.999)))
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return f"{where}{first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's error shape."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return error_response(InvalidRequest(message, param=param))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error = APIError(str(exc.detail))
        error.status = exc.status_code
        error.code = "not_found" if exc.status_code == 404 else None
        return error_response(error)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        error = APIError("internal server error")
        error.status, error.type = 500, "server_error"
        return error_response(error)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
