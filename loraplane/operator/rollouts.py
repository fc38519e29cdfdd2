"""Kopf handler for a LoRAAdapter's `spec.rollout` (GitOps weighted rollouts): thin.

On create (after the ingest handler) and whenever `spec.rollout` changes: send the split to the
catalog (`PUT /internal/v1/tenants/{namespace}/adapters/{name}/rollout`; one version at 100
promotes it, an absent or empty list rolls a running split back) and write what the catalog
serves into `status.rollout` and `status.currentVersion`. A version the catalog does not have
yet (its source is still being ingested) waits and retries; a split the catalog refuses is
permanent until the spec changes. Only status and events are written, never spec.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from loraplane.operator.catalog import CatalogError
from loraplane.operator.context import backoff, context_of, namespace_of
from loraplane.operator.specs import ADAPTERS, GROUP, VERSION, AdapterSpec, SpecError


def rollout_status(adapter: dict[str, Any]) -> dict[str, Any]:
    """The status fields for the catalog's answer: the split it serves (None: none runs) and
    the version served outside a split."""
    split = adapter.get("rollout") or None
    return {
        "rollout": [{"version": v["version"], "weight": v["weight"]} for v in split]
        if split
        else None,
        "currentVersion": adapter.get("current_version"),
    }


async def apply_rollout(
    *,
    body: kopf.Body,
    spec: kopf.Spec,
    name: str,
    namespace: str | None,
    memo: kopf.Memo,
    retry: int,
    reason: str,
    **_: Any,
) -> None:
    """Make the catalog serve `spec.rollout` and show it in the status."""
    ctx = context_of(memo)
    namespace = namespace_of(namespace)
    try:
        weights = AdapterSpec.parse_rollout(spec)
        served = AdapterSpec.parse(spec).catalog_name(name)
    except SpecError as exc:
        kopf.warn(body, reason="InvalidRollout", message=str(exc))
        raise kopf.PermanentError(str(exc)) from None
    if weights is None and reason == "create":
        return  # nothing to roll out and nothing to roll back
    try:
        adapter = await asyncio.to_thread(ctx.catalog.set_rollout, namespace, served, weights)
    except CatalogError as exc:
        if exc.status == 404 or exc.transient:  # not ingested yet, or the catalog is away
            raise kopf.TemporaryError(
                f"{exc.code}: {exc.message}", delay=backoff(ctx.settings, retry)
            ) from None
        kopf.warn(body, reason="RolloutRefused", message=exc.message[:1024])
        raise kopf.PermanentError(str(exc)) from None
    await asyncio.to_thread(
        ctx.kube.patch_status, ADAPTERS, namespace, name, rollout_status(adapter)
    )
    shown = ", ".join(f"v{v}: {w}" for v, w in sorted((weights or {}).items())) or "none"
    kopf.info(body, reason="Rollout", message=f"split served: {shown}")


def rollout_changed(*, diff: kopf.Diff, **_: Any) -> bool:
    """Only a changed `spec.rollout` needs the catalog told again."""
    return any(d.field[:2] == ("spec", "rollout") for d in diff)


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the rollout handlers (after the adapter's own, so a new version is recorded
    before a split names it)."""
    res = (GROUP, VERSION, ADAPTERS)
    kopf.on.create(*res, id="rollout", registry=registry)(apply_rollout)
    kopf.on.update(*res, id="rollout", when=rollout_changed, registry=registry)(apply_rollout)
