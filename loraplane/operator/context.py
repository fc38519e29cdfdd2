"""What every handler needs, built once at start: settings, store, catalog, Kubernetes API.

Kopf hands it to handlers through the operator's `memo` (`memo.ctx`). Tests build one with
their own store, transports and API server and pass it in; the startup handler builds one
from the environment when none was given.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf
from kubernetes import client

from loraplane.adapters.store import ObjectStore, open_store
from loraplane.operator.basemodels import BaseModelCache
from loraplane.operator.catalog import CatalogClient
from loraplane.operator.kube import KubeApi, load_configuration
from loraplane.operator.metrics import PoolMetrics
from loraplane.operator.settings import OperatorSettings
from loraplane.operator.sources import SourcePolicy


@dataclass
class OperatorContext:
    """The operator's long-lived collaborators."""

    settings: OperatorSettings
    store: ObjectStore
    catalog: CatalogClient
    kube: KubeApi
    base_models: BaseModelCache
    metrics: PoolMetrics = field(default_factory=PoolMetrics)
    # fetch-and-ingest runs here, not on the event loop's default executor: a slow download
    # must not hold the threads the pools' timers use for their short API calls
    ingest_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="ingest")
    )
    # for https:// sources; None means the network (tests pass a mock transport)
    http_transport: httpx.BaseTransport | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source_policy(self) -> SourcePolicy:
        """What sources may be read, from the settings."""
        s = self.settings
        return SourcePolicy(
            max_bytes=s.max_source_bytes,
            s3_endpoint_url=s.s3_endpoint_url,
            source_hosts=s.source_hosts,
            import_buckets=s.import_buckets,
        )

    @classmethod
    def create(
        cls,
        settings: OperatorSettings,
        *,
        kube_configuration: client.Configuration | None = None,
        store: ObjectStore | None = None,
        catalog_transport: httpx.BaseTransport | None = None,
        http_transport: httpx.BaseTransport | None = None,
    ) -> OperatorContext:
        """Build the collaborators from settings (and overrides, for tests)."""
        return cls(
            settings=settings,
            store=store if store is not None else open_store(settings.store),
            catalog=CatalogClient(
                settings.controlplane_url,
                settings.service_token,
                timeout=settings.request_timeout_seconds,
                transport=catalog_transport,
            ),
            kube=KubeApi(kube_configuration or load_configuration()),
            base_models=BaseModelCache(settings.s3_endpoint_url),
            http_transport=http_transport,
        )

    def close(self) -> None:
        """Release connections."""
        self.catalog.close()
        self.kube.close()


def context_of(memo: kopf.Memo) -> OperatorContext:
    """The context the startup handler put in the operator's memo."""
    ctx = memo.get("ctx")
    if not isinstance(ctx, OperatorContext):
        raise kopf.PermanentError("the operator context is missing (did startup run?)")
    return ctx


def backoff(settings: OperatorSettings, retry: int) -> float:
    """Seconds before retry number `retry` (exponential, capped)."""
    return float(min(settings.retry_max_seconds, settings.retry_base_seconds * 2 ** min(retry, 20)))


def namespace_of(namespace: str | None) -> str:
    """Both resources are namespaced; Kopf types the namespace as optional."""
    if not namespace:
        raise kopf.PermanentError("a namespaced resource came without a namespace")
    return namespace
