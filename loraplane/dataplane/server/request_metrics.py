"""`loraplane_requests_total{tenant,code}`: every generation request, by tenant and status;
`loraplane_adapter_version_requests_total{tenant,adapter,version}` and `..._errors_total`
(a 5xx answer) for requests the route resolved to an adapter version (a rollout is judged by
them; the version is the one the request ran with, a split's pick included). A stream that
fails after its 200 went out (the engine died mid-way: its last event is an error) is counted
as its version's error too: the stream notes the error's status (`stream_failed`) and the
middleware reads it once the response is over.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streaming
responses and hide client disconnects): it reads the status from the response's first message
and the tenant the route resolved from the request's state (`unknown` before authentication).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import Counter
from starlette.requests import Request

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
STREAM_ERROR = "stream_error"  # request state: the status of the error a started stream hit


def stream_failed(request: Request, status: int) -> None:
    """Note that `request`'s stream, its 200 sent, ended with an error of HTTP `status`."""
    setattr(request.state, STREAM_ERROR, status)


class RequestCounter:
    """Counts generation requests per tenant and HTTP status code."""

    def __init__(
        self,
        app: ASGIApp,
        counter: Counter,
        versions: Counter | None = None,
        version_errors: Counter | None = None,
    ) -> None:
        self.app = app
        self.counter = counter
        self.versions, self.version_errors = versions, version_errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in COUNTED_PATHS:
            await self.app(scope, receive, send)
            return

        started: list[int] = []  # the status sent

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(message["status"])
                state = scope.get("state", {})
                tenant = state.get("tenant") or "unknown"
                self.counter.labels(tenant=tenant, code=str(message["status"])).inc()
                ran = state.get("adapter_version")  # (adapter, version), set by the route
                if ran is not None and self.versions is not None:
                    labels = {"tenant": tenant, "adapter": ran[0], "version": ran[1]}
                    self.versions.labels(**labels).inc()
                    if message["status"] >= 500 and self.version_errors is not None:
                        self.version_errors.labels(**labels).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
        state = scope.get("state", {})
        late, ran = state.get(STREAM_ERROR), state.get("adapter_version")
        # a 5xx answered at once was counted above; a started stream's 5xx only now
        late_5xx = late is not None and late >= 500 and bool(started) and started[0] < 500
        if late_5xx and ran is not None and self.version_errors is not None:
            tenant = state.get("tenant") or "unknown"
            self.version_errors.labels(tenant=tenant, adapter=ran[0], version=ran[1]).inc()
