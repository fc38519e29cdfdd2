"""A pool's base model: its config.json, read once when the pool is registered.

The config (a local path, a folder holding config.json, or an `s3://` object or prefix) gives
the module shapes that uploads are validated against (`BaseModelSpec.from_config`). It is
read by `loraplane.adapters.base_model.read_config`, the operator's reader too.
"""

from __future__ import annotations

from typing import Any

from loraplane.adapters.base_model import BaseModelError, BaseModelSpec, read_config
from loraplane.controlplane.errors import InvalidBaseModel


def load_config(uri: str, name: str, *, s3_endpoint_url: str | None) -> dict[str, Any]:
    """Read and check a base model's config.json; InvalidBaseModel if it cannot serve."""
    try:
        config = read_config(uri, s3_endpoint_url=s3_endpoint_url)
    except BaseModelError as exc:
        raise InvalidBaseModel(str(exc)) from exc
    spec_of(config, name)  # refuse what uploads could never be checked against
    return config


def spec_of(config: dict[str, Any], name: str) -> BaseModelSpec:
    """The shapes of a stored config; InvalidBaseModel if they cannot be read."""
    try:
        return BaseModelSpec.from_config(config, name)
    except BaseModelError as exc:
        raise InvalidBaseModel(f"base model {name!r}: {exc}") from exc
