"""Operational routes: /health, /ready, /metrics, and vLLM's adapter load/unload (admin only).

`/metrics` here is the API port's: anyone who can call the API reads it, so it shows only
vLLM's protocol gauges, which an inference gateway scrapes and which carry no tenant label.
Every other series (per tenant, per adapter) is on the metrics port (`metrics_port.py`).

`/v1/load_lora_adapter` takes a name from the static `--lora-modules` list (a `lora_path` sent
by the client is refused: the server never loads a client-given path); `/v1/unload_lora_adapter`
stops new requests for the adapter, waits for its running ones, then frees its memory. Both
need the admin token (`--admin-token` / LORAPLANE_ADMIN_TOKEN); without one they answer 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from loraplane.dataplane.server.deps import AdminDep, RuntimeDep
from loraplane.dataplane.server.errors import InvalidRequest
from loraplane.dataplane.server.protocol import LoadLoRARequest, UnloadLoRARequest

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health() -> Response:
    """200 while the process lives."""
    return Response(status_code=200)


@router.get("/ready")
async def ready(runtime: RuntimeDep) -> Response:
    """200 once the model is loaded and until shutdown begins; 503 otherwise."""
    ok = runtime.ready and not runtime.draining
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(runtime: RuntimeDep) -> Response:
    """vLLM's protocol gauges (no tenant label), engine state read on the engine thread."""
    if runtime.engine is not None:
        await runtime.gateway_snapshot()
    return Response(runtime.metrics.render_gateway(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    body: LoadLoRARequest, runtime: RuntimeDep, _: AdminDep
) -> PlainTextResponse:
    """Serve a --lora-modules adapter again (after an unload)."""
    if body.lora_path is not None:
        raise InvalidRequest(
            "lora_path is not accepted: adapters load only from the server's configured"
            " --lora-modules (or the catalog), never from a client-given path",
            param="lora_path",
        )
    runtime.require_engine()
    added = await runtime.load_static(body.lora_name)
    verb = "added" if added else "was already loaded"
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' {verb}.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRARequest, runtime: RuntimeDep, _: AdminDep
) -> PlainTextResponse:
    """Stop serving an adapter; frees it once its running requests finish."""
    await runtime.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed.")
