"""The operator's settings: `LORAPLANE_*` environment variables, read once at start.

The operator's image carries no pydantic-settings (its extra is kopf, kubernetes and httpx),
so this is one frozen dataclass checked in `__post_init__`; a bad value fails at start with a
`SettingsError` naming the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from loraplane.envhelp import format_env_help

GiB = 1 << 30
FINALIZER = "loraplane.io/finalizer"


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the environment variable."""


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """Everything the operator reads from its environment (env var = LORAPLANE_ + NAME)."""

    controlplane_url: str = field(metadata={"help": "the control plane's URL (required)"})
    service_token: str = field(metadata={"help": "the control plane's service token (required)"})
    store: str = field(
        default=".loraplane/store",
        metadata={"help": "where versions are stored: a directory or s3://bucket/prefix"},
    )
    s3_endpoint_url: str | None = field(
        default=None, metadata={"help": "S3 endpoint for the store and s3:// sources"}
    )
    source_hosts: tuple[str, ...] = field(
        default=(),
        metadata={"help": "comma-separated hosts https:// sources (and Secrets' S3 endpoints) "
                  "may name"},
    )  # fmt: skip
    import_buckets: tuple[str, ...] = field(
        default=(),
        metadata={"help": "comma-separated S3 buckets read with the operator's own credentials "
                  "(sources without a secretRef)"},
    )  # fmt: skip
    max_source_bytes: int = field(
        default=4 * GiB + (1 << 20), metadata={"help": "cap on one adapter source's bytes"}
    )
    dataplane_controlplane_url: str | None = field(
        default=None,
        metadata={"help": "the control plane URL pool replicas get (unset: the one above)"},
    )
    pool_interval_seconds: float = field(
        default=15.0, metadata={"help": "seconds between a pool's status and autoscaling passes"}
    )
    pool_wait_seconds: float = field(
        default=30.0,
        metadata={"help": "retry delay while no ServingPool serves an adapter's base model"},
    )
    retry_base_seconds: float = field(
        default=5.0, metadata={"help": "first retry delay after a transient failure"}
    )
    retry_max_seconds: float = field(
        default=300.0, metadata={"help": "longest retry delay (exponential backoff)"}
    )
    pressure_stale_seconds: float = field(
        default=60.0, metadata={"help": "replica pressure reports older than this are ignored"}
    )
    request_timeout_seconds: float = field(
        default=10.0, metadata={"help": "timeout of calls to the control plane"}
    )
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


def settings_help() -> str:
    """The LORAPLANE_* variables the operator reads, their defaults and meanings."""
    return format_env_help(
        (f.name, "required" if f.default is MISSING else f.default, f.metadata.get("help", ""))
        for f in fields(OperatorSettings)
        if f.name != "finalizer"
    )


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
