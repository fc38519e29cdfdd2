"""The operator's Kopf registry and its one startup handler (settings and context).

Handlers are registered into a registry built here, never at import time, so tests run
isolated operators side by side and importing a module changes nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import kopf

from loraplane.operator import adapters, pools, rollouts
from loraplane.operator.context import OperatorContext
from loraplane.operator.settings import FINALIZER, OperatorSettings

LoginFn = Callable[..., kopf.ConnectionInfo | None]


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Kopf settings and the operator context, once at start."""
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = "loraplane-operator"
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="loraplane.io", key="last-handled-configuration"
    )
    # Watches are re-established regularly, so a silently dropped stream cannot go unnoticed.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    if not isinstance(memo.get("ctx"), OperatorContext):
        memo["ctx"] = OperatorContext.create(OperatorSettings.from_env(os.environ))


def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Release the context's connections."""
    ctx = memo.get("ctx")
    if isinstance(ctx, OperatorContext):
        ctx.close()


def build_registry(
    *, pool_interval: float = 15.0, login: LoginFn | None = None
) -> kopf.OperatorRegistry:
    """Every handler of the operator, in a fresh registry.

    `login` overrides how Kopf reaches the API server (default: the kubernetes client's own
    configuration: in-cluster, else kubeconfig).
    """
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.on.login(registry=registry)(login or kopf.login_via_client)
    adapters.register(registry)
    rollouts.register(registry)  # after the adapter's: a new version is recorded first
    pools.register(registry, interval=pool_interval)
    return registry
