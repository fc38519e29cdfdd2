"""The operator's settings: `LORAPLANE_*` environment variables, read once at start.

The operator's image carries no pydantic-settings (its extra is kopf, kubernetes and httpx),
so this is one frozen dataclass checked in `__post_init__`; a bad value fails at start with a
`SettingsError` naming the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

GiB = 1 << 30
FINALIZER = "loraplane.io/finalizer"


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the environment variable."""


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """Everything the operator reads from its environment (env var = LORAPLANE_ + NAME)."""

    controlplane_url: str
    service_token: str
    store: str = ".loraplane/store"
    s3_endpoint_url: str | None = None
    # https:// sources and extra S3 endpoints may only name these hosts
    source_hosts: tuple[str, ...] = ()
    # S3 buckets readable with the operator's own credentials (sources without a secretRef)
    import_buckets: tuple[str, ...] = ()
    max_source_bytes: int = 4 * GiB + (1 << 20)
    # the control plane URL the data plane replicas use (default: controlplane_url)
    dataplane_controlplane_url: str | None = None
    pool_interval_seconds: float = 15.0
    pool_wait_seconds: float = 30.0
    retry_base_seconds: float = 5.0
    retry_max_seconds: float = 300.0
    pressure_stale_seconds: float = 60.0
    request_timeout_seconds: float = 10.0
    finalizer: str = field(default=FINALIZER)

    def __post_init__(self) -> None:
        for name in ("controlplane_url", "dataplane_controlplane_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise SettingsError(f"LORAPLANE_{name.upper()} must be an http(s) URL: {url!r}")
        if not self.service_token:
            raise SettingsError("LORAPLANE_SERVICE_TOKEN is not set")
        if not self.store:
            raise SettingsError("LORAPLANE_STORE is empty")
        for name in (
            "max_source_bytes",
            "pool_interval_seconds",
            "pool_wait_seconds",
            "retry_base_seconds",
            "retry_max_seconds",
            "pressure_stale_seconds",
            "request_timeout_seconds",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"LORAPLANE_{name.upper()} must be positive")

    @property
    def replicas_controlplane_url(self) -> str:
        """The control plane URL passed to the data plane's --controlplane-url."""
        return self.dataplane_controlplane_url or self.controlplane_url

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> OperatorSettings:
        """Read `LORAPLANE_<FIELD>` variables; `overrides` (flags) win."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f"LORAPLANE_{f.name.upper()}"
            if var not in env or f.name == "finalizer":
                continue
            raw = env[var].strip()
            try:
                values[f.name] = _convert(f.name, raw)
            except ValueError as exc:
                raise SettingsError(f"{var}: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        for required in ("controlplane_url", "service_token"):
            if not values.get(required):
                raise SettingsError(f"LORAPLANE_{required.upper()} is not set")
        return cls(**values)


_TUPLES = {"source_hosts", "import_buckets"}
_INTS = {"max_source_bytes"}
_OPTIONAL = {"s3_endpoint_url", "dataplane_controlplane_url"}


def _convert(name: str, raw: str) -> Any:
    if name in _TUPLES:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    if name in _INTS:
        return int(raw)
    if name.endswith("_seconds"):
        return float(raw)
    if name in _OPTIONAL:
        return raw or None
    return raw
