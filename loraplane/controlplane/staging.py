"""Cluster-mode uploads: validate as embedded mode does, stage, hand over to the operator.

An upload is checked exactly as `ingestion.ingest_adapter` checks it (name, base model, pool and
tenant limits, quota, every adapter check), so a bad adapter answers 422 with its reason code
and nothing is staged. A good one is staged under `uploads/<id>/` in the store (create-only
puts; `id` random and URL-safe): `adapter_config.json` + `adapter_model.safetensors`, or the
one archive as `adapter.tar`/`adapter.zip`, which is what the operator's `upload://<id>` source
reads. Then the tenant's LoRAAdapter is created or re-pointed at `upload://<id>`, and the
operator ingests it and records the version. An import (`s3://...`) passes the import
allowlist and re-points the LoRAAdapter at the bucket directly.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from loraplane.adapters import s3read as s3
from loraplane.adapters.canonical import canonical_digest
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.ingest import check_names
from loraplane.adapters.source import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    archive_kind,
    open_adapter_source,
)
from loraplane.adapters.store.base import ObjectStore
from loraplane.adapters.validate import validate_adapter
from loraplane.controlplane.cluster import AdapterResources, AppliedAdapter
from loraplane.controlplane.crud import adapters as crud_adapters
from loraplane.controlplane.crud import audit
from loraplane.controlplane.errors import InvalidRequest, SourceNotAllowed
from loraplane.controlplane.ingestion import as_sent, check_adapter_name, limits_for
from loraplane.controlplane.models import Tenant
from loraplane.controlplane.settings import Settings
from loraplane.controlplane.signatures import SignatureClaim, signature_check

UPLOAD_PREFIX = "uploads"
UPLOAD_SCHEME = "upload://"


@dataclass(frozen=True, slots=True)
class Staged:
    """Where the operator will read the adapter from, and the resource that says so."""

    name: str
    source_uri: str
    resource: str
    created: bool
    ignored: tuple[str, ...] = ()  # the upload's other files (a Trainer's artefacts), not staged


def new_upload_id() -> str:
    """A random, URL-safe id (it names `uploads/<id>/` and `upload://<id>`)."""
    return "u" + secrets.token_urlsafe(18).replace("_", "x")


def validated_files(
    source: Path,
    settings: Settings,
    session: Session,
    *,
    tenant: Tenant,
    name: str,
    base_model: str,
    signature: SignatureClaim | None = None,
) -> tuple[list[tuple[str, Path]], tuple[str, ...]]:
    """Run every check on the upload; the (staged name, local file) pairs to stage, and the
    upload's files that are ignored.

    Raises what embedded mode raises: InvalidRequest, UnknownBaseModel, QuotaExceeded,
    AdapterRejected (422 with its reason code; SignatureRequired / SignatureInvalid against
    the canonical digest, which the operator checks again before it stores the version).
    """
    check_adapter_name(name)
    try:
        check_names(tenant.namespace, name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    spec, limits = limits_for(session, tenant=tenant, base_model=base_model, settings=settings)
    crud_adapters.check_adapter_quota(session, tenant=tenant, name=name)
    check = signature_check(session, tenant=tenant, base_model=base_model, claim=signature)
    session.rollback()  # hold no transaction while the adapter is checked
    try:
        with open_adapter_source(source, limits) as files:
            adapter = validate_adapter(files, spec, limits, scan_weights=True)
            try:
                if check.claim.signature or check.policy.required:
                    check(canonical_digest(adapter))
            finally:
                adapter.close()
            ignored = files.ignored
            if source.is_dir():
                pairs = [(CONFIG_NAME, files.config_path), (WEIGHTS_NAME, files.weights_path)]
                return pairs, ignored
    except AdapterRejected as exc:
        worded = as_sent(exc, source)
        if worded is exc:
            raise
        raise worded from exc
    kind = archive_kind(source)
    if kind is None:  # open_adapter_source accepted it, so this cannot happen
        raise AdapterRejected(ReasonCode.UNSUPPORTED_FORMAT, f"{source.name} is not an archive")
    return [(f"adapter.{kind}", source)], ignored


def stage_files(store: ObjectStore, files: list[tuple[str, Path]]) -> str:
    """Put the files under a fresh `uploads/<id>/` (create-only); the `upload://<id>` URI."""
    upload_id = new_upload_id()
    for staged_name, path in files:
        store.put_file(f"{UPLOAD_PREFIX}/{upload_id}/{staged_name}", path)
    return UPLOAD_SCHEME + upload_id


def unstage(store: ObjectStore, uri: str) -> None:
    """Best effort: remove the objects of a staging no resource points at."""
    prefix = f"{UPLOAD_PREFIX}/{uri.removeprefix(UPLOAD_SCHEME)}/"
    try:
        for key in store.list_keys(prefix):
            store.delete(key)
    except Exception:  # an orphan staging is harmless; the answer matters more
        return


def check_import(settings: Settings, source_uri: str) -> str:
    """The import allowlist (as embedded mode): only `s3://` in LORAPLANE_IMPORT_BUCKETS."""
    try:
        bucket, key = s3.split_uri(source_uri)
    except ValueError:
        raise SourceNotAllowed(
            "only s3:// sources in the allowlisted buckets can be imported"
        ) from None
    if bucket not in settings.import_buckets:
        raise SourceNotAllowed(f"bucket {bucket!r} is not in the import allowlist")
    if not key.strip("/"):
        raise InvalidRequest(f"{source_uri} names no object or folder")
    return source_uri


def point_adapter(
    session: Session,
    resources: AdapterResources,
    *,
    tenant: Tenant,
    name: str,
    base_model: str,
    uri: str,
    actor: str,
    signature: SignatureClaim | None = None,
) -> Staged:
    """Create or re-point the tenant's LoRAAdapter at `uri` (with the upload's signature),
    and audit it."""
    claim = signature or SignatureClaim()
    applied: AppliedAdapter = resources.apply(
        tenant.namespace, name, base_model=base_model, uri=uri, signature=claim.signature,
        key_id=claim.key_id,
    )  # fmt: skip
    audit.record(
        session,
        actor=actor,
        action="adapter.stage",
        target=f"tenants/{tenant.name}/adapters/{name}",
        detail={"source_uri": uri, "resource": applied.resource, "created": applied.created},
    )
    session.commit()
    return Staged(name, uri, applied.resource, applied.created)


def stage_upload(
    session: Session,
    *,
    factory: sessionmaker[Session],
    store: ObjectStore,
    resources: AdapterResources,
    settings: Settings,
    tenant: Tenant,
    name: str,
    base_model: str,
    source: Path,
    actor: str,
    signature: SignatureClaim | None = None,
) -> Staged:
    """Validate, stage and hand an uploaded adapter to the operator (blocking)."""
    try:
        files, ignored = validated_files(
            source, settings, session, tenant=tenant, name=name, base_model=base_model,
            signature=signature,
        )  # fmt: skip
    except AdapterRejected as exc:
        audit.record_failure(
            factory,
            actor=actor,
            action="adapter.upload",
            target=f"tenants/{tenant.name}/adapters/{name}",
            outcome=f"rejected:{ReasonCode(exc.code).value}",
            detail={"message": exc.message[:500]},
        )
        raise
    uri = stage_files(store, files)
    try:
        staged = point_adapter(
            session,
            resources,
            tenant=tenant,
            name=name,
            base_model=base_model,
            uri=uri,
            actor=actor,
            signature=signature,
        )
        return replace(staged, ignored=ignored)
    except Exception:
        unstage(store, uri)
        raise


def stage_import(
    session: Session,
    *,
    resources: AdapterResources,
    settings: Settings,
    tenant: Tenant,
    name: str,
    base_model: str,
    source_uri: str,
    actor: str,
    signature: SignatureClaim | None = None,
) -> Staged:
    """Point the tenant's LoRAAdapter at an allowlisted S3 source (blocking); its signature,
    if any, goes with it for the operator to check."""
    check_adapter_name(name)
    uri = check_import(settings, source_uri)
    limits_for(session, tenant=tenant, base_model=base_model, settings=settings)
    crud_adapters.check_adapter_quota(session, tenant=tenant, name=name)
    return point_adapter(
        session,
        resources,
        tenant=tenant,
        name=name,
        base_model=base_model,
        uri=uri,
        actor=actor,
        signature=signature,
    )


def audit_delete(session: Session, *, tenant: Tenant, name: str, actor: str) -> None:
    """Record that the tenant's LoRAAdapter was deleted (the operator then marks the catalog)."""
    audit.record(
        session,
        actor=actor,
        action="adapter.delete",
        target=f"tenants/{tenant.name}/adapters/{name}",
        detail={"resource": f"{tenant.namespace}/{name}"},
    )
    session.commit()
