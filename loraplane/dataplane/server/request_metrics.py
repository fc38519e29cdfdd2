"""`loraplane_requests_total{tenant,code}`: every generation request, by tenant and status.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streaming
responses and hide client disconnects): it reads the status from the response's first message
and the tenant the route resolved from the request's state (`unknown` before authentication).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import Counter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class RequestCounter:
    """Counts generation requests per tenant and HTTP status code."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in COUNTED_PATHS:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                tenant = scope.get("state", {}).get("tenant") or "unknown"
                self.counter.labels(tenant=tenant, code=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
