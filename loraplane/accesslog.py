"""Access logs: one JSON line per HTTP request, for the control plane, the data plane and the
demo (each wraps its ASGI app where it builds its server: `wrap(app, service, logger)`).

A line holds `time` (UTC), `service`, `level`, `method`, `route` (the route's template,
`/v1/adapters/{name}`), `path` (the path itself) and `query` (values of parameters named like
a credential masked), `status`, `duration_ms` (to the last byte, streams included),
`bytes_in`, `bytes_out`, `tenant` (when the service knows the caller), `request_id` (the
client's `X-Request-ID` when it is a plain token, else a new one; sent back in the answer's
`X-Request-ID`) and `client`. A 5xx or an exception adds `error`: the service's error code and
message, or the exception's type and text. No header, no body, no prompt text is ever logged;
every text field passes through `redact` (tenant keys, bearer values, the service's tokens).
Probes and scrapes (`/health`, `/healthz`, `/ready`, `/readyz`, `/metrics`) are not logged
unless they fail with an exception: they come every few seconds.

On by default, to stderr. `--access-log off` / `LORAPLANE_ACCESS_LOG=off` turns it off;
`--access-log-file PATH` / `LORAPLANE_ACCESS_LOG_FILE` appends to a file instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplane.redact import RedactFilter, redact

QUIET_PATHS = frozenset({"/health", "/healthz", "/ready", "/readyz", "/metrics"})
REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# query parameters whose values are credentials, whatever they hold
_SECRET_PARAM = re.compile(r"(?i)(key|token|secret|passw|auth|signature|credential|session)")
_ERROR_BODY_MAX = 8192  # bytes of a 5xx answer read for its error code and message
_REASON_MAX = 500


class AccessLogError(ValueError):
    """A bad access-log setting; the message names the flag and the variable."""


class AccessLogSettings(BaseSettings):
    """`LORAPLANE_ACCESS_LOG` (on|off, default on) and `LORAPLANE_ACCESS_LOG_FILE`."""

    model_config = SettingsConfigDict(env_prefix="LORAPLANE_", extra="ignore")

    access_log: bool = Field(default=True, description="one JSON line per request")
    access_log_file: Path | None = Field(default=None, description="append there, not stderr")


def add_arguments(parser: argparse.ArgumentParser, default: str = "on") -> None:
    """`--access-log {on,off}` and `--access-log-file PATH` on a service's command (`default`:
    what its help says happens when neither they nor their variables are given)."""
    parser.add_argument(
        "--access-log",
        choices=["on", "off"],
        help="one JSON line per request on stderr: method, route, status, duration, tenant,"
        f" request id; never a header, body or prompt (default: {default}; LORAPLANE_ACCESS_LOG)",
    )
    parser.add_argument(
        "--access-log-file",
        metavar="PATH",
        help="append the access log to this file instead of stderr (LORAPLANE_ACCESS_LOG_FILE)",
    )


def chosen(args: argparse.Namespace) -> bool:
    """Whether the access log's flags or variables were given (else each service's default)."""
    flags = getattr(args, "access_log", None) is not None or getattr(args, "access_log_file", None)
    names = {f"LORAPLANE_{field}".upper() for field in AccessLogSettings.model_fields}
    return bool(flags) or any(key.upper() in names for key in os.environ)  # as pydantic reads them


def settings_from(args: argparse.Namespace) -> AccessLogSettings:
    """The environment's settings, overridden by the flags given; AccessLogError naming the
    variable when one is malformed."""
    try:
        env = AccessLogSettings()
    except ValidationError as exc:
        field = str(exc.errors()[0]["loc"][0])
        raise AccessLogError(
            f"LORAPLANE_{field.upper()}: {exc.errors()[0]['msg']} (on or off)"
        ) from None
    updates: dict[str, Any] = {}
    if getattr(args, "access_log", None) is not None:
        updates["access_log"] = args.access_log == "on"
    if getattr(args, "access_log_file", None):
        updates["access_log_file"] = Path(args.access_log_file)
    return env.model_copy(update=updates)


def make_logger(
    settings: AccessLogSettings, service: str, secrets: Iterable[str | None] = ()
) -> logging.Logger | None:
    """The logger `service`'s lines go to (None when the access log is off): its own handler
    (stderr or the file), the bare line as the message, secrets masked, not propagated."""
    if not settings.access_log:
        return None
    logger = logging.getLogger(f"loraplane.access.{service}")
    for old in list(logger.handlers):  # a second server in this process replaces the first's
        logger.removeHandler(old)
        old.close()
    handler: logging.Handler
    if settings.access_log_file is not None:
        try:
            handler = logging.FileHandler(settings.access_log_file, encoding="utf-8")
        except OSError as exc:
            raise AccessLogError(
                f"--access-log-file / LORAPLANE_ACCESS_LOG_FILE: cannot append to "
                f"{settings.access_log_file}: {exc.strerror or exc}"
            ) from None
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RedactFilter(secrets))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def wrap(app: ASGIApp, service: str, logger: logging.Logger | None) -> ASGIApp:
    """`app` with its requests logged to `logger` (`app` itself when there is none)."""
    if logger is None:
        return app
    return AccessLog(app, service, logger)


class AccessLog:
    """ASGI middleware writing one line per HTTP request (see the module's doc)."""

    def __init__(self, app: ASGIApp, service: str, logger: logging.Logger) -> None:
        self.app = app
        self.service = service
        self.logger = logger
        # whether every handler masks keys and tokens (make_logger's RedactFilter)
        self.masked = bool(logger.handlers) and all(
            any(isinstance(f, RedactFilter) for f in h.filters) for h in logger.handlers
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = _request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        seen: dict[str, Any] = {"status": None, "in": 0, "out": 0, "body": b""}

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen["in"] += len(message.get("body", b""))
            return message

        async def logging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != REQUEST_ID_HEADER]  # fmt: skip
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER,
                                                             request_id.encode())]}  # fmt: skip
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                seen["out"] += len(body)
                if (seen["status"] or 0) >= 500 and len(seen["body"]) < _ERROR_BODY_MAX:
                    seen["body"] += body[: _ERROR_BODY_MAX - len(seen["body"])]
            await send(message)

        error: str | None = None
        try:
            await self.app(scope, counting_receive, logging_send)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise
        finally:
            status = seen["status"] if seen["status"] is not None else 500
            # a probe's 503 is its answer (not ready yet), not an error of the service
            if error is not None or scope.get("path") not in QUIET_PATHS:
                if error is None and status >= 500:
                    error = _error_of(seen["body"])
                self._log(scope, state, request_id, status, start, seen, error)

    def _log(
        self, scope: Scope, state: dict[str, Any], request_id: str, status: int, start: float,
        seen: dict[str, Any], error: str | None,
    ) -> None:  # fmt: skip
        path = str(scope.get("path", ""))
        line: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "service": self.service,
            "level": "error" if status >= 500 or error else "warning" if status >= 400 else "info",
            "method": scope.get("method"),
            "route": _route(scope) or path,
            "path": path,
            "status": status,
            "duration_ms": round((time.perf_counter() - start) * 1000, 2),
            "bytes_in": seen["in"],
            "bytes_out": seen["out"],
            "tenant": state.get("tenant"),
            "request_id": request_id,
        }
        query = _query(scope.get("query_string", b""))
        if query:
            line["query"] = query
        client = scope.get("client")
        if client:
            line["client"] = str(client[0])
        if error:
            line["error"] = error[:_REASON_MAX]
        text = json.dumps(line, ensure_ascii=False)
        if not self.masked:  # make_logger's handler masks it (one pass per line is enough)
            text = redact(text)
        self.logger.log(logging.ERROR if line["level"] == "error" else logging.INFO, "%s", text)


def _request_id(scope: Scope) -> str:
    """The client's request id when it is a plain token (never a header echoed blindly)."""
    for name, value in scope.get("headers", []):
        if name.lower() == REQUEST_ID_HEADER:
            given = bytes(value).decode("latin-1")
            if _REQUEST_ID.match(given):
                return given
            break
    return uuid.uuid4().hex


def _route(scope: Scope) -> str | None:
    """The matched route's template (`/v1/adapters/{name}`), with a mount's prefix."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if not isinstance(template, str):
        return None
    root = str(scope.get("root_path", ""))
    return root + template if root and not template.startswith(root) else template


def _query(raw: bytes) -> str:
    """The query string with credential-named parameters' values masked."""
    if not raw:
        return ""
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    return "&".join(f"{k}={'***' if _SECRET_PARAM.search(k) else v}" for k, v in pairs)


def _error_of(body: bytes) -> str | None:
    """`code: message` from a 5xx answer's JSON error (both services' and OpenAI's shape)."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    err = document.get("error") if isinstance(document, dict) else None
    if isinstance(err, dict):
        code = err.get("code") or err.get("type")
        message = err.get("message") or ""
        return f"{code}: {message}" if code else str(message) or None
    if isinstance(document, dict) and isinstance(document.get("detail"), str):
        return str(document["detail"])
    return None
