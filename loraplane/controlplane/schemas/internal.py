"""The internal API between the control plane, the data plane and the operator."""

from __future__ import annotations

from pydantic import BaseModel, Field

from loraplane.controlplane.schemas.common import (
    BIG,
    INT32,
    ModelName,
    ResourceName,
    Strict,
    TenantName,
)

Counter = Field(default=0, ge=0, le=BIG)


class Resolved(BaseModel):
    """What a model name means for one tenant: an adapter version or the base model."""

    tenant: str
    base_model: str
    adapter: str | None
    version: int | None
    digest: str | None
    path: str | None
    rank: int | None
    alpha: float | None
    requests_per_minute: int
    tokens_per_minute: int


class AdapterUsage(Strict):
    """Usage counters since the last report, for one tenant's adapter ("" = base model)."""

    tenant: TenantName
    adapter: str = Field(default="", max_length=63)
    requests: int = Counter
    prompt_tokens: int = Counter
    completion_tokens: int = Counter


class WaitingAdapter(Strict):
    """Requests waiting for one adapter."""

    tenant: TenantName
    adapter: ResourceName
    waiting_requests: int = Field(ge=0, le=INT32)


class PressureReport(Strict):
    """A data plane replica's slot pressure, plus usage since its last report."""

    pool: ResourceName
    replica: str = Field(min_length=1, max_length=253)
    deferred: int = Field(default=0, ge=0, le=BIG)
    waiting_adapters: int = Field(default=0, ge=0, le=INT32)
    running_adapters: int = Field(default=0, ge=0, le=INT32)
    slots_used: int = Field(default=0, ge=0, le=INT32)
    gpu_bytes: int = Field(default=0, ge=0, le=BIG)  # adapter memory used in the device pool
    gpu_bytes_capacity: int = Field(default=0, ge=0, le=BIG)  # the adapter memory budget
    kv_usage: float = Field(default=0.0, ge=0.0, le=1.0)
    adapters_waiting: list[WaitingAdapter] = Field(default_factory=list, max_length=10_000)
    usage: list[AdapterUsage] = Field(default_factory=list, max_length=10_000)


class PressureAccepted(BaseModel):
    """How a report was recorded."""

    pool: str
    replica: str
    usage_rows: int
    usage_skipped: int
    # replicas of the pool that reported in the last 30 s, this one included: each enforces
    # 1/replicas of a tenant's requests and tokens per minute, so the tenant's limit holds
    # across the pool as it scales
    replicas: int = 1


class VersionRecord(Strict):
    """A version the operator stored with the shared ingest code."""

    tenant: TenantName = Field(
        description="the LoRAAdapter's namespace: the tenant whose namespace it is"
    )
    name: ResourceName
    version: int = Field(ge=1, le=INT32)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    path: str = Field(min_length=1, max_length=512)
    rank: int = Field(ge=1, le=4096)
    alpha: float = Field(allow_inf_nan=False)
    target_modules: list[str] = Field(max_length=64)
    size_bytes: int = Field(ge=0, le=BIG)
    base_model: ModelName
    created_by: str = Field(default="operator", max_length=200)
