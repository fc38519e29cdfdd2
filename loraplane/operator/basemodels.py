"""A pool's base model shapes: from `<baseModel.uri>/config.json` (a local path or s3://), or,
for a model only the pool's pods see (`baseModel.volumeClaim`), from the config.json their
pressure reports gave the catalog.

Configs are small and a pool's base model never changes (the CRD makes it immutable), so
each URI is read once and cached.
"""

from __future__ import annotations

import threading
from typing import Any

from loraplane.adapters.base_model import (
    BaseModelError,
    BaseModelSpec,
    checkpoint_quantization,
    checkpoint_w4_group,
    fp8_block,
    read_config,
)


class BaseModelUnavailable(Exception):
    """The base model's config.json cannot be read or used (a pool problem, not the adapter's)."""


class BaseModelPending(Exception):
    """No replica of the pools serving the base model has reported its config.json yet."""


class BaseModelCache:
    """BaseModelSpec per (uri, name), read on first use (`read_config`, the control plane's
    reader too)."""

    def __init__(self, s3_endpoint_url: str | None = None) -> None:
        self._s3_endpoint_url = s3_endpoint_url
        self._specs: dict[tuple[str, str], BaseModelSpec] = {}
        # uri -> form, 4-bit group, block-wise FP8's scale block
        self._forms: dict[str, tuple[str | None, int, tuple[int, int] | None]] = {}
        self._lock = threading.Lock()

    def get(self, uri: str, name: str) -> BaseModelSpec:
        """The shapes of the base model at `uri`, served as `name`."""
        with self._lock:
            cached = self._specs.get((uri, name))
        if cached is not None:
            return cached
        try:
            config = read_config(uri, s3_endpoint_url=self._s3_endpoint_url)
        except BaseModelError as exc:
            raise BaseModelUnavailable(f"{uri}: {exc}") from exc
        spec = spec_of(config, name, uri)
        with self._lock:
            self._specs[(uri, name)] = spec
            self._forms[uri] = (checkpoint_quantization(config), checkpoint_w4_group(config),
                                fp8_block(config.get("quantization_config")))  # fmt: skip
        return spec

    def stored_form(self, uri: str, name: str) -> tuple[str | None, int, tuple[int, int] | None]:
        """The form the checkpoint at `uri` stores its projections in ("int4", "fp8",
        "unsupported", None: 16-bit), a 4-bit one's group size and a block-wise FP8 one's
        scale block; BaseModelUnavailable as `get`."""
        self.get(uri, name)
        with self._lock:
            return self._forms.get(uri, (None, 0, None))


def spec_of(config: dict[str, Any], name: str, source: str) -> BaseModelSpec:
    """The shapes in a config.json from `source`; BaseModelUnavailable if unusable."""
    try:
        return BaseModelSpec.from_config(config, name)
    except BaseModelError as exc:
        raise BaseModelUnavailable(f"{source}: {exc}") from exc
