"""The ingest pipeline: validate -> canonicalise and digest -> store immutably -> version.

Layout (docs/architecture.md, "Storage layout"), plus one claim object per version number:

    adapters/<tenant>/<adapter>/v<N>-<digest[:12]>/adapter_config.json
                                                  adapter_model.safetensors
                                                  manifest.json        (written last)
    adapters/<tenant>/<adapter>/versions/v<N>.json                     (the claim on N)

A version number is taken by a create-only write of its claim, which holds the full digest;
whoever loses the race reads the claim and either joins it (same content) or tries N+1. All
objects are create-only, so concurrent ingests never overwrite or lose a version, and a crash
between claim and manifest is finished by the next ingest of the same content.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import CanonicalAdapter, write_canonical
from loraplane.adapters.errors import AdapterRejected, ObjectExists, ReasonCode, StoreError
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME, open_adapter_source
from loraplane.adapters.store.base import ObjectStore
from loraplane.adapters.validate import validate_adapter

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "loraplane.adapter-manifest/v1"
TENANT_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
ADAPTER_RE = re.compile(r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$")
_VERSION_DIR = re.compile(r"^v(\d{1,9})-([0-9a-f]{12})$")
_CLAIM = re.compile(r"^v(\d{1,9})\.json$")
MAX_CLAIM_ATTEMPTS = 10_000


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One immutable, stored version of a tenant's adapter."""

    tenant: str
    name: str
    version: int
    digest: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    base_model: str
    created: bool
    # files of the upload beside the adapter (a Trainer's checkpoint artefacts), not stored
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], path: str, created: bool) -> AdapterVersion:
        return cls(
            tenant=manifest["tenant"],
            name=manifest["adapter"],
            version=manifest["version"],
            digest=manifest["digest"],
            path=path,
            rank=manifest["rank"],
            alpha=manifest["alpha"],
            target_modules=tuple(manifest["target_modules"]),
            size_bytes=manifest["size_bytes"],
            base_model=manifest["base_model"],
            created=created,
        )


def check_names(tenant: str, name: str) -> None:
    """Tenants are Kubernetes namespaces; adapter names are DNS-safe (no '@', no '/')."""
    if not TENANT_RE.match(tenant):
        raise ValueError(f"tenant {tenant!r} must be a DNS label: a-z, 0-9 and '-', at most 63")
    if not ADAPTER_RE.match(name):
        raise ValueError(
            f"adapter name {name!r} must be 1 to 63 of a-z, 0-9, '-', '.', '_' and start and "
            "end with a letter or digit"
        )


def adapter_prefix(tenant: str, name: str) -> str:
    return f"adapters/{tenant}/{name}/"


def version_path(tenant: str, name: str, version: int, digest: str) -> str:
    """The store folder of one version, ending in '/'."""
    return f"{adapter_prefix(tenant, name)}v{version}-{digest[:12]}/"


def _claims(store: ObjectStore, tenant: str, name: str) -> dict[int, str]:
    """version -> key of its claim object."""
    prefix = adapter_prefix(tenant, name) + "versions/"
    out = {}
    for key in store.list_keys(prefix):
        m = _CLAIM.match(key[len(prefix) :])
        if m:
            out[int(m.group(1))] = key
    return out


def _read_json(store: ObjectStore, key: str) -> dict[str, Any]:
    data = json.loads(store.get_bytes(key))
    if not isinstance(data, dict):
        raise StoreError(f"{key} in {store.url()} is not a JSON object")
    return data


def _put_once(
    store: ObjectStore, key: str, *, data: bytes | None = None, path: Path | None = None
) -> bool:
    """Create-only put; an existing object is the same content (its path says so): False."""
    try:
        if path is not None:
            store.put_file(key, path)
        else:
            store.put_bytes(key, data or b"")
    except ObjectExists:
        return False
    return True


def _complete(
    store: ObjectStore, vpath: str, canon: CanonicalAdapter, manifest: dict[str, Any]
) -> tuple[dict[str, Any], bool]:
    """Make sure every object of the version exists, the manifest last.

    Returns the stored manifest and whether this call wrote it (made the version complete).
    """
    manifest_key = vpath + MANIFEST_NAME
    if store.exists(manifest_key):
        return _read_json(store, manifest_key), False
    _put_once(store, vpath + CONFIG_NAME, path=canon.config_path)
    _put_once(store, vpath + WEIGHTS_NAME, path=canon.weights_path)
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    wrote = _put_once(store, manifest_key, data=data)
    return _read_json(store, manifest_key), wrote


def publish(
    store: ObjectStore,
    tenant: str,
    name: str,
    canon: CanonicalAdapter,
    summary: dict[str, Any],
    *,
    created_by: str | None = None,
) -> AdapterVersion:
    """Store canonical files as the next version, or return the version that holds them."""
    check_names(tenant, name)
    for _ in range(MAX_CLAIM_ATTEMPTS):
        claims = _claims(store, tenant, name)
        same = [
            v for v, key in claims.items() if _read_json(store, key).get("digest") == canon.digest
        ]
        if same:
            version = min(same)
        else:
            version = max(claims, default=0) + 1
            claim = {"digest": canon.digest, "version": version}
            try:
                store.put_bytes(
                    adapter_prefix(tenant, name) + f"versions/v{version}.json",
                    json.dumps(claim, sort_keys=True).encode(),
                )
            except ObjectExists:
                continue  # someone took this number: re-read the claims (maybe it is ours)
        vpath = version_path(tenant, name, version, canon.digest)
        manifest = {
            "format": MANIFEST_FORMAT,
            "tenant": tenant,
            "adapter": name,
            "version": version,
            "digest": canon.digest,
            "digest_algorithm": "sha256",
            **summary,
            "files": {CONFIG_NAME: canon.config_bytes, WEIGHTS_NAME: canon.weights_bytes},
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "created_by": created_by,
        }
        stored, created = _complete(store, vpath, canon, manifest)
        if stored.get("digest") != canon.digest:  # an existing object is checked, not trusted
            raise StoreError(
                f"{vpath} in {store.url()} holds digest {str(stored.get('digest'))[:16]}..., "
                f"not {canon.digest[:16]}...: the store was changed outside loraplane"
            )
        return AdapterVersion.from_manifest(stored, vpath, created)
    raise StoreError(
        f"could not claim a version for {tenant}/{name} after {MAX_CLAIM_ATTEMPTS} tries"
    )


def ingest(
    source: Path | str,
    tenant: str,
    name: str,
    base_model: BaseModelSpec,
    limits: AdapterLimits,
    store: ObjectStore,
    *,
    created_by: str | None = None,
    check_digest: Callable[[str], None] | None = None,
) -> AdapterVersion:
    """Validate the adapter at `source` (folder or archive) and store it as a version.

    Same content as an existing, complete version returns that version (`created` False); new
    content becomes the next version (`created` True). `check_digest` sees the canonical
    digest before anything is stored and may refuse it (a signature policy) by raising.
    Raises AdapterRejected (nothing stored) or StoreError.
    """
    check_names(tenant, name)
    staging = store.staging_dir()
    staging.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ingest-", dir=staging))
    try:
        with open_adapter_source(source, limits) as files:
            # The NaN/Inf scan runs while the canonical copy is written (one pass).
            adapter = validate_adapter(files, base_model, limits, scan_weights=False)
            try:
                summary = adapter.summary()
                canon = write_canonical(adapter, work, scan_weights=True)
            finally:
                adapter.close()
            ignored = files.ignored
        if check_digest is not None:
            check_digest(canon.digest)
        stored = publish(store, tenant, name, canon, summary, created_by=created_by)
        return replace(stored, ignored=ignored)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def list_versions(store: ObjectStore, tenant: str, name: str) -> list[AdapterVersion]:
    """Every complete version of an adapter (those with a manifest), oldest first."""
    check_names(tenant, name)
    prefix = adapter_prefix(tenant, name)
    out = []
    for key in store.list_keys(prefix):
        rest = key[len(prefix) :].split("/")
        if len(rest) == 2 and rest[1] == MANIFEST_NAME and _VERSION_DIR.match(rest[0]):
            out.append(
                AdapterVersion.from_manifest(_read_json(store, key), prefix + rest[0] + "/", False)
            )
    return sorted(out, key=lambda v: v.version)


__all__ = ["AdapterRejected", "AdapterVersion", "ReasonCode", "ingest", "list_versions", "publish"]
