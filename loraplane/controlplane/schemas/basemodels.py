"""What a tenant sees of the base models it may upload adapters for."""

from __future__ import annotations

from pydantic import BaseModel, Field


class BaseModelOffer(BaseModel):
    """A base model some pool serves: the `base_model` to name in an upload, and its limits."""

    name: str = Field(description="the served name: an upload's `base_model`")
    ready: bool = Field(
        description="false while every pool serving it waits for its replicas to report its "
        "config.json (uploads answer 409 BaseModelPending until then)"
    )
    model_type: str | None = Field(description="the config's model_type; null while not ready")
    num_layers: int | None = Field(description="hidden layers; null while not ready")
    hidden_size: int | None = Field(description="null while not ready")
    max_lora_rank: int | None = Field(
        description="the highest LoRA rank an upload may have: every pool's limit and this "
        "tenant's quota, whichever is lower; null while not ready"
    )
    max_adapter_bytes: int | None = Field(
        description="the largest adapter (tensor bytes) this tenant may upload; null while "
        "not ready"
    )
