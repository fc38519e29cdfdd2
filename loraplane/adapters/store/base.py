"""The object-store interface: create-only, '/'-separated keys, two real backends."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path

_KEY_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@=-]{0,252}$")


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative object key, else raise ValueError.

    Keys are '/'-joined parts of letters, digits and `._@=-`; no part is empty, `.` or `..`,
    so a key can never name a path outside the store's root.
    """
    parts = key.split("/")
    if not key or any(not _KEY_PART.match(p) or p in {".", ".."} for p in parts):
        raise ValueError(f"unsafe object key {key!r}")
    return key


class ObjectStore(ABC):
    """Immutable object storage: every write creates a new object or fails with ObjectExists.

    Backends raise `ObjectExists` when a create-only write meets an existing key,
    `ObjectNotFound` when a read misses, and `StoreError` for transient faults.
    """

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Create the object `key` holding `data`; ObjectExists if it is already there."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Create the object `key` with the contents of the local file `path` (left in place)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Return the whole object (for small objects: manifests, configs, claims)."""

    @abstractmethod
    def download(self, key: str, dest: Path) -> None:
        """Write the object to the local file `dest` (atomically: temp file, then rename)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object `key` exists."""

    @abstractmethod
    def list_keys(self, prefix: str) -> list[str]:
        """All keys under `prefix` (a '/'-terminated folder or a key prefix), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object (retention jobs only; serving never deletes)."""

    @abstractmethod
    def staging_dir(self) -> Path:
        """A local directory for temporary files that will be `put_file`d into this store.

        LocalStore returns a folder on its own filesystem, so a put can link instead of copy.
        """

    @abstractmethod
    def url(self) -> str:
        """Where this store lives, for messages and manifests (a path or `s3://bucket/prefix`)."""
