"""`create_app`: the control plane's FastAPI application, built from settings read once.

Start-up fails fast (StartupError, naming the variable) on a weak or missing token in a
deployment, an unreachable database, or an outdated schema outside embedded mode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool

from loraplane import fileaccess
from loraplane.adapters.store import open_store
from loraplane.adapters.store.local import LocalStore
from loraplane.controlplane import db
from loraplane.controlplane.api.routes import (
    adapters,
    basemodels,
    health,
    internal,
    pins,
    pools,
    signing_keys,
    tenants,
    uploads,
    usage,
)
from loraplane.controlplane.console.app import PATH as CONSOLE_PATH
from loraplane.controlplane.console.app import create_console_app, to_index
from loraplane.controlplane.context import AppContext
from loraplane.controlplane.crud import jobs as crud_jobs
from loraplane.controlplane.errors import install_error_handlers
from loraplane.controlplane.jobs import UploadJobs
from loraplane.controlplane.listeners import PublicPortGuard
from loraplane.controlplane.metrics import Metrics, MetricsMiddleware
from loraplane.controlplane.ratelimit import RateLimiter
from loraplane.controlplane.settings import Settings, StartupError, resolve_tokens
from loraplane.docs_ui import install_docs

if TYPE_CHECKING:
    from kubernetes.client import Configuration

    from loraplane.controlplane.cluster import AdapterResources

log = logging.getLogger(__name__)


def open_cluster(
    settings: Settings, configuration: Configuration | None
) -> AdapterResources | None:
    """Cluster mode's Kubernetes API: `configuration` (tests), else in-cluster or KUBECONFIG."""
    if not settings.kubernetes:
        return None
    try:
        from loraplane.controlplane import cluster
    except ImportError as exc:
        raise StartupError(
            f"LORAPLANE_KUBERNETES=1 needs the kubernetes client (kubernetes==37.0.0): {exc}"
        ) from exc
    if configuration is None:
        try:
            configuration = cluster.load_configuration()
        except Exception as exc:
            raise StartupError(
                "LORAPLANE_KUBERNETES=1: no Kubernetes credentials (neither in-cluster nor "
                f"KUBECONFIG): {fileaccess.message(exc)}"
            ) from exc
    return cluster.AdapterResources(configuration, retry_after=settings.retry_after_seconds)


def build_context(
    settings: Settings, *, kube_configuration: Configuration | None = None
) -> AppContext:
    """Check the settings, reach the database (migrating SQLite), open the store, and in
    cluster mode the Kubernetes API (`kube_configuration` overrides the environment's)."""
    settings = resolve_tokens(settings)
    try:
        store = open_store(settings.effective_store)
    except ValueError as exc:
        raise StartupError(f"LORAPLANE_STORE: {exc}") from exc
    if settings.embedded and isinstance(store, LocalStore):  # uploads are ingested here
        try:
            fileaccess.check_writable_dir(store.url())
        except OSError as exc:
            raise StartupError(f"LORAPLANE_STORE: {exc}") from exc
    try:
        engine = db.make_engine(
            settings.effective_database_url,
            pool_size=settings.db_pool_size,
            connect_timeout=settings.db_connect_timeout_seconds,
        )
    except Exception as exc:
        raise StartupError(f"LORAPLANE_DATABASE_URL: {exc}") from exc
    db.prepare_schema(engine, migrate=settings.is_sqlite)
    resources = open_cluster(settings, kube_configuration)
    sessions = db.make_session_factory(engine)
    uploads = None
    if resources is None:
        if settings.is_sqlite:  # one process owns a SQLite catalog: unfinished jobs were ours
            with db.session_scope(sessions) as session:
                if failed := crud_jobs.fail_unfinished(session):
                    log.warning("%d background uploads were interrupted by a restart", failed)
        uploads = UploadJobs(sessions, store, settings)
    return AppContext(
        settings=settings,
        engine=engine,
        sessions=sessions,
        resolve_engine=db.make_engine(
            settings.effective_database_url,
            pool_size=settings.db_pool_size,
            connect_timeout=settings.db_connect_timeout_seconds,
            pre_ping=False,
            max_overflow=0,
        ).execution_options(isolation_level="AUTOCOMMIT"),
        resolve_slots=asyncio.Semaphore(settings.db_pool_size),
        store=store,
        limiter=RateLimiter(),
        metrics=Metrics(),
        cluster=resources,
        uploads=uploads,
    )


def create_app(
    settings: Settings | None = None,
    *,
    context: AppContext | None = None,
    kube_configuration: Configuration | None = None,
    internal_port: int | None = None,
) -> FastAPI:
    """The control plane app; `settings` default to the environment (read here, once).
    With `internal_port`, the internal routes and /metrics answer only on that port
    (`listeners.PublicPortGuard`)."""
    ctx = context or build_context(
        settings if settings is not None else Settings(), kube_configuration=kube_configuration
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Shutting down: running background ingests finish, queued ones are failed as
        # Interrupted, connections close.
        await run_in_threadpool(ctx.close)

    app = FastAPI(
        lifespan=lifespan,
        title="loraplane control plane",
        version="1",
        summary="Tenants, API keys, pools and LoRA adapter versions",
        docs_url=None,
        redoc_url=None,
    )
    install_docs(app)  # Swagger UI's assets from this process, no CDN
    app.state.ctx = ctx
    install_error_handlers(app, retry_after=ctx.settings.retry_after_seconds)
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    if internal_port is not None:
        app.add_middleware(PublicPortGuard, internal_port=internal_port)
    for module in (
        health,
        tenants,
        signing_keys,
        pools,
        basemodels,
        adapters,
        pins,
        uploads,
        usage,
        internal,
    ):
        app.include_router(module.router)
    # the tenant console: static pages that call the routes above with the signed-in key
    app.add_route(CONSOLE_PATH, to_index, include_in_schema=False)
    app.mount(CONSOLE_PATH, create_console_app(dataplane_url=ctx.settings.console_dataplane_url))
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    log.info(
        "control plane ready: database %s, store %s, %s",
        ctx.engine.url.render_as_string(hide_password=True),
        ctx.store.url(),
        "cluster mode (uploads become LoRAAdapters)" if ctx.cluster else "in-process ingest",
    )
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with request validation errors shown as the 400 they are."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.get("responses", {})
            default = responses.get("422", {})
            ref = str(default.get("content", {}).get("application/json", {}).get("schema", {}))
            if "HTTPValidationError" in ref:
                del responses["422"]
    schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
    schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
    app.openapi_schema = schema
    return schema
