"""A pool's base model: its config.json, read once when the pool is registered.

The config (a local path, a folder holding config.json, or an `s3://` object or prefix) gives
the module shapes that uploads are validated against (`BaseModelSpec.from_config`).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from loraplane.adapters.base_model import BaseModelError, BaseModelSpec
from loraplane.controlplane import s3
from loraplane.controlplane.errors import InvalidBaseModel

MAX_CONFIG_BYTES = 1 << 20
CONFIG_NAME = "config.json"


def _read_local(uri: str) -> bytes:
    path = Path(uri)
    try:
        if path.is_dir():
            path = path / CONFIG_NAME
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise InvalidBaseModel(f"{path} is not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise InvalidBaseModel(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
        with path.open("rb") as fh:
            return fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise InvalidBaseModel(f"cannot read the base model config at {path}: {exc}") from exc


def _read_s3(uri: str, endpoint_url: str | None) -> bytes:
    try:
        bucket, key = s3.split_uri(uri)
    except ValueError as exc:
        raise InvalidBaseModel(str(exc)) from exc
    if not key or key.endswith("/"):
        key = key + CONFIG_NAME
    elif not key.endswith(".json"):
        key = key + "/" + CONFIG_NAME
    client = s3.make_client(endpoint_url)
    try:
        return s3.read_bytes(client, bucket, key, max_bytes=MAX_CONFIG_BYTES)
    except s3.S3ReadError as exc:
        raise InvalidBaseModel(f"cannot read the base model config: {exc}") from exc


def load_config(uri: str, name: str, *, s3_endpoint_url: str | None) -> dict[str, Any]:
    """Read and check a base model's config.json; InvalidBaseModel if it cannot serve."""
    raw = _read_s3(uri, s3_endpoint_url) if uri.startswith("s3://") else _read_local(uri)
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidBaseModel(f"the base model config at {uri} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidBaseModel(f"the base model config at {uri} is not a JSON object")
    spec_of(config, name)  # refuse what uploads could never be checked against
    return config


def spec_of(config: dict[str, Any], name: str) -> BaseModelSpec:
    """The shapes of a stored config; InvalidBaseModel if they cannot be read."""
    try:
        return BaseModelSpec.from_config(config, name)
    except BaseModelError as exc:
        raise InvalidBaseModel(f"base model {name!r}: {exc}") from exc
