"""A pool's base model shapes, from `<baseModel.uri>/config.json` (a local path or s3://).

Configs are small and a pool's base model never changes (the CRD makes it immutable), so
each URI is read once and cached.
"""

from __future__ import annotations

import threading

from loraplane.adapters.base_model import BaseModelError, BaseModelSpec, read_config


class BaseModelUnavailable(Exception):
    """The base model's config.json cannot be read or used (a pool problem, not the adapter's)."""


class BaseModelCache:
    """BaseModelSpec per (uri, name), read on first use (`read_config`, the control plane's
    reader too)."""

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
        try:
            spec = BaseModelSpec.from_config(
                read_config(uri, s3_endpoint_url=self._s3_endpoint_url), name
            )
        except BaseModelError as exc:
            raise BaseModelUnavailable(f"{uri}: {exc}") from exc
        with self._lock:
            self._specs[(uri, name)] = spec
        return spec
