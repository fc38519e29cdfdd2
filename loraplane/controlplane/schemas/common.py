"""Pieces shared by the API schemas: strict request bodies, names, quotas, the error shape.

Every constrained field type below takes its bounds and its sentence for people from one
table, `RULES`: the bounds go to pydantic (and the OpenAPI document), the sentence is the
field's description and what a refused value is told (`name: must be ... (got "My Adapter")`),
so no regex or pydantic wording reaches a person. The error handler
(`loraplane.controlplane.errors`) words every other kind of refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

# A Kubernetes namespace: a DNS label. A tenant is one; so is a pool's (its ServingPool's).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# Adapter and pool names: DNS-safe, no '@' (it pins a version) and no '/'.
RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$"
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$"
MODEL_URI = r"^(s3://[^\s]+|/[^\s]*)$"
DIGEST = r"^[0-9a-f]{64}$"
# Bounds keep every number inside the database's column types.
MAX_COUNT = 1_000_000
MAX_RANK = 4096
MAX_BYTES = 1 << 50
MAX_PIN_REPLICAS = 64  # copies of one pinned version in a pool, at most
MAX_PER_MINUTE = 1_000_000_000
# A tenant's share of a contended replica, relative to the other tenants' (1: an equal share).
MAX_WEIGHT = 1000.0
INT32 = 2**31 - 1
BIG = 2**62
# Quotas where 0 would read as "unlimited" elsewhere but cannot mean it: refused, saying so.
_NOT_UNLIMITED = "0 is refused: only the per-minute rate limits take 0 for unlimited"


@dataclass(frozen=True, slots=True)
class Rule:
    """What a field's value must be: `words` for people (after "must be"), and the pattern
    the value is checked against, if any (the handler finds a rule by its pattern)."""

    words: str
    pattern: str | None = None


# The one table of constraint descriptions: each constrained type below uses one entry.
RULES: dict[str, Rule] = {
    "dns_label": Rule(
        "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit",
        DNS_LABEL,
    ),
    "resource_name": Rule(
        "1-63 lowercase letters, digits, '-', '.' or '_', starting and ending with a letter "
        "or digit",
        RESOURCE_NAME,
    ),
    "model_name": Rule(
        "1-200 letters, digits, '.', '_', ':', '/' or '-', starting with a letter or digit",
        MODEL_NAME,
    ),
    "model_uri": Rule(
        "an absolute path (/...) or an s3:// URI, without spaces, at most 1024 characters",
        MODEL_URI,
    ),
    "digest": Rule("64 lowercase hexadecimal digits (a sha256)", DIGEST),
    "count": Rule(f"an integer from 0 to {MAX_COUNT}"),
    "adapters": Rule(f"an integer from 1 to {MAX_COUNT} ({_NOT_UNLIMITED})"),
    "rank": Rule(f"an integer from 1 to {MAX_RANK}"),
    "rank_quota": Rule(f"an integer from 1 to {MAX_RANK} ({_NOT_UNLIMITED})"),
    "bytes": Rule(f"an integer from 1 to {MAX_BYTES} (bytes; {_NOT_UNLIMITED})"),
    "per_minute": Rule(f"an integer from 0 to {MAX_PER_MINUTE} (0: unlimited)"),
    "pinned_bytes": Rule(f"an integer from 0 to {MAX_BYTES} (bytes; 0: only the admin pins)"),
    "replicas": Rule(f"an integer from 1 to {MAX_PIN_REPLICAS}"),
    "weight": Rule(f"a number greater than 0 and at most {MAX_WEIGHT:g}"),
}


def must_be(rule: str) -> str:
    """'must be <the rule's words>'."""
    return f"must be {RULES[rule].words}"


def rule_for_pattern(pattern: str) -> Rule | None:
    """The table's rule checked with `pattern` (a query parameter declares only that)."""
    return next((r for r in RULES.values() if r.pattern == pattern), None)


def _worded(rule: str) -> WrapValidator:
    """Refuse what the inner checks refuse with the rule's words; pydantic's own message
    stays in the error's context (`detail`) for programs."""
    words = RULES[rule].words

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            detail = "; ".join(str(e["msg"]) for e in exc.errors())
            raise PydanticCustomError(
                "invalid_value", "must be {rule}", {"rule": words, "detail": detail}
            ) from None

    return WrapValidator(check)


def _text(rule: str, *, max_length: int) -> Any:
    r = RULES[rule]
    return Field(min_length=1, max_length=max_length, pattern=r.pattern, description=r.words)


def _number(rule: str, **bounds: Any) -> Any:
    return Field(description=RULES[rule].words, **bounds)


Namespace = Annotated[str, _text("dns_label", max_length=63), _worded("dns_label")]
TenantName = Namespace
ResourceName = Annotated[str, _text("resource_name", max_length=63), _worded("resource_name")]
ModelName = Annotated[str, _text("model_name", max_length=200), _worded("model_name")]
ModelUri = Annotated[str, _text("model_uri", max_length=1024), _worded("model_uri")]
Count = Annotated[int, _number("count", ge=0, le=MAX_COUNT), _worded("count")]
AdapterCount = Annotated[int, _number("adapters", ge=1, le=MAX_COUNT), _worded("adapters")]
Rank = Annotated[int, _number("rank", ge=1, le=MAX_RANK), _worded("rank")]
RankQuota = Annotated[int, _number("rank_quota", ge=1, le=MAX_RANK), _worded("rank_quota")]
Bytes = Annotated[int, _number("bytes", ge=1, le=MAX_BYTES), _worded("bytes")]
PerMinute = Annotated[int, _number("per_minute", ge=0, le=MAX_PER_MINUTE), _worded("per_minute")]
PinnedBytes = Annotated[int, _number("pinned_bytes", ge=0, le=MAX_BYTES), _worded("pinned_bytes")]
PinReplicas = Annotated[int, _number("replicas", ge=1, le=MAX_PIN_REPLICAS), _worded("replicas")]
Weight = Annotated[
    float, _number("weight", gt=0, le=MAX_WEIGHT, allow_inf_nan=False), _worded("weight")
]


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


class FieldProblem(BaseModel):
    """One refused part of a request, for programs."""

    field: str = Field(description="where: `name`, `base_model.uri`, `body`, ...")
    message: str = Field(description="what it must be, in words (as in the message)")
    type: str = Field(description="pydantic's error type (`invalid_value` for the rules)")
    detail: str = Field(description="pydantic's own wording of the refusal")


class RequestErrorDetail(ErrorDetail):
    """A refused request (400 InvalidRequest): a message for people, `errors` for programs.

    The message names each refused field and what it must be, in words; `errors` lists the
    fields one by one (absent when the refusal is not about fields: a content type, ...).
    """

    errors: list[FieldProblem] | None = None


class RequestErrorBody(BaseModel):
    """A 400 answer."""

    error: RequestErrorDetail
