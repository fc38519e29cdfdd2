"""The data plane's two metrics listeners beside the API port, each on a port of its own:

- the metrics port (`--metrics-port`, default 8002): every series of the server, the
  tenant-labelled and per-adapter ones included, that only Prometheus may reach (the chart's
  NetworkPolicy admits `networkPolicy.metricsFrom` alone);
- the gateway-metrics port (`--gateway-metrics-port`, default 8003): only the model-server
  protocol gauges an inference gateway's endpoint picker reads (queue, running, KV cache usage,
  and `vllm:lora_requests_info` with the resident adapters' names for its LoRA affinity), that
  only the picker's pods may reach (`networkPolicy.dataplane.gatewayMetricsFrom`).

The API port's `/metrics` shows the protocol gauges without adapter names, because anyone who
can call the API can read it (docs/security.md).

    app = create_metrics_app(runtime)           # served beside the API app, on the same runtime
    app = create_gateway_metrics_app(runtime)
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


def create_gateway_metrics_app(runtime: Runtime) -> FastAPI:
    """An app with one route, `GET /metrics`: the endpoint picker's view (the protocol gauges,
    adapter names included, no tenant label), read as cheaply as the API port's (the picker
    scrapes every replica every 50 ms). No docs: nothing else is here."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        if runtime.engine is not None:
            await runtime.gateway_snapshot()
        return Response(runtime.metrics.render_gateway(), media_type=CONTENT_TYPE_LATEST)

    return app
