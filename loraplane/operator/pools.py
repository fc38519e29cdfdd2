"""Kopf handlers for ServingPool: children, catalog mirror, status and autoscaling.

On create, update and resume: create or patch the pool's Deployment and Service (owned by
the pool, so they go when it goes), its InferencePool when `spec.routing` asks for one
(`inferencepool`), and mirror the pool into the control plane, where it is
named by its namespace and name as here (pools named alike in two namespaces never share a
catalog entry, pressure or scale). A timer reads
the Deployment's replica counts and the pool's pressure, applies the autoscaling policy
(`autoscaling`; not with `autoscaling.mode: keda`, where a ScaledObject owns the count) and
writes the status, with the pool's pinned versions and the `PinsHeld` condition (`pins`);
every scale emits an Event. It also looks again at an InferencePool the cluster could not
take yet (no CRD, no RBAC).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import kopf

from loraplane.operator import autoscaling, inferencepool, manifests, pins
from loraplane.operator.basemodels import BaseModelUnavailable
from loraplane.operator.catalog import CatalogError
from loraplane.operator.conditions import Condition, now_iso, set_condition
from loraplane.operator.context import OperatorContext, backoff, context_of, namespace_of
from loraplane.operator.specs import (
    GROUP,
    POOLS,
    VERSION,
    PoolSpec,
    SpecError,
    check_quantization,
    check_tensor_parallel,
)

REGISTERED = "Registered"
LAYOUT = "LayoutValid"  # the base model splits as spec.tensorParallelSize asks, in its form
INVALID_SPLIT = "InvalidTensorParallelSize"
UNSUPPORTED_QUANTIZATION = "UnsupportedQuantization"
DEPRECATED_AFFINITY = (
    "spec.routing.endpointPicker.adapterAffinity is deprecated and has no effect: the endpoint"
    " picker reads adapter names on the pods' gateway-metrics port, always on; remove it"
)


def _parse(spec: kopf.Spec) -> PoolSpec:
    try:
        return PoolSpec.parse(spec)
    except SpecError as exc:
        raise kopf.PermanentError(f"InvalidSpec: {exc}") from None


def _layout_error(ctx: OperatorContext, pool: PoolSpec) -> tuple[str, str] | None:
    """(reason, message) when the base model cannot be served as the spec asks: split over
    spec.tensorParallelSize, or in the form spec.quantization and its checkpoint give; None
    otherwise (also when its config.json cannot be read here: a model on the pods' volume is
    checked by the pods). Every pool's config.json is read, an unsplit 16-bit one's too: its
    checkpoint may hold weights the data plane does not serve (bitsandbytes)."""
    if pool.model_on_volume:
        return None
    try:
        base = ctx.base_models.get(pool.base_model_uri, pool.base_model_name)
        stored, group, block = ctx.base_models.stored_form(pool.base_model_uri,
                                                           pool.base_model_name)  # fmt: skip
    except BaseModelUnavailable:
        return None  # the pods say why they cannot load it
    try:
        check_tensor_parallel(pool.tensor_parallel_size, base)
    except SpecError as exc:
        return INVALID_SPLIT, str(exc)
    try:
        check_quantization(pool.quantization, stored, base, pool.tensor_parallel_size, group,
                           block)  # fmt: skip
    except SpecError as exc:
        return UNSUPPORTED_QUANTIZATION, str(exc)
    return None


def _layout(pool: PoolSpec) -> str:
    size = pool.tensor_parallel_size
    split = f"split over {size} processes" if size > 1 else "one process per replica"
    return f"{split}{', fp8 weights' if pool.quantization else ''}"


def _children(
    ctx: OperatorContext, body: kopf.Body, name: str, namespace: str, pool: PoolSpec
) -> None:
    """Create or patch the Deployment and Service (blocking)."""
    current = ctx.kube.read_deployment(namespace, name)
    replicas: int | None
    if current is None:
        replicas = pool.min_replicas
    elif pool.autoscaling.operator_scales:
        replicas = manifests.initial_replicas(pool, current.get("spec", {}).get("replicas"))
    else:
        replicas = None  # an HPA or KEDA owns the count
    deployment = manifests.deployment(
        name,
        namespace,
        pool,
        controlplane_url=ctx.settings.replicas_controlplane_url,
        replicas=replicas,
    )
    service = manifests.service(name, namespace)
    kopf.adopt([deployment, service], owner=body)
    ctx.kube.apply_deployment(deployment, exists=current is not None)
    ctx.kube.apply_service(service)


def _mirror(ctx: OperatorContext, namespace: str, name: str, pool: PoolSpec) -> None:
    """Register the pool in the catalog (blocking), so uploads validate against it. A base
    model only the pool's pods see is not read by the control plane: their pressure reports
    bring its config.json."""
    ctx.catalog.ensure_pool(
        namespace,
        name,
        {
            "name": pool.base_model_name,
            "uri": pool.base_model_uri,
            "config_from_replicas": pool.model_on_volume,
        },
        {  # limits left to the data plane's auto sizing are not mirrored
            k: v
            for k, v in (
                ("max_lora_rank", pool.max_lora_rank),
                ("max_loras", pool.max_loras),
                ("max_cpu_loras", pool.max_cpu_loras),
                # left out when unset: the catalog's PUT then clears a limit set before
                ("max_cpu_lora_bytes", pool.max_cpu_lora_bytes),
            )
            if v is not None
        },
    )


async def reconcile_pool(
    *,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    name: str,
    namespace: str | None,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    **_: Any,
) -> None:
    """Bring the children and the catalog's copy of the pool to the spec."""
    ctx = context_of(memo)
    namespace = namespace_of(namespace)
    pool = _parse(spec)
    generation = meta.get("generation")
    layout = await asyncio.to_thread(_layout_error, ctx, pool)
    if layout is not None:  # no pods that could only fail: the spec must change
        reason, message = layout
        patch.status["observedGeneration"] = generation
        patch.status["conditions"] = set_condition(
            status.get("conditions") or [], LAYOUT, False, reason, message,
            generation=generation, now=now_iso(),
        )  # fmt: skip
        kopf.warn(body, reason=reason, message=message)
        return
    if "adapterAffinity" in (spec.get("routing") or {}).get("endpointPicker", {}):
        kopf.warn(body, reason="Deprecated", message=DEPRECATED_AFFINITY)
    await asyncio.to_thread(_children, ctx, body, name, namespace, pool)
    patch.status["observedGeneration"] = generation
    conditions = await _route(ctx, body, name, namespace, pool, status, generation)
    conditions = set_condition(
        conditions, LAYOUT, True, "Valid", _layout(pool), generation=generation, now=now_iso()
    )
    patch.status["conditions"] = conditions
    try:
        await asyncio.to_thread(_mirror, ctx, namespace, name, pool)
    except CatalogError as exc:
        patch.status["conditions"] = set_condition(
            conditions, REGISTERED, False, exc.code, exc.message,
            generation=generation, now=now_iso(),
        )  # fmt: skip
        kopf.warn(body, reason=exc.code, message=exc.message[:1024])
        if exc.transient:
            raise kopf.TemporaryError(str(exc), delay=backoff(ctx.settings, retry)) from None
        return
    patch.status["conditions"] = set_condition(
        conditions, REGISTERED, True, "Registered", "mirrored into the control plane",
        generation=generation, now=now_iso(),
    )  # fmt: skip


async def _route(
    ctx: OperatorContext,
    body: kopf.Body,
    name: str,
    namespace: str,
    pool: PoolSpec,
    status: Mapping[str, Any],
    generation: int | None,
    *,
    announce: bool = True,
) -> list[Condition]:
    """The pool's InferencePool (spec.routing) brought to the spec; `status`'s conditions with
    InferencePoolReady set (left out while routing was never on). `announce`: a Warning Event
    when it cannot be made."""
    conditions = status.get("conditions") or []
    before = inferencepool.condition_of(conditions)
    outcome = await asyncio.to_thread(
        inferencepool.reconcile, ctx.kube, body, name, namespace, pool, reported=bool(before)
    )
    if outcome is None:
        return list(conditions)
    if announce and not outcome.ready and outcome.reason != "Disabled":
        kopf.warn(body, reason=outcome.reason, message=outcome.message[:1024])
    return set_condition(
        conditions, inferencepool.CONDITION, outcome.ready, outcome.reason, outcome.message,
        generation=generation, now=now_iso(),
    )  # fmt: skip


async def _retry_route(
    ctx: OperatorContext,
    body: kopf.Body,
    name: str,
    namespace: str,
    pool: PoolSpec,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    memo: kopf.Memo,
) -> None:
    """Look again, with backoff, at an InferencePool that could not be made for a reason the
    cluster may have fixed since (CRD installed, RBAC granted, API server back)."""
    before = inferencepool.condition_of(status.get("conditions"))
    if not pool.routing.inference_pool or before is None:
        return
    if before.get("reason") not in inferencepool.RETRY_REASONS:
        memo.pop("route_attempts", None)
        return
    attempts = int(memo.get("route_attempts", 0))
    if time.monotonic() < float(memo.get("route_retry_at", 0.0)):
        return
    memo["route_attempts"] = attempts + 1
    memo["route_retry_at"] = time.monotonic() + backoff(ctx.settings, attempts)
    fresh = await asyncio.to_thread(ctx.kube.read_custom, GROUP, VERSION, POOLS, namespace, name)
    if fresh is None:
        return
    generation = body.get("metadata", {}).get("generation")
    conditions = await _route(
        ctx, body, name, namespace, pool, fresh.get("status") or {}, generation, announce=False
    )
    after = inferencepool.condition_of(conditions)
    if after is None or (after["status"], after["reason"]) == (
        before.get("status"),
        before.get("reason"),
    ):
        return  # unchanged: no status write, no Event
    patch.status["conditions"] = conditions
    post = kopf.info if after["status"] == "True" else kopf.warn
    post(body, reason=after["reason"], message=after["message"][:1024])


def _policy(pool: PoolSpec) -> autoscaling.ScalePolicy:
    a = pool.autoscaling
    return autoscaling.ScalePolicy(
        min_replicas=pool.min_replicas,
        max_replicas=pool.max_replicas,
        deferred_per_replica=a.deferred_per_replica,
        waiting_per_replica=a.waiting_adapters_per_replica,
        scale_up_seconds=a.scale_up_seconds,
        scale_down_seconds=a.scale_down_seconds,
    )


def _pinned(catalog_pool: dict[str, Any] | None) -> int:
    """The most replicas one pinned version of the pool asks for (0: none, or unknown)."""
    value = (catalog_pool or {}).get("pinned_replicas", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _state(memo: kopf.Memo, status: kopf.Status) -> autoscaling.ScaleState:
    """This pool's policy state; after a restart, the last scale time comes from status."""
    state = memo.get("scale_state")
    if isinstance(state, autoscaling.ScaleState):
        return state
    last = status.get("lastScaleTime")
    when = datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp() if last else None
    return autoscaling.ScaleState(last_scale=when)


async def observe_pool(
    *,
    body: kopf.Body,
    spec: kopf.Spec,
    name: str,
    namespace: str | None,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Mirror the Deployment's counts and the pool's pressure into status; autoscale."""
    ctx = context_of(memo)
    namespace = namespace_of(namespace)
    pool = _parse(spec)
    deployment = await asyncio.to_thread(ctx.kube.read_deployment, namespace, name)
    if deployment is None:
        return  # the create/resume handler makes it
    dep_status = deployment.get("status") or {}
    current = int(deployment.get("spec", {}).get("replicas") or 0)
    update: dict[str, Any] = {
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
    }
    pressure = None
    try:
        catalog_pool = await asyncio.to_thread(ctx.catalog.get_pool, namespace, name)
    except CatalogError as exc:
        kopf.warn(body, reason=exc.code, message=exc.message[:1024])
        catalog_pool = None
    report = (catalog_pool or {}).get("pressure")
    pressure = autoscaling.aggregate(report, time.time(), ctx.settings.pressure_stale_seconds)
    if pressure is not None:
        update["pressure"] = {
            "deferred": pressure.deferred,
            "waitingAdapters": pressure.waiting_adapters,
            "runningAdapters": pressure.running_adapters,
            "slotsUsed": pressure.slots_used,
            "adapterMemoryUsed": pressure.adapter_memory_used,
            "adapterMemoryTotal": pressure.adapter_memory_total,
            "hostAdapterMemoryUsed": pressure.host_adapter_memory_used,
            "replicasReporting": pressure.replicas_reporting,
        }
    desired = current
    policy = autoscaling.with_pins(_policy(pool), _pinned(catalog_pool))
    if pool.autoscaling.operator_scales:
        decision = autoscaling.decide(policy, _state(memo, status), current, pressure, time.time())
        memo["scale_state"] = decision.state
        desired = decision.replicas
        if decision.scaled:
            await asyncio.to_thread(ctx.kube.scale_deployment, namespace, name, desired)
            ctx.metrics.scaled(namespace, name, current, desired)
            update["lastScaleTime"] = now_iso()
            kopf.info(
                body,
                reason=decision.reason,
                message=f"replicas {current} -> {desired} ({_describe(pressure)})",
            )
    update["desiredReplicas"] = desired
    ctx.metrics.observe(
        namespace,
        name,
        replicas=desired,
        ready=update["readyReplicas"],
        policy=policy,
        pressure=pressure,
    )
    if catalog_pool is not None and isinstance(catalog_pool.get("pins"), list):
        _show_pins(body, catalog_pool["pins"], status, update)
    changed = {k: v for k, v in update.items() if status.get(k) != v}
    if changed:
        patch.status.update(changed)
    await _retry_route(ctx, body, name, namespace, pool, status, patch, memo)


def _show_pins(
    body: kopf.Body, catalog_pins: list[Any], status: kopf.Status, update: dict[str, Any]
) -> None:
    """`status.pins` and the `PinsHeld` condition from the catalog's pins into `update`
    (`pins`); an Event when the condition changes. A pool that never had a pin gets
    neither."""
    entries = pins.pins_status(catalog_pins)
    conditions = status.get("conditions") or []
    before = next((c for c in conditions if c.get("type") == pins.CONDITION), None)
    if not entries and before is None:
        return
    update["pins"] = pins.shown(entries)
    held = pins.verdict(entries)
    generation = body.get("metadata", {}).get("generation")
    update["conditions"] = set_condition(
        conditions, pins.CONDITION, held.held, held.reason, held.message,
        generation=generation, now=now_iso(),
    )  # fmt: skip
    if before is None or (before.get("status"), before.get("reason")) != (
        "True" if held.held else "False",
        held.reason,
    ):
        post = kopf.info if held.held else kopf.warn
        post(body, reason=held.reason, message=held.message[:1024])


def _describe(pressure: autoscaling.Pressure | None) -> str:
    if pressure is None:
        return "no pressure reported"
    return (
        f"deferred {pressure.deferred}, waiting adapters {pressure.waiting_adapters} "
        f"over {pressure.replicas_reporting} reporting replicas"
    )


async def forget_pool(
    *, name: str, namespace: str | None, memo: kopf.Memo, retry: int, **_: Any
) -> None:
    """The ServingPool is deleted: its Deployment and Service go with it (owner references);
    the catalog forgets the pool, so uploads stop validating against it."""
    ctx = context_of(memo)
    namespace = namespace_of(namespace)
    ctx.metrics.forget(namespace, name)
    try:
        await asyncio.to_thread(ctx.catalog.delete_pool, namespace, name)
    except CatalogError as exc:
        if exc.transient:
            raise kopf.TemporaryError(str(exc), delay=backoff(ctx.settings, retry)) from None
        raise kopf.PermanentError(str(exc)) from None


def register(registry: kopf.OperatorRegistry, interval: float) -> None:
    """Register the ServingPool handlers; the timer runs every `interval` seconds."""
    res = (GROUP, VERSION, POOLS)
    kopf.on.create(*res, id="children", registry=registry)(reconcile_pool)
    kopf.on.update(*res, id="rollout", field="spec", registry=registry)(reconcile_pool)
    kopf.on.resume(*res, id="resume", registry=registry)(reconcile_pool)
    kopf.on.delete(*res, id="forget", registry=registry)(forget_pool)
    kopf.timer(*res, id="observe", interval=interval, initial_delay=interval, registry=registry)(
        observe_pool
    )
