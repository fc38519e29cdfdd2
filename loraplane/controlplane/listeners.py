"""The control plane's two ports: public (tenants' and admins' REST API) and, with
`loraplane controlplane --internal-port`, internal (what the operator and the data plane
call, and /metrics).

One app serves both; `PublicPortGuard` answers the internal routes and /metrics with the same
404 as an unknown path when a request arrived on any other port than the internal one, so a
NetworkPolicy on the internal port alone decides who may reach them (docs/security.md). The
internal port serves every route: the data plane lists a tenant's adapters through it too.
Without `--internal-port` (embedded mode, the demo) everything is on the one port.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from loraplane.controlplane.errors import error_response

INTERNAL_PREFIX = "/internal/"
METRICS_PATH = "/metrics"


def internal_only(path: str) -> bool:
    """Whether `path` is served on the internal port only."""
    return path == METRICS_PATH or path.startswith(INTERNAL_PREFIX)


def local_port(scope: Scope) -> int | None:
    """The port the request arrived on (the listening socket's), if the server says."""
    server = scope.get("server")
    return int(server[1]) if server and len(server) > 1 and server[1] is not None else None


class PublicPortGuard:
    """404 for the internal routes and /metrics except on `internal_port`."""

    def __init__(self, app: ASGIApp, internal_port: int) -> None:
        self.app = app
        self.internal_port = internal_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and internal_only(scope.get("path", ""))
            and local_port(scope) != self.internal_port
        ):
            # exactly what an unknown path answers: the public port does not tell them apart
            await error_response(404, "NotFound", "Not Found")(scope, receive, send)
            return
        await self.app(scope, receive, send)
