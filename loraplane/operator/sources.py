"""Fetch a LoRAAdapter's `spec.source.uri` into a local work folder, defensively.

- `s3://bucket/key`: with the credentials of the `secretRef` Secret (the tenant's own), or
  with the operator's credentials for buckets in LORAPLANE_IMPORT_BUCKETS only. A key ending in
  .tar.gz/.tgz/.tar/.zip is one archive; any other key is a folder holding the adapter's two
  files. A Secret's endpoint (`AWS_ENDPOINT_URL`) must be the configured one or an allowlisted
  host, so a tenant cannot aim the operator at internal addresses.
- `upload://<id>`: files the control plane staged in the store under `uploads/<id>/`.
- `https://host/...archive`: only allowlisted hosts (LORAPLANE_SOURCE_HOSTS), no redirects.

Every read is bounded by a byte cap. Failures are `SourceError`s that say whether retrying
can help (`permanent`); an oversized source is `AdapterRejected(TooLarge)`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx

from loraplane.adapters import s3read
from loraplane.adapters.errors import AdapterRejected, ReasonCode, StoreError
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME
from loraplane.adapters.store.base import ObjectStore

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
UPLOAD_PREFIX = "uploads"
_UPLOAD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 1 << 20


class SourceError(Exception):
    """The source could not be read; `permanent` means no retry can help."""

    def __init__(self, reason: str, message: str, *, permanent: bool) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.permanent = permanent


def not_allowed(message: str) -> SourceError:
    return SourceError("SourceNotAllowed", message, permanent=True)


@dataclass(frozen=True, slots=True)
class SourcePolicy:
    """What the operator may read: allowlisted hosts and buckets, a byte cap."""

    max_bytes: int
    s3_endpoint_url: str | None = None
    source_hosts: tuple[str, ...] = ()
    import_buckets: tuple[str, ...] = ()
    timeout_seconds: float = 30.0


def _archive_name(key: str) -> str | None:
    lower = key.lower()
    suffix = next((s for s in ARCHIVE_SUFFIXES if lower.endswith(s)), None)
    return f"adapter{suffix}" if suffix else None


def _too_large(what: str, cap: int) -> AdapterRejected:
    return AdapterRejected(ReasonCode.TOO_LARGE, f"{what} is larger than {cap} bytes")


def _write_bounded(chunks: Iterator[bytes], dest: Path, cap: int, what: str) -> int:
    size = 0
    with dest.open("wb") as out:
        for chunk in chunks:
            size += len(chunk)
            if size > cap:
                raise _too_large(what, cap)
            out.write(chunk)
    return size


# -- s3:// ------------------------------------------------------------------------------------


def _s3_client(policy: SourcePolicy, bucket: str, secret: Mapping[str, str] | None) -> S3Client:
    if secret is None:
        if bucket not in policy.import_buckets:
            raise not_allowed(
                f"bucket {bucket!r} needs a source.secretRef with credentials (only the "
                "operator's import buckets are read with its own credentials)"
            )
        return s3read.make_client(policy.s3_endpoint_url)
    key_id, key = secret.get("AWS_ACCESS_KEY_ID"), secret.get("AWS_SECRET_ACCESS_KEY")
    if not key_id or not key:
        raise SourceError(
            "InvalidSecret",
            "the secretRef Secret needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            permanent=False,
        )
    endpoint = secret.get("AWS_ENDPOINT_URL") or policy.s3_endpoint_url
    if endpoint and endpoint != policy.s3_endpoint_url:
        host = urlsplit(endpoint).hostname or ""
        if host not in policy.source_hosts:
            raise not_allowed(f"S3 endpoint host {host!r} is not in the operator's allowlist")
    return s3read.make_client(
        endpoint,
        access_key_id=key_id,
        secret_access_key=key,
        session_token=secret.get("AWS_SESSION_TOKEN") or None,
        region_name=secret.get("AWS_REGION") or "us-east-1",
    )


def _s3_error(exc: s3read.S3ReadError) -> SourceError:
    reason = (
        "SourceNotFound"
        if exc.missing
        else "SourceForbidden"
        if exc.denied
        else "SourceUnavailable"
    )
    return SourceError(reason, str(exc), permanent=False)


def fetch_s3(uri: str, work: Path, policy: SourcePolicy, secret: Mapping[str, str] | None) -> Path:
    """Download an S3 source into `work`; returns what the adapter core should read."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    key = key.strip("/")
    if not bucket or not key:
        raise not_allowed(f"{uri} names no bucket and key")
    client = _s3_client(policy, bucket, secret)
    archive = _archive_name(key)
    wanted = (
        [(key, work / archive)]
        if archive
        else [(f"{key}/{name}", work / "adapter" / name) for name in (CONFIG_NAME, WEIGHTS_NAME)]
    )
    budget = policy.max_bytes
    for object_key, dest in wanted:
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            budget -= s3read.download(client, bucket, object_key, dest, max_bytes=budget)
        except s3read.ObjectTooLarge:
            raise _too_large(uri, policy.max_bytes) from None
        except s3read.S3ReadError as exc:
            raise _s3_error(exc) from exc
    return wanted[0][1] if archive else work / "adapter"


# -- upload:// --------------------------------------------------------------------------------


def fetch_upload(uri: str, work: Path, store: ObjectStore, max_bytes: int) -> Path:
    """Copy the files staged under `uploads/<id>/` in the store into `work`."""
    upload_id = uri.removeprefix("upload://")
    if not _UPLOAD_ID.match(upload_id):
        raise not_allowed(f"{uri} is not a valid upload id")
    prefix = f"{UPLOAD_PREFIX}/{upload_id}/"
    try:
        keys = store.list_keys(prefix)
    except StoreError as exc:
        raise SourceError("StoreUnavailable", str(exc), permanent=False) from exc
    names = {k[len(prefix) :]: k for k in keys if "/" not in k[len(prefix) :]}
    if not names:
        raise SourceError("SourceNotFound", f"nothing is staged under {prefix}", permanent=False)
    if CONFIG_NAME in names and WEIGHTS_NAME in names:
        chosen = {CONFIG_NAME: names[CONFIG_NAME], WEIGHTS_NAME: names[WEIGHTS_NAME]}
        folder: Path | None = work / "adapter"
    else:
        archives = [n for n in names if _archive_name(n)]
        if len(archives) != 1:
            raise AdapterRejected(
                ReasonCode.UNSUPPORTED_FORMAT,
                f"{uri} must hold {CONFIG_NAME} and {WEIGHTS_NAME}, or one archive",
            )
        chosen = {str(_archive_name(archives[0])): names[archives[0]]}
        folder = None
    total = 0
    target = work / "adapter" if folder else work
    target.mkdir(parents=True, exist_ok=True)
    for local, key in chosen.items():
        try:
            store.download(key, target / local)
        except StoreError as exc:
            raise SourceError("StoreUnavailable", str(exc), permanent=False) from exc
        total += (target / local).stat().st_size
        if total > max_bytes:
            raise _too_large(uri, max_bytes)
    return folder if folder else target / next(iter(chosen))


# -- https:// ---------------------------------------------------------------------------------


def fetch_https(
    uri: str, work: Path, policy: SourcePolicy, transport: httpx.BaseTransport | None = None
) -> Path:
    """Download an allowlisted https archive (no redirects, bounded)."""
    parts = urlsplit(uri)
    if parts.scheme != "https" or parts.username or parts.password:
        raise not_allowed("only plain https:// URLs (no credentials in the URL) are read")
    if (parts.hostname or "") not in policy.source_hosts:
        raise not_allowed(f"host {parts.hostname!r} is not in the operator's allowlist")
    archive = _archive_name(parts.path)
    if not archive:
        raise not_allowed("an https:// source must name a .tar.gz, .tgz, .tar or .zip file")
    dest = work / archive
    work.mkdir(parents=True, exist_ok=True)
    try:
        with (
            httpx.Client(
                follow_redirects=False, timeout=policy.timeout_seconds, transport=transport
            ) as client,
            client.stream("GET", uri) as response,
        ):
            if response.is_redirect:
                raise not_allowed(f"{uri} answered a redirect; redirects are not followed")
            if response.status_code == 404:
                raise SourceError("SourceNotFound", f"{uri} answered 404", permanent=False)
            if response.status_code != 200:
                raise SourceError(
                    "SourceUnavailable",
                    f"{uri} answered HTTP {response.status_code}",
                    permanent=False,
                )
            length = response.headers.get("content-length")
            if length and length.isdigit() and int(length) > policy.max_bytes:
                raise _too_large(uri, policy.max_bytes)
            _write_bounded(response.iter_bytes(_CHUNK), dest, policy.max_bytes, uri)
    except httpx.HTTPError as exc:
        raise SourceError(
            "SourceUnavailable", f"cannot read {uri}: {exc}", permanent=False
        ) from exc
    return dest


def fetch_source(
    uri: str,
    work: Path,
    *,
    policy: SourcePolicy,
    store: ObjectStore,
    secret: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
) -> Path:
    """Fetch any supported source into `work` (an empty folder)."""
    if uri.startswith("s3://"):
        return fetch_s3(uri, work, policy, secret)
    if uri.startswith("upload://"):
        return fetch_upload(uri, work, store, policy.max_bytes)
    if uri.startswith("https://"):
        return fetch_https(uri, work, policy, transport)
    raise not_allowed(f"unsupported source {uri[:80]!r}: use s3://, upload:// or https://")
