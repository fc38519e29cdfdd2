"""Immutable object storage for adapters: a local directory or an S3 bucket, one interface."""

from __future__ import annotations

from loraplane.adapters.store.base import ObjectStore, check_key
from loraplane.adapters.store.local import LocalStore
from loraplane.adapters.store.s3 import S3Store

__all__ = ["LocalStore", "ObjectStore", "S3Store", "check_key", "open_store"]


def open_store(spec: str) -> ObjectStore:
    """Open the store that `spec` names: `s3://bucket[/prefix]` or a local directory path.

    An S3 store gets a default boto3 client, so endpoint, region and credentials come from
    boto3's own configuration (`AWS_ENDPOINT_URL`, `AWS_REGION`, profiles, ...). Any other
    `scheme://` is refused rather than taken for a directory name.
    """
    if spec.startswith("s3://"):
        bucket, _, prefix = spec.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"store: no bucket in {spec!r}")
        return S3Store(bucket, prefix)
    if "://" in spec:
        raise ValueError(f"store: unsupported scheme in {spec!r} (use s3:// or a path)")
    if not spec:
        raise ValueError("store: empty store location")
    return LocalStore(spec)
