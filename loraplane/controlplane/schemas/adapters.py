"""Adapters, their versions, and usage (the tenant API)."""

from __future__ import annotations

from datetime import date, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from loraplane.controlplane.schemas.common import (
    INT32,
    ErrorDetail,
    ModelName,
    Public,
    ResourceName,
    Strict,
)


class AdapterImport(Strict):
    """Import an adapter from an allowlisted S3 bucket (a folder or a .tar.gz/.zip object)."""

    name: ResourceName
    base_model: ModelName
    source_uri: str = Field(min_length=1, max_length=1024)
    signature: str | None = Field(
        default=None,
        max_length=512,
        description="base64 signature of `sha256:<digest>` (docs/security.md, Signed adapters)",
    )
    signature_key_id: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{16}$", description="the signing key's id"
    )


Weight = Annotated[int, Field(ge=0, le=100)]


class AdapterUpdate(Strict):
    """Choose what the adapter's plain name serves: one version, or a weighted rollout (the
    body names exactly one of `current_version` and `rollout`)."""

    current_version: int | None = Field(
        default=None,
        ge=1,
        le=INT32,
        description="a recorded version: serve it and hold it (later pushes do not change "
        "what is served; roll back or forward with it); null: serve the latest version and "
        "follow later pushes again. Either ends a running rollout",
    )
    rollout: dict[Annotated[int, Field(ge=1, le=INT32)], Weight] | None = Field(
        default=None,
        description='a weighted split of the plain name\'s traffic, `{"3": 90, "4": 10}`: '
        "version -> integer weight, 1 to 4 versions, the weights summing to 100; "
        "`name@version` requests are not split. One version at 100 promotes it",
    )

    @model_validator(mode="after")
    def _one_choice(self) -> AdapterUpdate:
        chosen = self.model_fields_set & {"current_version", "rollout"}
        if len(chosen) != 1:
            raise ValueError("name exactly one of current_version and rollout")
        if "rollout" in chosen and self.rollout is None:
            raise ValueError("rollout is an object of version -> weight (end one with "
                             "POST /v1/adapters/{name}/rollout/rollback)")  # fmt: skip
        return self


class RolloutSet(Strict):
    """The operator's: a LoRAAdapter's `spec.rollout` as a split, or null for none."""

    rollout: dict[Annotated[int, Field(ge=1, le=INT32)], Weight] | None


class RolloutPromote(Strict):
    """Which version of the running rollout to make current."""

    version: int | None = Field(
        default=None,
        ge=1,
        le=INT32,
        description="a version of the rollout; omitted: its one version besides the current",
    )


class RolloutVersion(BaseModel):
    """One version's share of an adapter's unpinned traffic."""

    version: int
    weight: int


class VersionPublic(Public):
    """One immutable version of an adapter."""

    version: int
    digest: str
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    base_model: str
    created_at: datetime
    created_by: str
    signing_key_id: str | None = Field(
        default=None,
        description="the tenant signing key whose signature was verified at upload (null: "
        "unsigned)",
    )
    signed_digest: str | None = Field(
        default=None,
        description="the message that signature verified over: `sha256:` + `digest`",
    )
    signature: str | None = Field(default=None, description="the verified signature, base64")


class AdapterPublic(BaseModel):
    """An adapter, with the version it serves."""

    name: str
    base_model: str
    current_version: int | None = Field(description="the version the plain name serves")
    latest_version: int | None
    follow_latest: bool = Field(
        description="true: a push serves the new version; false: a chosen version "
        "(current_version) keeps serving until PATCH current_version null"
    )
    rollout: list[RolloutVersion] | None = Field(
        default=None,
        description="the weighted split of the plain name's traffic while a rollout runs "
        "(null: current_version takes it all; a rollback returns to current_version)",
    )
    created_at: datetime
    updated_at: datetime
    current: VersionPublic | None


class UploadResult(BaseModel):
    """The version an upload produced (`created`) or matched (identical content)."""

    name: str
    created: bool
    current_version: int | None
    version: VersionPublic
    ignored: list[str] = Field(
        default_factory=list,
        description="files of the upload beside the adapter (a Trainer checkpoint's "
        "training_args.bin, optimizer.pt, tokenizer, ...): never opened, not stored",
    )


class StagedAdapter(BaseModel):
    """Cluster mode: the upload is staged and the tenant's LoRAAdapter points at it; the
    operator ingests it and records the version (GET /v1/adapters/{name} then shows it)."""

    name: str
    state: Literal["staged"] = "staged"
    source_uri: str
    resource: str = Field(description="the LoRAAdapter, as <namespace>/<name>")
    ignored: list[str] = Field(
        default_factory=list, description="files of the upload beside the adapter, not staged"
    )


class UsagePublic(Public):
    """A day of one adapter's use ("" is the base model)."""

    adapter: str
    day: date
    requests: int
    prompt_tokens: int
    completion_tokens: int


class UploadJobPublic(BaseModel):
    """An upload ingested in the background: poll `GET /v1/uploads/{id}` until `status` is
    `succeeded` (then `result` is what the synchronous upload would have answered) or
    `failed` (then `error` holds the code it would have answered with)."""

    id: str
    name: str
    base_model: str
    status: Literal["pending", "running", "succeeded", "failed"]
    size_bytes: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    result: UploadResult | None = None
    error: ErrorDetail | None = None
