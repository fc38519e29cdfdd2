"""Serving pools: a base model and its LoRA limits."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from loraplane.controlplane.models import DEFAULT_NAMESPACE
from loraplane.controlplane.schemas.common import (
    Bytes,
    Count,
    ModelName,
    ModelUri,
    Namespace,
    Public,
    Rank,
    ResourceName,
    Strict,
)
from loraplane.controlplane.schemas.pins import PinPublic


class BaseModelRef(Strict):
    """A base model: its served name and where its config.json is (a path or s3:// URI)."""

    name: ModelName
    uri: ModelUri
    config_from_replicas: bool = Field(
        default=False,
        description="the model is only where the pool's replicas see it (a volume they mount "
        "at `uri`): its config.json is not read here but taken from their first pressure "
        "report; until then uploads for a base model only such pools serve answer 409 "
        "BaseModelPending",
    )


class PoolCreate(Strict):
    """A new pool, named by namespace and name (in a cluster: a ServingPool, mirrored)."""

    namespace: Namespace = DEFAULT_NAMESPACE
    name: ResourceName
    base_model: BaseModelRef
    max_lora_rank: Rank = 64
    max_loras: Count = 8
    max_cpu_loras: Count = 32
    max_cpu_lora_bytes: Bytes | None = Field(
        default=None,
        description="host bytes a replica's host tier may take (its adapters' copies; under "
        "tensor parallelism every rank's part): `--max-cpu-lora-bytes`; null: no byte limit",
    )
    require_signed_adapters: bool = Field(
        default=False,
        description="uploads for this pool's base model must carry a valid signature by one "
        "of their tenant's signing keys (an operator's PUT of an existing pool keeps it)",
    )


class PoolUpdate(Strict):
    """New limits; fields left out keep their value (the base model is immutable)."""

    max_lora_rank: Rank | None = None
    max_loras: Count | None = None
    max_cpu_loras: Count | None = None
    # null given explicitly clears the byte limit (left out: kept)
    max_cpu_lora_bytes: Bytes | None = None
    require_signed_adapters: bool | None = None


class BaseModelPublic(BaseModel):
    """A pool's base model."""

    name: str
    uri: str


class PoolPublic(Public):
    """A pool, with the latest pressure each replica reported."""

    namespace: str
    name: str
    base_model: BaseModelPublic
    base_model_config: dict[str, Any] | None = Field(
        description="the base model's config.json uploads are validated against; null while "
        "its replicas have not reported it yet (`config_from_replicas`)"
    )
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int
    max_cpu_lora_bytes: int | None = None
    require_signed_adapters: bool = False
    pinned_replicas: int = Field(
        default=0,
        description="the most replicas one pinned version of this pool asks for (0: none): "
        "the operator never scales the pool below it",
    )
    pressure: dict[str, Any] | None
    pressure_at: datetime | None
    created_at: datetime
    updated_at: datetime


class PoolInternal(PoolPublic):
    """A pool as the operator reads it (`GET /internal/v1/pools/{pool}`): `PoolPublic` and
    the pool's pins, each with what its assigned replicas' last pressure reports say (held,
    refused and why), which the ServingPool's status shows."""

    pins: list[PinPublic] = Field(
        default_factory=list,
        description="every pin of the pool, oldest first, as `GET /v1/pins` shows each",
    )
