"""Prometheus metrics of the control plane: requests by route and status, and latency.

A pure ASGI middleware (no per-request task or body buffering). Routes are labelled by their
template (`/v1/adapters/{name}`), never by the raw path, so label sets stay bounded.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The control plane's metrics, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "loraplane_controlplane_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "loraplane_controlplane_request_duration_seconds",
            "HTTP request latency, by route template and method",
            ["route", "method"],
            buckets=BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


def route_template(scope: Scope) -> str:
    """The matched route's path template, or "unmatched"."""
    app = scope.get("app")
    router = getattr(app, "router", None)
    for route in getattr(router, "routes", ()):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", "unmatched"))
    return "unmatched"


class MetricsMiddleware:
    """Count and time every HTTP request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = str(getattr(route, "path", "")) or route_template(scope)
            method = scope.get("method", "")
            self.metrics.requests.labels(template, method, str(status)).inc()
            self.metrics.latency.labels(template, method).observe(time.perf_counter() - start)
