"""The internal API between the control plane, the data plane and the operator."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field, field_validator

from loraplane.adapters.base_model import MAX_CONFIG_BYTES
from loraplane.controlplane.models import DEFAULT_NAMESPACE
from loraplane.controlplane.schemas.common import (
    BIG,
    INT32,
    ModelName,
    Namespace,
    ResourceName,
    Strict,
    TenantName,
)
from loraplane.controlplane.schemas.pins import PinAssignment, PinState

Counter = Field(default=0, ge=0, le=BIG)


class RolloutTarget(BaseModel):
    """One version of a weighted rollout, with what the data plane needs to load it."""

    version: int
    weight: int
    digest: str
    path: str
    rank: int
    alpha: float


class Resolved(BaseModel):
    """What a model name means for one tenant: an adapter version or the base model.

    `rollout`, for an unpinned name under a weighted rollout: every version of the split and
    its weight (the data plane picks one per request by weight and loads each ahead); the
    fields of `version` stay the current one (what a data plane that ignores `rollout`
    serves, and what a rollback returns to)."""

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
    # the tenant's share of a contended replica's seats and served tokens, relative to the
    # other tenants' weights (a data plane that finds none, an older control plane, uses 1)
    weight: float
    rollout: list[RolloutTarget] | None = None


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

    namespace: Namespace = DEFAULT_NAMESPACE  # the pool's (LORAPLANE_POOL_NAMESPACE)
    pool: ResourceName
    replica: str = Field(min_length=1, max_length=253)
    deferred: int = Field(default=0, ge=0, le=BIG)
    waiting_adapters: int = Field(default=0, ge=0, le=INT32)
    running_adapters: int = Field(default=0, ge=0, le=INT32)
    slots_used: int = Field(default=0, ge=0, le=INT32)
    gpu_bytes: int = Field(default=0, ge=0, le=BIG)  # adapter memory used in the device pool
    gpu_bytes_capacity: int = Field(default=0, ge=0, le=BIG)  # the adapter memory budget
    # host bytes of the host tier's copies (under tensor parallelism every rank's part), and
    # its byte limit (--max-cpu-lora-bytes; null: none); reporters from before them send none
    cpu_bytes: int = Field(default=0, ge=0, le=BIG)
    cpu_bytes_capacity: int | None = Field(default=None, ge=1, le=BIG)
    kv_usage: float = Field(default=0.0, ge=0.0, le=1.0)
    adapters_waiting: list[WaitingAdapter] = Field(default_factory=list, max_length=10_000)
    usage: list[AdapterUsage] = Field(default_factory=list, max_length=10_000)
    # the usage's batch id: a report whose answer was lost is sent again with the same batch,
    # and the control plane counts a replica's batch once (it keeps the last one per replica)
    usage_batch: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    # the config.json the replica loaded its base model from: sent until the answer says the
    # pool has one (a pool whose model is only on the replicas' volume learns it this way)
    base_model_config: dict[str, Any] | None = None
    # what became of each version the last answer assigned to this replica (held or refused,
    # and why): GET /v1/pins shows it per pin
    pin_states: list[PinState] = Field(default_factory=list, max_length=10_000)

    @field_validator("base_model_config")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(json.dumps(value)) > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES} bytes, as no config.json is")
        return value


class PressureAccepted(BaseModel):
    """How a report was recorded."""

    namespace: str
    pool: str
    replica: str
    usage_rows: int
    usage_skipped: int
    # the report's usage batch was counted before (its first answer was lost): not again
    usage_duplicate: bool = False
    # replicas of the pool that reported in the last 30 s, this one included: each enforces
    # 1/replicas of a tenant's requests and tokens per minute, so the tenant's limit holds
    # across the pool as it scales
    replicas: int = 1
    # whether the pool has its base model's config.json (the replica stops sending its own)
    base_model_config_known: bool
    # the pinned versions this replica keeps resident (crud/pins.py assigns each pin's copies
    # to the pool's live replicas); those left out are unpinned there
    pins: list[PinAssignment] = []


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
    signature: str | None = Field(
        default=None, max_length=512, description="the LoRAAdapter's `spec.source.signature`"
    )
    signature_key_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")


class SigningKeyEntry(BaseModel):
    """One of a tenant's signing keys, as the operator verifies with it."""

    key_id: str
    public_key: str
    revoked: bool


class SigningPolicy(BaseModel):
    """What an adapter of one tenant and base model must carry: a signature when `required`
    (`reason` says whose policy), by one of `keys` that is not revoked."""

    tenant: str
    required: bool
    reason: str
    keys: list[SigningKeyEntry]
