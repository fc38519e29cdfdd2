"""Kopf handlers for LoRAAdapter: thin; the work is in `ingestion`, `sources`, `catalog`.

On create, and when `spec.source` or `spec.servedName` changes: find the pools serving the
base model and its shapes (from a pool's uri, or from the catalog for a model only the pool's
pods see: Pending `BaseModelPending` until they report it), ask the catalog for the tenant's
signature policy and signing keys, fetch the source, validate it against the base model and
the pools' limits, check `spec.source.signature` against its canonical digest (Rejected
`SignatureRequired` / `SignatureInvalid`, nothing stored), store it (tenant = namespace),
record the version in the catalog, and write the status. On delete:
mark the adapter deleted in the catalog (its versions stay). Only status, finalizers and
events are ever written: never spec.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

import kopf

from loraplane.adapters.errors import AdapterRejected, StoreError
from loraplane.adapters.ingest import AdapterVersion
from loraplane.operator import ingestion
from loraplane.operator.basemodels import BaseModelPending, BaseModelUnavailable
from loraplane.operator.catalog import CatalogError
from loraplane.operator.conditions import Verdict, adapter_status
from loraplane.operator.context import OperatorContext, backoff, context_of, namespace_of
from loraplane.operator.sources import SourceError
from loraplane.operator.specs import ADAPTERS, GROUP, VERSION, AdapterSpec, SpecError

Body = kopf.Body


def _verdict(phase: str, reason: str, message: str) -> Verdict:
    validated = True if phase == "Ready" else (False if phase == "Rejected" else None)
    return Verdict(phase, reason, message, validated, True if phase == "Ready" else None)


class _Writer:
    """Writes one adapter's status and emits an Event when its phase or reason changes."""

    def __init__(self, ctx: OperatorContext, body: Body, status: Mapping[str, Any]) -> None:
        self.ctx = ctx
        self.body = body
        self.status: dict[str, Any] = dict(status)
        meta = body.get("metadata", {})
        self.namespace: str = meta.get("namespace", "")
        self.name: str = meta.get("name", "")
        self.generation: int | None = meta.get("generation")

    async def write(
        self,
        verdict: Verdict,
        *,
        served_name: str | None = None,
        version: AdapterVersion | None = None,
    ) -> None:
        new = adapter_status(
            self.status, verdict, generation=self.generation, served_name=served_name,
            version=version,
        )  # fmt: skip
        changed = (self.status.get("phase"), self.status.get("reason")) != (
            verdict.phase,
            verdict.reason,
        )
        await asyncio.to_thread(
            self.ctx.kube.patch_status, ADAPTERS, self.namespace, self.name, new
        )
        self.status.update(new)
        if changed:
            post = kopf.info if verdict.phase in ("Ready", "Validating") else kopf.warn
            post(self.body, reason=verdict.reason, message=verdict.message[:1024])

    async def wait(
        self, phase: str, reason: str, message: str, delay: float
    ) -> kopf.TemporaryError:
        """Record a state that a later retry can leave; return the error to raise."""
        await self.write(_verdict(phase, reason, message))
        return kopf.TemporaryError(f"{reason}: {message}", delay=delay)

    async def refuse(self, reason: str, message: str) -> kopf.PermanentError:
        """Record a verdict no retry can change; return the error to raise."""
        await self.write(_verdict("Rejected", reason, message))
        return kopf.PermanentError(f"{reason}: {message}")


async def reconcile_adapter(
    *,
    body: kopf.Body,
    spec: kopf.Spec,
    name: str,
    namespace: str | None,
    status: kopf.Status,
    memo: kopf.Memo,
    retry: int,
    pools_by_base: kopf.Index[str, dict[str, Any]] | None = None,
    **_: Any,
) -> None:
    """Validate, store and record the adapter; the status says where it stands."""
    ctx = context_of(memo)
    namespace = namespace_of(namespace)
    out = _Writer(ctx, body, status)
    delay = backoff(ctx.settings, retry)
    try:
        wanted = AdapterSpec.parse(spec)
        served = wanted.catalog_name(name)
    except SpecError as exc:
        raise await out.refuse("InvalidSpec", str(exc)) from None
    found = pools_by_base.get(wanted.base_model) if pools_by_base is not None else None
    pools = ingestion.parse_pools(found or [])
    if not pools:
        raise await out.wait(
            "Pending",
            "NoServingPool",
            f"no ServingPool serves base model {wanted.base_model!r}; waiting for one",
            ctx.settings.pool_wait_seconds,
        )
    secret = None
    if wanted.secret_name:
        secret = await asyncio.to_thread(ctx.kube.read_secret, namespace, wanted.secret_name)
        if secret is None:
            raise await out.wait(
                "Pending", "SecretNotFound", f"Secret {wanted.secret_name!r} not found", delay
            )
    try:
        base = await asyncio.to_thread(ingestion.base_model_of, ctx, pools, wanted.base_model)
    except BaseModelUnavailable as exc:
        raise await out.wait("Pending", "BaseModelUnavailable", str(exc), delay) from None
    except BaseModelPending as exc:  # a volume pool's replicas will report it
        wait = ctx.settings.pool_wait_seconds
        raise await out.wait("Pending", "BaseModelPending", str(exc), wait) from None
    except CatalogError as exc:
        raise await out.wait("Failed", exc.code, exc.message, delay) from None
    try:
        policy = await asyncio.to_thread(ctx.catalog.signing_policy, namespace, wanted.base_model)
    except CatalogError as exc:
        if exc.status == 404:
            raise await out.wait(
                "Pending", "TenantNotRegistered", f"tenant {namespace!r}: {exc.message}", delay
            ) from None
        raise await out.wait("Failed", exc.code, exc.message, delay) from None
    check = ingestion.signature_check(policy, wanted.signature, wanted.signature_key_id)
    await out.write(_verdict("Validating", "Validating", f"fetching {wanted.source_uri}"))
    limits = ingestion.pool_limits(ctx.settings.max_source_bytes, pools)
    try:
        ingest = functools.partial(
            ingestion.fetch_and_ingest,
            ctx,
            uri=wanted.source_uri,
            secret=secret,
            tenant=namespace,
            name=served,
            base=base,
            limits=limits,
            check_digest=check,
        )
        version = await asyncio.get_running_loop().run_in_executor(ctx.ingest_executor, ingest)
    except AdapterRejected as exc:
        raise await out.refuse(exc.code.value, exc.message) from None
    except SourceError as exc:
        if exc.permanent:
            raise await out.refuse(exc.reason, exc.message) from None
        raise await out.wait("Failed", exc.reason, exc.message, delay) from None
    except StoreError as exc:
        raise await out.wait("Failed", "StoreUnavailable", str(exc), delay) from None
    try:
        await asyncio.to_thread(
            functools.partial(
                ctx.catalog.record_version, namespace, served, version,
                signature=wanted.signature, signature_key_id=wanted.signature_key_id,
            )
        )  # fmt: skip
    except CatalogError as exc:
        if exc.status == 404:
            raise await out.wait(
                "Pending", "TenantNotRegistered", f"tenant {namespace!r}: {exc.message}", delay
            ) from None
        if exc.transient:
            raise await out.wait("Failed", exc.code, exc.message, delay) from None
        await out.write(_verdict("Failed", exc.code, exc.message))
        raise kopf.PermanentError(str(exc)) from None
    previous = status.get("servedName")
    if previous and previous != served:
        await _forget(ctx, body, namespace, previous)
    message = f"version {version.version} ({version.digest[:12]}) at {version.path}"
    await out.write(
        Verdict("Ready", "Ready", message, True, True), served_name=served, version=version
    )


async def _forget(ctx: OperatorContext, body: Body, namespace: str, served: str) -> None:
    """Mark `served` deleted in the catalog (its versions stay stored and recorded)."""
    if await asyncio.to_thread(ctx.catalog.delete_adapter, namespace, served):
        kopf.info(body, reason="Deleted", message=f"{namespace}/{served} no longer served")


async def delete_adapter(
    *,
    body: kopf.Body,
    spec: kopf.Spec,
    name: str,
    namespace: str | None,
    status: kopf.Status,
    memo: kopf.Memo,
    retry: int,
    **_: Any,
) -> None:
    """The finalizer's work: stop serving the adapter; stored versions are kept."""
    ctx = context_of(memo)
    namespace = namespace_of(namespace)
    served = status.get("servedName") or spec.get("servedName") or name
    try:
        await _forget(ctx, body, namespace, served)
    except CatalogError as exc:
        if exc.transient:
            raise kopf.TemporaryError(str(exc), delay=backoff(ctx.settings, retry)) from None
        kopf.warn(body, reason=exc.code, message=exc.message)


def source_changed(*, diff: kopf.Diff, **_: Any) -> bool:
    """Only a new source or served name needs a new ingest."""
    return any(d.field[:2] in (("spec", "source"), ("spec", "servedName")) for d in diff)


def index_pools(*, name: str, namespace: str | None, spec: kopf.Spec, **_: Any) -> dict[str, Any]:
    """Index the ServingPools by the base model they serve."""
    base = spec.get("baseModel", {}).get("name")
    return {base: {"name": name, "namespace": namespace, "spec": dict(spec)}} if base else {}


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the LoRAAdapter handlers (and the pool index they read)."""
    res = (GROUP, VERSION, ADAPTERS)
    kopf.index(GROUP, VERSION, "servingpools", id="pools_by_base", registry=registry)(index_pools)
    kopf.on.create(*res, id="ingest", registry=registry)(reconcile_adapter)
    kopf.on.update(*res, id="reingest", when=source_changed, registry=registry)(reconcile_adapter)
    kopf.on.delete(*res, id="forget", registry=registry)(delete_adapter)
