"""What the running service holds: settings, database, store, rate limiter, metrics."""

from __future__ import annotations

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


@dataclass(slots=True)
class AppContext:
    """The service's state, built once at start (`main.create_app`) and kept on the app."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    # Autocommit sessions for the read-mostly hot path: no BEGIN/ROLLBACK round trips.
    autocommit_sessions: sessionmaker[Session]
    store: ObjectStore
    limiter: RateLimiter
    metrics: Metrics
    # Cluster mode (LORAPLANE_KUBERNETES=1): the tenants' LoRAAdapter resources; else None.
    cluster: AdapterResources | None = None

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
