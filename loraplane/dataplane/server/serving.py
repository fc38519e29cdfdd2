"""Run the app under uvicorn: drain on SIGTERM/SIGINT and exit 0; exit 1 when start fails."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn

from loraplane.dataplane.server.app import create_app
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings

EXIT_OK, EXIT_FAILED = 0, 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server that marks the runtime draining on a signal, and does not re-raise the
    signal after its graceful shutdown (uvicorn does, so the process would end by SIGTERM)."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime

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

    app = create_app(settings, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        access_log=False,
        log_level="info",
    )
    server = DrainingServer(config, app.state.runtime)
    holder.append(server)
    server.run()
    return EXIT_FAILED if failures else EXIT_OK
