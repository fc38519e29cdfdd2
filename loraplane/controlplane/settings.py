"""The control plane's settings: `LORAPLANE_*` environment variables, read once at start.

Every default serves the embedded mode (SQLite and a local store under `./.loraplane/`). A
deployment (a PostgreSQL database or `LORAPLANE_KUBERNETES=1`) must bring strong tokens: a
missing or weak one fails at start with a message naming the variable.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from loraplane import fileaccess
from loraplane.envhelp import PREFIX, format_env_help

MIN_TOKEN_CHARS = 32
MIN_TOKEN_DISTINCT = 10
GiB = 1 << 30


class StartupError(RuntimeError):
    """The service cannot start with these settings; the message names the variable."""


class Settings(BaseSettings):
    """Everything the control plane reads from its environment, validated at start."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore")

    data_dir: Path = Field(default=Path(".loraplane"), description="embedded-mode state")
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL; postgresql:// uses psycopg 3 (unset: SQLite in the data dir)",
    )
    store: str | None = Field(
        default=None,
        description="local directory or s3://bucket/prefix (unset: <data dir>/store)",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="admin API token (embedded mode: generated into <data dir>/admin-token)",
    )
    service_token: SecretStr | None = Field(
        default=None,
        description="token of the data plane and operator (embedded: <data dir>/service-token)",
    )
    kubernetes: bool = Field(
        default=False,
        description="cluster mode: uploads become LoRAAdapter resources the operator ingests",
    )
    max_upload_bytes: int = Field(
        default=4 * GiB + (1 << 20), gt=0, description="request body cap (413 past it)"
    )
    background_ingest_bytes: int = Field(
        default=64 << 20,
        ge=0,
        description="embedded mode: uploads at least this big are ingested in the background "
        "(202 and a job to poll); `Prefer: respond-async` asks for it at any size",
    )
    ingest_workers: int = Field(default=2, ge=1, le=64, description="background ingest threads")
    max_pending_uploads: int = Field(
        default=16, ge=1, le=10_000, description="background uploads queued at once (429 past)"
    )
    upload_job_timeout_seconds: int = Field(
        default=3600,
        ge=60,
        description="an unfinished upload job older than this reads as failed (Interrupted)",
    )
    upload_job_retention_days: int = Field(
        default=7,
        ge=1,
        le=3650,
        description="finished upload jobs are deleted this many days after they end",
    )
    import_buckets: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated S3 buckets JSON imports may read"
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3 endpoint for the store, imports and base model configs"
    )
    retry_after_seconds: int = Field(
        default=5, ge=1, le=3600, description="Retry-After of 503 answers"
    )
    db_pool_size: int = Field(
        default=10, ge=1, le=1000, description="database connections (and resolves at once)"
    )
    db_connect_timeout_seconds: int = Field(
        default=3, ge=1, le=120, description="database connect timeout"
    )
    console_dataplane_url: str | None = Field(
        default=None,
        max_length=500,
        pattern=r"^https?://[^\s\"'<>]+$",
        description="the data plane URL the tenant console's examples call (unset: the "
        "console's host, port 8000)",
    )

    @field_validator("import_buckets", mode="before")
    @classmethod
    def _split_buckets(cls, value: object) -> object:
        """`LORAPLANE_IMPORT_BUCKETS=a,b` is a comma-separated list of bucket names."""
        if isinstance(value, str):
            return [b.strip() for b in value.split(",") if b.strip()]
        return value

    @field_validator("admin_token", "service_token", mode="before")
    @classmethod
    def _trim_token(cls, value: object) -> object:
        """Whitespace around a token (an env file, a paste) is not part of it: the CLI and the
        data plane trim theirs too."""
        return value.strip() if isinstance(value, str) else value

    @field_validator("database_url")
    @classmethod
    def _psycopg_driver(cls, value: str | None) -> str | None:
        """Plain `postgresql://` URLs use psycopg 3 (the driver this package ships with)."""
        if value is None:
            return None
        for plain in ("postgresql://", "postgres://"):
            if value.startswith(plain):
                return "postgresql+psycopg://" + value.removeprefix(plain)
        return value

    @property
    def effective_database_url(self) -> str:
        """The database URL, defaulting to SQLite under the data directory."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'controlplane.db').absolute()}"

    @property
    def effective_store(self) -> str:
        """The store location, defaulting to a local directory under the data directory."""
        return self.store or str((self.data_dir / "store").absolute())

    @property
    def is_sqlite(self) -> bool:
        """Whether the catalog lives in SQLite (which the service migrates itself)."""
        return self.effective_database_url.startswith("sqlite")

    @property
    def embedded(self) -> bool:
        """Embedded mode: SQLite and no Kubernetes. Anything else is a deployment."""
        return self.is_sqlite and not self.kubernetes


def settings_help() -> str:
    """The LORAPLANE_* variables, their defaults and meanings (for `--help`)."""
    return format_env_help(
        (name, field.get_default(call_default_factory=True), field.description or "")
        for name, field in Settings.model_fields.items()
    )


def token_weakness(token: str) -> str | None:
    """Why a token is too weak to guard a deployment, or None if it is fine."""
    if len(token) < MIN_TOKEN_CHARS:
        return f"it has {len(token)} characters; use at least {MIN_TOKEN_CHARS}"
    if len(set(token)) < MIN_TOKEN_DISTINCT:
        return f"it uses fewer than {MIN_TOKEN_DISTINCT} distinct characters"
    return None


def _token_file(path: Path) -> str:
    """Read the token in `path`, or create it with a new random token (mode 0600).
    AccessDenied (an OSError) names the file or folder this process may not use."""
    action: fileaccess.Action = "read"
    try:
        if path.exists():
            return path.read_text(encoding="utf-8").strip()
        action = "write"
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise fileaccess.explain(exc, action, path) from exc
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def resolve_tokens(settings: Settings) -> Settings:
    """Check the tokens at start; in embedded mode generate missing ones into files.

    Returns settings whose admin and service tokens are set. Raises StartupError naming the
    variable when a deployment lacks a token or has a weak one.
    """
    updates: dict[str, SecretStr] = {}
    for field, var, filename in (
        ("admin_token", "LORAPLANE_ADMIN_TOKEN", "admin-token"),
        ("service_token", "LORAPLANE_SERVICE_TOKEN", "service-token"),
    ):
        secret: SecretStr | None = getattr(settings, field)
        if secret is None or not secret.get_secret_value():
            if not settings.embedded:
                raise StartupError(f"{var} is not set: a deployment needs a strong token")
            path = (settings.data_dir / filename).absolute()
            try:
                updates[field] = SecretStr(_token_file(path))
            except OSError as exc:
                raise StartupError(f"{var} is not set and its token file fails: {exc}") from exc
            print(f"loraplane: {var} not set; the token is in {path} (mode 0600)", file=sys.stderr)
            continue
        weakness = token_weakness(secret.get_secret_value())
        if weakness and not settings.embedded:
            raise StartupError(f"{var} is too weak: {weakness}")
    return settings.model_copy(update=updates)
