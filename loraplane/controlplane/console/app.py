"""The console's web app, mounted at `/console` by `create_app`.

It serves a fixed list of files (nothing else: no paths, no listing), the reason codes in words
(`reasons.json`, built from the Python source of the codes), and the little the pages need to
know (`config.json`). Every answer, errors included, carries the security headers below.
"""

from __future__ import annotations

import inspect
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplane.adapters.errors import EXPLANATIONS, ReasonCode
from loraplane.controlplane.crud.jobs import INTERRUPTED, INTERRUPTED_MESSAGE
from loraplane.controlplane.errors import ControlPlaneError

PATH = "/console"
# Scripts, styles, images and connections from this origin only; no inline script or style,
# no plugins, no framing, no <base>, forms post only here.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}
# The shipped files and their media types: the only names served.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "dom.js": "text/javascript; charset=utf-8",
    "format.js": "text/javascript; charset=utf-8",
    "tenant.js": "text/javascript; charset=utf-8",
    "upload.js": "text/javascript; charset=utf-8",
    "usage.js": "text/javascript; charset=utf-8",
    "admin.js": "text/javascript; charset=utf-8",
    "adapter.js": "text/javascript; charset=utf-8",
    "confirm.js": "text/javascript; charset=utf-8",
    "rollout.js": "text/javascript; charset=utf-8",
    "pins.js": "text/javascript; charset=utf-8",
}
# Codes that are plain strings rather than classes.
OTHER_CODES = {
    "StoreUnavailable": "The adapter store could not be reached; try again shortly.",
    "InternalError": "Something failed inside the control plane; try again, and tell the "
    "operators if it persists.",
    INTERRUPTED: INTERRUPTED_MESSAGE[0].upper() + INTERRUPTED_MESSAGE[1:] + ".",
}


def reasons() -> dict[str, str]:
    """Every error code the console may show, with a sentence for people: the adapter reason
    codes' explanations, then each control plane error's docstring (its first paragraph)."""
    out = {code.value: EXPLANATIONS[code] for code in ReasonCode}
    pending: list[type[ControlPlaneError]] = [ControlPlaneError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        doc = inspect.getdoc(cls) or ""
        own = cls is not ControlPlaneError and "code" in vars(cls)  # not an inherited code
        if own and doc and cls.code not in out:
            out[cls.code] = " ".join(doc.split("\n\n")[0].split())
    for code, text in OTHER_CODES.items():
        out.setdefault(code, text)
    return out


class SecurityHeaders:
    """Add `SECURITY_HEADERS` to every response of the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [
                    (k.encode(), v.encode())
                    for k, v in SECURITY_HEADERS.items()
                    if k.encode() not in names
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


async def to_index(_: Request) -> Response:
    """`/console` (no slash) -> `/console/`, so the pages' relative URLs resolve under it."""
    return RedirectResponse(PATH + "/", status_code=308, headers=SECURITY_HEADERS)


def create_console_app(*, dataplane_url: str | None) -> Starlette:
    """The console app; `dataplane_url` is what its examples call (None: the page's host,
    port 8000)."""
    folder = resources.files("loraplane.controlplane.console")
    content = {name: folder.joinpath(name).read_bytes() for name in FILES}
    config: dict[str, Any] = {"dataplane_url": dataplane_url}

    async def static(request: Request) -> Response:
        name = request.path_params.get("name") or "index.html"
        if name == "reasons.json":
            return JSONResponse(reasons())
        if name == "config.json":
            return JSONResponse(config)
        if name not in content:
            return PlainTextResponse("not found", status_code=404)
        return Response(content[name], media_type=FILES[name])

    return Starlette(
        routes=[Route("/", static), Route("/{name}", static)],
        middleware=[Middleware(SecurityHeaders)],
    )
