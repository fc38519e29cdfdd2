"""The data plane's FastAPI app: routes, OpenAI-shaped errors, and the runtime's life cycle.

    app = create_app(ServerSettings.load(model="path/to/model"))

The app starts serving at once (`/health` answers 200) and loads the model in the background;
`/ready` turns 200 when it is loaded. A failure to load (a bad model, a rejected static adapter)
is logged and handed to `on_fatal`, which the CLI uses to exit with a non-zero code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from loraplane.dataplane.server import admin_routes, openai_routes, responses, tokenize_routes
from loraplane.dataplane.server.admission import BodyLimit
from loraplane.dataplane.server.errors import install_error_handlers
from loraplane.dataplane.server.request_metrics import RequestCounter
from loraplane.dataplane.server.runtime import Runtime, StartupError
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.docs_ui import install_docs

log = logging.getLogger(__name__)


def create_app(
    settings: ServerSettings,
    on_fatal: Callable[[str], None] | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """Build the app; the engine loads when the app starts (its lifespan). `freeze_heap`
    (for a process that serves this app alone, as `loraplane serve` does): once started,
    move every object then alive out of the garbage collector's reach (`Runtime.start`)."""
    runtime = Runtime(settings, freeze_heap=freeze_heap)

    async def start() -> None:
        try:
            await runtime.start()
        except StartupError as e:
            runtime.fatal = str(e)
            log.error("%s", e)
            if on_fatal is not None:
                on_fatal(str(e))
        except Exception as e:
            runtime.fatal = f"start failed: {type(e).__name__}: {e}"
            log.exception("start failed")
            if on_fatal is not None:
                on_fatal(runtime.fatal)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(start(), name="load-engine")
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await runtime.stop()

    app = FastAPI(
        title="loraplane data plane",
        summary="OpenAI-compatible serving of many tenants' LoRA adapters on one base model",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    install_docs(app)  # Swagger UI's assets from this process, no CDN
    app.state.runtime = runtime
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(responses.router)
    app.include_router(tokenize_routes.router)
    app.include_router(admin_routes.router)
    app.add_middleware(
        RequestCounter,
        counter=runtime.metrics.requests,
        versions=runtime.metrics.version_requests,
        version_errors=runtime.metrics.version_errors,
    )
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_request_bytes, refused=runtime.metrics.refused
    )
    return app
