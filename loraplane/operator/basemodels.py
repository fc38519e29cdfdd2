"""A pool's base model shapes, from `<baseModel.uri>/config.json` (a local path or s3://).

Configs are small and a pool's base model never changes (the CRD makes it immutable), so
each URI is read once and cached.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from loraplane.adapters.base_model import BaseModelError, BaseModelSpec

MAX_CONFIG_BYTES = 1 << 20


class BaseModelUnavailable(Exception):
    """The base model's config.json cannot be read or used (a pool problem, not the adapter's)."""


def read_config(uri: str, *, s3_endpoint_url: str | None = None) -> bytes:
    """The bytes of `<uri>/config.json`, at most MAX_CONFIG_BYTES."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        key = f"{prefix.strip('/')}/config.json" if prefix.strip("/") else "config.json"
        client = boto3.client(
            "s3", endpoint_url=s3_endpoint_url, config=Config(connect_timeout=3, read_timeout=10)
        )
        try:
            data: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read(
                MAX_CONFIG_BYTES + 1
            )
        except (ClientError, BotoCoreError) as exc:
            raise BaseModelUnavailable(f"cannot read s3://{bucket}/{key}: {exc}") from exc
    else:
        path = Path(uri) / "config.json"
        try:
            with path.open("rb") as fh:
                data = fh.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise BaseModelUnavailable(f"cannot read {path}: {exc}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise BaseModelUnavailable(f"{uri}/config.json is larger than {MAX_CONFIG_BYTES} bytes")
    return data


class BaseModelCache:
    """BaseModelSpec per (uri, name), read on first use."""

    def __init__(self, s3_endpoint_url: str | None = None) -> None:
        self._s3_endpoint_url = s3_endpoint_url
        self._specs: dict[tuple[str, str], BaseModelSpec] = {}
        self._lock = threading.Lock()

    def get(self, uri: str, name: str) -> BaseModelSpec:
        """The shapes of the base model at `uri`, served as `name`."""
        with self._lock:
            cached = self._specs.get((uri, name))
        if cached is not None:
            return cached
        raw = read_config(uri, s3_endpoint_url=self._s3_endpoint_url)
        try:
            config = json.loads(raw)
            if not isinstance(config, dict):
                raise BaseModelError("config.json is not a JSON object")
            spec = BaseModelSpec.from_config(config, name)
        except (ValueError, BaseModelError) as exc:
            raise BaseModelUnavailable(f"{uri}/config.json: {exc}") from exc
        with self._lock:
            self._specs[(uri, name)] = spec
        return spec
