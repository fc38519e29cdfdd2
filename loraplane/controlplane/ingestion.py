"""Embedded-mode ingest: a tenant's upload or import -> the adapter core -> the catalog.

The adapter is validated against the base model of the pools that serve it (the lowest of
their `max_lora_rank`s) and the tenant's quotas, stored by the shared `ingest` pipeline, and
recorded in the catalog under the version number the store gave it. A rejected adapter
stores nothing and is audited as rejected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from loraplane.adapters import s3read as s3
from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME
from loraplane.adapters.store.base import ObjectStore
from loraplane.controlplane import basemodels
from loraplane.controlplane.crud import adapters as crud_adapters
from loraplane.controlplane.crud import audit
from loraplane.controlplane.crud.pools import pool_ref, pools_for_base_model
from loraplane.controlplane.errors import (
    BaseModelPending,
    InvalidRequest,
    SourceNotAllowed,
    SourceNotFound,
    UnknownBaseModel,
    got,
)
from loraplane.controlplane.models import Adapter, AdapterVersion, Tenant
from loraplane.controlplane.schemas.common import RESOURCE_NAME, must_be
from loraplane.controlplane.settings import Settings
from loraplane.controlplane.signatures import SignatureClaim, signature_check, signed_fields

ADAPTER_NAME = re.compile(RESOURCE_NAME)
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")


@dataclass(frozen=True, slots=True)
class Ingested:
    """The outcome of an upload: the adapter, the version, and whether it is new."""

    adapter: Adapter
    version: AdapterVersion
    created: bool
    ignored: tuple[str, ...] = ()  # the upload's other files (Trainer artefacts), not stored


def check_adapter_name(name: str) -> str:
    """InvalidRequest unless `name` is DNS-safe (no '@': it pins versions; no '/'), worded
    as a refused JSON field is (`name: must be ... (got "My Adapter")`)."""
    if not ADAPTER_NAME.match(name):
        raise InvalidRequest(f"name: {must_be('resource_name')} (got {got(name)})")
    return name


def as_sent(exc: AdapterRejected, source: Path) -> AdapterRejected:
    """The refusal of an upload worded for the tenant who sent it: the folder its files were
    received in (a path on this server, which means nothing to the tenant) is "the upload",
    and a file in it goes by its own name, as the CLI names the tenant's own files."""
    folder = str(source)
    if folder not in exc.message:
        return exc
    text = exc.message.replace(folder + "/", "").replace(folder, "the upload")
    return AdapterRejected(ReasonCode(exc.code), text)


def limits_for(
    session: Session, *, tenant: Tenant, base_model: str, settings: Settings
) -> tuple[BaseModelSpec, AdapterLimits]:
    """The base model's shapes (from the first pool that has its config: a pool still waiting
    for its replicas' report is skipped) and the limits an upload for it must meet (every
    pool's). BaseModelPending when no pool has the config yet."""
    pools = pools_for_base_model(session, base_model=base_model)
    if not pools:
        raise UnknownBaseModel(
            f"no pool serves base model {base_model!r}; ask an admin to register one"
        )
    config = next((p.base_model_config for p in pools if p.base_model_config is not None), None)
    if config is None:
        refs = ", ".join(pool_ref(p.namespace, p.name) for p in pools)
        raise BaseModelPending(
            f"no replica of pool {refs} has reported base model {base_model!r} yet; retry later"
        )
    spec = basemodels.spec_of(config, base_model)
    # the pool's limit first: at a tie it is the one named (raising the quota would not help)
    strictest = min(pools, key=lambda p: p.max_lora_rank)
    limits = AdapterLimits(max_archive_bytes=settings.max_upload_bytes).tightened(
        max_rank=strictest.max_lora_rank,
        rank_limit=f"the pool's max_lora_rank {strictest.max_lora_rank} "
        f"(pool {pool_ref(strictest.namespace, strictest.name)})",
    )
    return spec, limits.tightened(
        max_rank=tenant.max_rank,
        max_bytes=tenant.max_bytes,
        rank_limit=f"your tenant's rank quota (max_rank {tenant.max_rank}; an admin can raise it)",
        bytes_limit=f"your tenant's quota of {tenant.max_bytes} bytes per adapter (max_bytes; an "
        "admin can raise it)",
    )


def precheck(
    session: Session, *, tenant: Tenant, name: str, base_model: str, settings: Settings
) -> tuple[BaseModelSpec, AdapterLimits]:
    """What can be refused before the adapter is read: its name, an unserved base model, the
    tenant's adapter count. Returns the base model's shapes and the limits to validate with,
    and leaves no transaction open (no SQLite lock is held while an adapter is checked)."""
    check_adapter_name(name)
    spec, limits = limits_for(session, tenant=tenant, base_model=base_model, settings=settings)
    crud_adapters.check_adapter_quota(session, tenant=tenant, name=name)
    session.rollback()
    return spec, limits


def ingest_adapter(
    session: Session,
    *,
    factory: sessionmaker[Session],
    store: ObjectStore,
    settings: Settings,
    tenant: Tenant,
    name: str,
    base_model: str,
    source: Path,
    actor: str,
    signature: SignatureClaim | None = None,
) -> Ingested:
    """Validate, store and record one adapter (blocking: run it off the event loop).

    The signature (if any, and required by the tenant's or a pool's policy) is verified
    against the canonical digest before anything is stored."""
    target = f"tenants/{tenant.name}/adapters/{name}"
    spec, limits = precheck(
        session, tenant=tenant, name=name, base_model=base_model, settings=settings
    )
    check = signature_check(session, tenant=tenant, base_model=base_model, claim=signature)
    session.rollback()  # no transaction open while the adapter is read
    try:
        stored = ingest(
            source, tenant.name, name, spec, limits, store, created_by=actor, check_digest=check
        )
    except AdapterRejected as raw:
        exc = as_sent(raw, source)
        audit.record_failure(
            factory,
            actor=actor,
            action="adapter.upload",
            target=target,
            outcome=f"rejected:{ReasonCode(exc.code).value}",
            detail={"message": exc.message[:500]},
        )
        if exc is raw:
            raise
        raise exc from raw
    record = crud_adapters.StoredVersion(
        version=stored.version,
        digest=stored.digest,
        path=stored.path,
        rank=stored.rank,
        alpha=stored.alpha,
        target_modules=list(stored.target_modules),
        size_bytes=stored.size_bytes,
        base_model=base_model,
        created_by=actor,
        **signed_fields(check.verified),
    )
    adapter, row, created = crud_adapters.record_version(
        session, tenant=tenant, name=name, stored=record, actor=actor
    )
    return Ingested(adapter, row, created, stored.ignored)


def import_location(settings: Settings, source_uri: str) -> tuple[str, str]:
    """The (bucket, key) an import may read: SourceNotAllowed unless an `s3://` URI in an
    allowlisted bucket (LORAPLANE_IMPORT_BUCKETS), SourceNotFound when it names nothing."""
    try:
        bucket, key = s3.split_uri(source_uri)
    except ValueError:
        raise SourceNotAllowed(
            "only s3:// sources in the allowlisted buckets can be imported"
        ) from None
    if bucket not in settings.import_buckets:
        raise SourceNotAllowed(f"bucket {bucket!r} is not in the import allowlist")
    key = key.strip("/")
    if not key:
        raise SourceNotFound(f"{source_uri} names no object or folder")
    return bucket, key


def fetch_import(settings: Settings, source_uri: str, workdir: Path, *, max_bytes: int) -> Path:
    """Download an import source into `workdir`: an archive object or a folder's two files.

    Only `s3://` URIs in allowlisted buckets (LORAPLANE_IMPORT_BUCKETS); no other scheme,
    no redirects. Returns what the adapter core should read.
    """
    bucket, key = import_location(settings, source_uri)
    client = s3.make_client(settings.s3_endpoint_url)
    wanted = (
        [(key, workdir / ("adapter" + _archive_suffix(key)))]
        if key.lower().endswith(ARCHIVE_SUFFIXES)
        else [(f"{key}/{f}", workdir / "adapter" / f) for f in (CONFIG_NAME, WEIGHTS_NAME)]
    )
    for object_key, dest in wanted:
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            s3.download(client, bucket, object_key, dest, max_bytes=max_bytes)
        except s3.ObjectTooLarge as exc:
            raise AdapterRejected(ReasonCode.TOO_LARGE, str(exc)) from exc
        except s3.S3ReadError as exc:  # missing, or not readable by this service
            raise SourceNotFound(str(exc)) from exc
    return wanted[0][1] if len(wanted) == 1 else workdir / "adapter"


def _archive_suffix(key: str) -> str:
    lower = key.lower()
    return next(s for s in ARCHIVE_SUFFIXES if lower.endswith(s))
