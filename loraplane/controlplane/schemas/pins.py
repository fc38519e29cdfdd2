"""Pinned adapter versions: the request, the answer, and a replica's assignment."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from loraplane.controlplane.models import DEFAULT_NAMESPACE, AdapterPin
from loraplane.controlplane.schemas.common import Namespace, PinReplicas, ResourceName, Strict


class PinCreate(Strict):
    """Keep a version resident on `replicas` replicas of the pool (namespace/pool)."""

    pool: ResourceName
    namespace: Namespace = DEFAULT_NAMESPACE
    replicas: PinReplicas = 1


class PinPublic(BaseModel):
    """A pin: `pinned_bytes` is what it counts against the tenant's max_pinned_bytes (the
    version's size times its replicas)."""

    tenant: str
    adapter: str
    version: int
    digest: str
    namespace: str
    pool: str
    replicas: int
    size_bytes: int
    pinned_bytes: int
    created_at: datetime
    created_by: str

    @classmethod
    def of(cls, pin: AdapterPin, tenant: str, adapter: str) -> PinPublic:
        """The answer for `pin` (of `tenant`'s `adapter`)."""
        v = pin.version
        return cls(
            tenant=tenant, adapter=adapter, version=v.version, digest=v.digest,
            namespace=pin.pool.namespace, pool=pin.pool.name, replicas=pin.replicas,
            size_bytes=v.size_bytes, pinned_bytes=v.size_bytes * pin.replicas,
            created_at=pin.created_at, created_by=pin.created_by,
        )  # fmt: skip


class PinAssignment(BaseModel):
    """A version the reporting replica keeps resident (in a pressure answer)."""

    tenant: str
    adapter: str
    version: int
    digest: str
    path: str
