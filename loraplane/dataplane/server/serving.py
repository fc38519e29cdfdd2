"""Run the app under uvicorn: drain on SIGTERM/SIGINT and exit 0; exit 1 when start fails.

The metrics port (`--metrics-port`) and the gateway-metrics port (`--gateway-metrics-port`) are
uvicorn servers of their own in the same event loop, on the same runtime; they keep answering
while the API port drains, and stop after it. uvicorn's lines about its own life ("Started
server process", "Shutting down", ...) come once, from the API's server; each metrics port
says once where it serves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from loraplane.accesslog import AccessLogError, AccessLogSettings, make_logger, wrap
from loraplane.dataplane.engine_setup import LOG_FORMAT
from loraplane.dataplane.server.app import create_app
from loraplane.dataplane.server.metrics_port import (
    create_gateway_metrics_app,
    create_metrics_app,
)
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.graceful import GracefulServer
from loraplane.redact import env_secrets, install_log_redaction
from loraplane.sockets import listen

EXIT_OK, EXIT_FAILED = 0, 1
SIDE_TASK = "metrics-"  # the name of each metrics port's task starts with it
log = logging.getLogger(__name__)


class QuietSides(logging.Filter):
    """Drops what uvicorn logs from a metrics port's task: its server's life cycle, which
    would repeat the API server's lines ("Started server process [pid]" three times)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop running in this thread
            return True
        return task is None or not task.get_name().startswith(SIDE_TASK)


class MetricsServer(uvicorn.Server):
    """uvicorn's server for a metrics port (`what` it serves, for the log): it leaves signals
    to the API's server."""

    def __init__(self, config: uvicorn.Config, what: str) -> None:
        super().__init__(config)
        self.what = what

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Install no handler (the API's server owns SIGINT and SIGTERM)."""
        yield


class DrainingServer(GracefulServer):
    """uvicorn's server that marks the runtime draining on a signal, and does not re-raise the
    signal after its graceful shutdown (GracefulServer). It runs the `sides` (metrics servers,
    each with its bound socket) beside itself."""

    def __init__(
        self,
        config: uvicorn.Config,
        runtime: Runtime,
        sides: list[tuple[MetricsServer, socket.socket]] | None = None,
    ) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.sides = sides or []

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve the API (and the metrics ports until the API has drained)."""
        quiet = QuietSides()
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(quiet)
        tasks = []
        for side, sock in self.sides:
            host, port = sock.getsockname()[:2]
            log.info("%s on http://%s:%d/metrics", side.what, host, port)
            tasks.append(asyncio.create_task(side.serve([sock]), name=f"{SIDE_TASK}{port}"))
        try:
            await super().serve(sockets)
        finally:
            for side, _ in self.sides:
                side.should_exit = True
            for task in tasks:
                await task
            uvicorn_log.removeFilter(quiet)

    def on_stop(self, sig: int, frame: FrameType | None) -> None:
        """Mark the runtime draining (/ready 503), then shut down as GracefulServer does."""
        self.runtime.draining = True
        super().on_stop(sig, frame)


def serve(settings: ServerSettings, access_log: AccessLogSettings | None = None) -> int:
    """Serve until told to stop; the process exit code. `access_log`: the request log's
    settings (default: from the environment, on, to stderr)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    failures: list[str] = []
    holder: list[DrainingServer] = []

    def on_fatal(message: str) -> None:
        failures.append(message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        for server in holder:
            server.should_exit = True

    if settings.api_metrics_adapters:
        log.warning(
            "--api-metrics-adapters / LORAPLANE_API_METRICS_ADAPTERS is deprecated and has no"
            " effect: the endpoint picker reads adapter names on the gateway-metrics port"
            " (--gateway-metrics-port %d); the API port's /metrics never names adapters",
            settings.gateway_metrics_port,
        )
    listeners = (  # (port, the flag and variable that set it, the app factory, what it serves)
        (settings.metrics_port, "--metrics-port / LORAPLANE_METRICS_PORT", create_metrics_app,
         "metrics (every series)"),
        (settings.gateway_metrics_port, "--gateway-metrics-port / LORAPLANE_GATEWAY_METRICS_PORT",
         create_gateway_metrics_app, "gateway metrics (the endpoint picker's)"),
    )  # fmt: skip
    bound: list[tuple[socket.socket, Callable[[Runtime], FastAPI], str]] = []
    for port, where, factory, what in listeners:
        if not port:
            continue
        try:
            bound.append((listen(settings.host, port), factory, what))
        except OSError as e:
            for sock, _, _ in bound:
                sock.close()
            print(f"error: cannot serve metrics on {settings.host}:{port}"
                  f" ({where}; 0 turns it off): {e}", file=sys.stderr, flush=True)  # fmt: skip
            return EXIT_FAILED
    secrets = [settings.api_key, settings.admin_token, settings.service_token, *env_secrets()]
    try:
        requests_log = make_logger(access_log or AccessLogSettings(), "dataplane", secrets)
    except (AccessLogError, ValueError) as e:
        for sock, _, _ in bound:
            sock.close()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    app = create_app(settings, on_fatal=on_fatal, freeze_heap=True)
    sides = [(_side_server(factory(app.state.runtime), settings.host, sock, what), sock)
             for sock, factory, what in bound]  # fmt: skip
    config = uvicorn.Config(
        wrap(app, "dataplane", requests_log),  # one JSON line per request (accesslog.py)
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        access_log=False,
        log_level="info",
    )
    # after Config (it sets the handlers up): no key or token in a log line
    install_log_redaction(secrets)
    server = DrainingServer(config, app.state.runtime, sides)
    holder.append(server)
    server.run()
    return EXIT_FAILED if failures else EXIT_OK


def _side_server(app: FastAPI, host: str, sock: socket.socket, what: str) -> MetricsServer:
    """A metrics port's server for `app` on the bound `sock`, serving `what`."""
    # log_config None: this Config leaves the logging the API's Config set up alone
    config = uvicorn.Config(
        app, host=host, port=sock.getsockname()[1], lifespan="off", access_log=False,
        log_config=None, log_level=None,
    )  # fmt: skip
    return MetricsServer(config, what)
