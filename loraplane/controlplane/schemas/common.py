"""Pieces shared by the API schemas: strict request bodies, names, the error shape."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A Kubernetes namespace: a DNS label. A tenant is one; so is a pool's (its ServingPool's).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Namespace = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]
TenantName = Namespace
# Adapter and pool names: DNS-safe, no '@' (it pins a version) and no '/'.
ResourceName = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$")
]
ModelName = Annotated[
    str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
]
# Bounds keep every number inside the database's column types.
Count = Annotated[int, Field(ge=0, le=1_000_000)]
Rank = Annotated[int, Field(ge=1, le=4096)]
Bytes = Annotated[int, Field(ge=1, le=1 << 50)]
PerMinute = Annotated[int, Field(ge=1, le=1_000_000_000)]
# A tenant's share of a contended replica, relative to the other tenants' (1: an equal share).
MAX_WEIGHT = 1000.0
Weight = Annotated[float, Field(gt=0, le=MAX_WEIGHT, allow_inf_nan=False)]
INT32 = 2**31 - 1
BIG = 2**62


class Strict(BaseModel):
    """A request body: unknown fields are refused (no mass assignment)."""

    model_config = ConfigDict(extra="forbid")


class Public(BaseModel):
    """An answer built from ORM rows."""

    model_config = ConfigDict(from_attributes=True)


class ErrorDetail(BaseModel):
    """What went wrong: a machine-readable code (a ReasonCode for adapters) and a message."""

    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer."""

    error: ErrorDetail
