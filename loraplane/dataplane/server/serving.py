"""Run the app under uvicorn: drain on SIGTERM/SIGINT and exit 0; exit 1 when start fails.

The metrics port (`--metrics-port`) is a second uvicorn server in the same event loop, on the
same runtime; it keeps answering while the API port drains, and stops after it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn

from loraplane.dataplane.server.app import create_app
from loraplane.dataplane.server.metrics_port import create_metrics_app
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.sockets import listen

EXIT_OK, EXIT_FAILED = 0, 1


class MetricsServer(uvicorn.Server):
    """uvicorn's server for the metrics port: it leaves signals to the API's server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Install no handler (the API's server owns SIGINT and SIGTERM)."""
        yield


class DrainingServer(uvicorn.Server):
    """uvicorn's server that marks the runtime draining on a signal, and does not re-raise the
    signal after its graceful shutdown (uvicorn does, so the process would end by SIGTERM).
    With `metrics` (a server and its bound socket) it runs that one beside itself."""

    def __init__(
        self,
        config: uvicorn.Config,
        runtime: Runtime,
        metrics: tuple[MetricsServer, socket.socket] | None = None,
    ) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.metrics = metrics

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve the API (and the metrics port until the API has drained)."""
        if self.metrics is None:
            await super().serve(sockets)
            return
        metrics, sock = self.metrics
        side = asyncio.create_task(metrics.serve([sock]), name="metrics-port")
        try:
            await super().serve(sockets)
        finally:
            metrics.should_exit = True
            await side

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Handle SIGINT and SIGTERM while serving (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {sig: signal.signal(sig, self._drain) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def _drain(self, sig: int, frame: FrameType | None) -> None:
        self.runtime.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop now
        else:
            self.should_exit = True


def serve(settings: ServerSettings) -> int:
    """Serve until told to stop; the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    failures: list[str] = []
    holder: list[DrainingServer] = []

    def on_fatal(message: str) -> None:
        failures.append(message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        for server in holder:
            server.should_exit = True

    metrics: tuple[MetricsServer, socket.socket] | None = None
    sock: socket.socket | None = None
    if settings.metrics_port:
        try:
            sock = listen(settings.host, settings.metrics_port)
        except OSError as e:
            print(f"error: cannot serve metrics on {settings.host}:{settings.metrics_port}"
                  f" (--metrics-port / LORAPLANE_METRICS_PORT; 0 turns it off): {e}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return EXIT_FAILED
    app = create_app(settings, on_fatal=on_fatal, freeze_heap=True)
    if sock is not None:
        # log_config None: this Config leaves the logging the API's Config set up alone
        metrics_config = uvicorn.Config(
            create_metrics_app(app.state.runtime), host=settings.host,
            port=settings.metrics_port, lifespan="off", access_log=False, log_config=None,
            log_level=None,
        )  # fmt: skip
        metrics = (MetricsServer(metrics_config), sock)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        access_log=False,
        log_level="info",
    )
    server = DrainingServer(config, app.state.runtime, metrics)
    holder.append(server)
    server.run()
    return EXIT_FAILED if failures else EXIT_OK
