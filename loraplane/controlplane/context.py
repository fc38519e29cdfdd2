"""What the running service holds: settings, database, store, rate limiter, metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from loraplane.adapters.store.base import ObjectStore
from loraplane.controlplane.metrics import Metrics
from loraplane.controlplane.ratelimit import RateLimiter
from loraplane.controlplane.settings import Settings

if TYPE_CHECKING:  # the Kubernetes client is needed only in cluster mode
    from loraplane.controlplane.cluster import AdapterResources
    from loraplane.controlplane.jobs import UploadJobs


@dataclass(slots=True)
class AppContext:
    """The service's state, built once at start (`main.create_app`) and kept on the app."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    # The resolve path's own engine: autocommit (no BEGIN/ROLLBACK round trips), no pre-ping,
    # a fixed pool; `resolve_slots` admits as many resolutions at once as it has connections.
    resolve_engine: Engine
    resolve_slots: asyncio.Semaphore
    store: ObjectStore
    limiter: RateLimiter
    metrics: Metrics
    # Cluster mode (LORAPLANE_KUBERNETES=1): the tenants' LoRAAdapter resources; else None.
    cluster: AdapterResources | None = None
    # Embedded mode's background ingest (None in cluster mode, where the operator ingests).
    uploads: UploadJobs | None = None

    def close(self) -> None:
        """Finish background ingests, then close every database connection the service holds."""
        if self.uploads is not None:
            self.uploads.close()
        self.engine.dispose()
        self.resolve_engine.dispose()

    @property
    def admin_token(self) -> str:
        """The admin token (always set after start)."""
        token = self.settings.admin_token
        return token.get_secret_value() if token is not None else ""

    @property
    def service_token(self) -> str:
        """The service token (always set after start)."""
        token = self.settings.service_token
        return token.get_secret_value() if token is not None else ""
