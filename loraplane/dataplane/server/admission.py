"""Bounded work at the door: queue caps per replica and per tenant, and a request body cap.

A replica holds at most `max_queued_requests` engine requests (a request with `n` choices over
`p` prompts counts n x p) and one tenant at most `max_queued_requests_per_tenant` of them;
past either the request answers 429 with Retry-After before anything is tokenized or loaded,
so one tenant's backlog cannot grow the replica's queue (and each step's work) without bound
or take the seats of the others. `BodyLimit` answers 413 to a request body over
`max_request_bytes` before the route parses it. Every refusal is counted in
`loraplane_requests_refused_total{reason}`.
"""

from __future__ import annotations

import json
from collections import Counter

from prometheus_client import Counter as PromCounter

from loraplane.dataplane.server.errors import InvalidRequest, RateLimited
from loraplane.dataplane.server.request_metrics import ASGIApp, Message, Receive, Scope, Send

REASONS = ("queue_full", "tenant_queue_full", "too_many_prompts", "body_too_large")


class QueueFull(RateLimited):
    """The replica, or the tenant's share of it, holds as many requests as it may (429)."""

    code = "queue_full"


class QueueLimits:
    """Engine requests in flight per tenant and in total, within their caps."""

    def __init__(self, total: int, per_tenant: int, refused: PromCounter) -> None:
        self.total, self.per_tenant = total, per_tenant
        self.refused = refused
        self._by_tenant: Counter[str] = Counter()
        self._count = 0

    def enter(self, tenant: str, requests: int) -> None:
        """Take `requests` places for `tenant`, or raise QueueFull (429); InvalidRequest (400)
        for a request larger than a tenant's whole share, which could never get in."""
        if requests > min(self.per_tenant, self.total):
            self.refused.labels(reason="too_many_prompts").inc()
            raise InvalidRequest(
                f"this request asks for {requests} completions (prompts x n); at most"
                f" {min(self.per_tenant, self.total)} fit: send fewer prompts or a lower n",
                param="prompt",
            )
        if self._by_tenant[tenant] + requests > self.per_tenant:
            self.refused.labels(reason="tenant_queue_full").inc()
            raise QueueFull(
                f"tenant {tenant!r} has {self._by_tenant[tenant]} requests in flight on this"
                f" replica (at most {self.per_tenant}); retry shortly",
                retry_after=1,
            )
        if self._count + requests > self.total:
            self.refused.labels(reason="queue_full").inc()
            raise QueueFull(
                f"this replica has {self._count} requests in flight (at most {self.total});"
                " retry shortly",
                retry_after=1,
            )
        self._by_tenant[tenant] += requests
        self._count += requests

    def leave(self, tenant: str, requests: int) -> None:
        """Give back places taken by `enter` (the tenant's entry goes at 0: no growth)."""
        self._count -= requests
        self._by_tenant[tenant] -= requests
        if self._by_tenant[tenant] <= 0:
            del self._by_tenant[tenant]

    def in_flight(self, tenant: str | None = None) -> int:
        """Requests in flight, of one tenant or in total."""
        return self._count if tenant is None else self._by_tenant[tenant]


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes` (Content-Length or counted)."""

    def __init__(self, app: ASGIApp, max_bytes: int, refused: PromCounter) -> None:
        self.app, self.max_bytes, self.refused = app, max_bytes, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        body, more = bytearray(), True
        while more:  # JSON bodies: read whole (the route would), stopping past the cap
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._refuse(send)
                return
        await self.app(
            scope, _replay([{"type": "http.request", "body": bytes(body)}], receive), send
        )

    async def _refuse(self, send: Send) -> None:
        self.refused.labels(reason="body_too_large").inc()
        payload = json.dumps({"error": {
            "message": f"the request body is over {self.max_bytes} bytes",
            "type": "invalid_request_error", "param": None, "code": "request_too_large",
        }}).encode()  # fmt: skip
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A `receive` that hands out `messages`, then defers to `then` (client disconnects)."""
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
