"""Pinned adapter versions: the request, the answer, a replica's assignment, and what the
replicas report became of it."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from loraplane.controlplane.models import DEFAULT_NAMESPACE, AdapterPin
from loraplane.controlplane.schemas.common import (
    DIGEST,
    Namespace,
    PinReplicas,
    ResourceName,
    Strict,
    TenantName,
)

HELD = ("resident", "host", "loading")  # states of a version a replica keeps pinned
REFUSED = "refused: "  # a state's prefix when the replica's engine would not keep it


class PinCreate(Strict):
    """Keep a version resident on `replicas` replicas of the pool (namespace/pool)."""

    pool: ResourceName
    namespace: Namespace = DEFAULT_NAMESPACE
    replicas: PinReplicas = 1


class PinReplica(BaseModel):
    """One replica the pin is assigned to and what its last report says of it: `resident`
    (on the device), `host` (placed at its next step), `loading`, `failed: <why>`,
    `refused: <why>` (its engine would not keep it: past half its adapter memory or slots)
    or `pending` (its last report does not say yet)."""

    replica: str
    state: str


class PinRefusal(BaseModel):
    """A replica that refused the pin, and its reason."""

    replica: str
    reason: str


class PinPublic(BaseModel):
    """A pin: `pinned_bytes` is what it counts against the tenant's max_pinned_bytes (the
    version's size times its replicas). `held` counts the assigned replicas that keep it
    (`resident`, `host` or `loading`), `resident` those with it on the device now; `refused`
    names those whose engine would not keep it, with the reason; `placement` is every
    assigned replica's state, from their last pressure reports."""

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
    held: int = 0
    resident: int = 0
    refused: list[PinRefusal] = []
    placement: list[PinReplica] = []

    @classmethod
    def of(
        cls, pin: AdapterPin, tenant: str, adapter: str, placement: list[PinReplica] | None = None
    ) -> PinPublic:
        """The answer for `pin` (of `tenant`'s `adapter`), with the states its assigned
        replicas reported (`placement`)."""
        v = pin.version
        where = placement or []
        return cls(
            tenant=tenant, adapter=adapter, version=v.version, digest=v.digest,
            namespace=pin.pool.namespace, pool=pin.pool.name, replicas=pin.replicas,
            size_bytes=v.size_bytes, pinned_bytes=v.size_bytes * pin.replicas,
            created_at=pin.created_at, created_by=pin.created_by,
            held=sum(p.state in HELD for p in where),
            resident=sum(p.state == "resident" for p in where),
            refused=[PinRefusal(replica=p.replica, reason=p.state.removeprefix(REFUSED))
                     for p in where if p.state.startswith(REFUSED)],
            placement=where,
        )  # fmt: skip


class PinAssignment(BaseModel):
    """A version the reporting replica keeps resident (in a pressure answer)."""

    tenant: str
    adapter: str
    version: int
    digest: str
    path: str


class PinState(Strict):
    """What became of one version assigned to the reporting replica (in a pressure report):
    `resident`, `host`, `loading`, `failed: <why>`, `refused: <why>` or `pending`."""

    tenant: TenantName
    adapter: ResourceName
    digest: str = Field(pattern=DIGEST)
    state: str = Field(min_length=1, max_length=1000)
