"""The metrics port (`--metrics-port`, default 8002): every series of the server, the
tenant-labelled and per-adapter ones included, on a listener of its own that only Prometheus
may reach (the chart's NetworkPolicy admits the monitoring namespace alone). The API port's
`/metrics` shows only vLLM's protocol gauges, because anyone who can call the API can read it
(docs/security.md).

    app = create_metrics_app(runtime)   # served beside the API app, on the same runtime
"""

from __future__ import annotations

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST

from loraplane.dataplane.server.runtime import Runtime


def create_metrics_app(runtime: Runtime) -> FastAPI:
    """An app with one route, `GET /metrics`: every metric of `runtime`, its engine state read
    on the engine thread (as the API port's /metrics does). No docs: nothing else is here."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        if runtime.engine is not None:
            await runtime.snapshot()
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
