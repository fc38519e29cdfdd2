"""Operational routes: /health, /ready, /metrics, and vLLM's adapter load/unload (admin only).

`/health` is the liveness probe: 503 only when the engine thread is gone while the server is not
shutting down (a restart is the cure); it answers 200 while the model loads, so a pod is never
killed for loading. `/ready` is the readiness probe: 503 while loading, draining, with the engine
thread gone, with work but no step ended for LORAPLANE_READY_STALL_S, or with the last
LORAPLANE_READY_FAILED_STEPS steps all failed (`AsyncEngine.health`). Both answer from fields the
engine thread writes, never by calling into it, so they answer while a step hangs; a 503 carries
a `reason` (no path, no request, no tenant: anyone who reaches the API port reads it).

`/metrics` here is the API port's: anyone who can call the API reads it, so it shows only
vLLM's protocol gauges, with no tenant label and no adapter name (no `vllm:lora_requests_info`).
The endpoint picker's view, with adapter names, is on the gateway-metrics port, and every other
series (per tenant, per adapter) on the metrics port (`metrics_port.py`).

`/v1/load_lora_adapter` takes a name from the static `--lora-modules` list (a `lora_path` sent
by the client is refused: the server never loads a client-given path); `/v1/unload_lora_adapter`
stops new requests for the adapter at once (in catalog mode they are refused with 404
`model_unloading` while it drains), waits for its running ones (at most
LORAPLANE_UNLOAD_TIMEOUT_S, then 503 `unload_timeout` and nothing changed), then frees its
memory and answers. `/v1/pin_lora_adapter` keeps a --lora-modules adapter resident (never
evicted; 409 PinsDoNotFit past half the adapter memory or slots), `/v1/unpin_lora_adapter` lets
it go (in catalog mode the control plane assigns pins). All four need the admin token
(`--admin-token` / LORAPLANE_ADMIN_TOKEN); without one they answer 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from loraplane.dataplane.server.deps import AdminDep, RuntimeDep
from loraplane.dataplane.server.errors import InvalidRequest
from loraplane.dataplane.server.protocol import (
    LoadLoRARequest,
    PinLoRARequest,
    UnloadLoRARequest,
)
from loraplane.dataplane.server.runtime import Runtime

router = APIRouter(tags=["operations"])


def readiness(runtime: Runtime) -> str:
    """Why the replica must not take requests now; empty when it may."""
    if runtime.draining:
        return "draining"
    if not runtime.ready:
        return "loading" if runtime.fatal is None else "start failed (see the server's log)"
    verdict = runtime.engine_health()
    return "" if verdict is None or verdict.ready else verdict.reason


@router.get("/health")
async def health(runtime: RuntimeDep) -> Response:
    """Liveness: 503 once the engine thread is gone (not while shutting down); else 200."""
    verdict = runtime.engine_health()
    if verdict is None or verdict.alive or runtime.draining:
        return JSONResponse({"alive": True})
    return JSONResponse({"alive": False, "reason": verdict.reason}, status_code=503)


@router.get("/ready")
async def ready(runtime: RuntimeDep) -> Response:
    """Readiness: 200 while the replica can serve; 503 with the reason otherwise."""
    reason = readiness(runtime)
    if not reason:
        return JSONResponse({"ready": True})
    return JSONResponse({"ready": False, "reason": reason}, status_code=503)


@router.get("/metrics")
async def metrics(runtime: RuntimeDep) -> Response:
    """vLLM's protocol gauges (no tenant label, no adapter name), read on the engine thread."""
    if runtime.engine is not None:
        await runtime.gateway_snapshot()
    return Response(runtime.metrics.render_api(), media_type=CONTENT_TYPE_LATEST)


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
    """Stop new requests for an adapter at once; answer once its running ones end.

    Then it is freed; 503 unload_timeout if they outlast LORAPLANE_UNLOAD_TIMEOUT_S."""
    await runtime.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed.")


@router.post("/v1/pin_lora_adapter")
async def pin_lora_adapter(body: PinLoRARequest, runtime: RuntimeDep, _: AdminDep) -> JSONResponse:
    """Keep a --lora-modules adapter resident: its state ('host' until the next step places
    it, then 'resident'; 'loading' while it is read)."""
    runtime.require_engine()
    state = await runtime.pin_static(body.lora_name)
    return JSONResponse({"lora_name": body.lora_name, "pinned": True, "state": state})


@router.post("/v1/unpin_lora_adapter")
async def unpin_lora_adapter(
    body: PinLoRARequest, runtime: RuntimeDep, _: AdminDep
) -> JSONResponse:
    """Let a pinned adapter be evicted again like any idle one."""
    runtime.require_engine()
    await runtime.pin_static(body.lora_name, pin=False)
    return JSONResponse({"lora_name": body.lora_name, "pinned": False})
