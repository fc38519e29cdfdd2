"""uvicorn servers that end quietly on SIGINT and SIGTERM.

uvicorn re-raises the signal it caught once its graceful shutdown is done: Ctrl-C ended
`loraplane controlplane` in a KeyboardInterrupt traceback, and SIGTERM in death by that signal
(exit status 143 where a pod's last state is shown). `GracefulServer` shuts down the same way
and then returns, so the command exits with its own status; a second Ctrl-C stops at once
(uvicorn's forced exit)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopped by SIGINT or SIGTERM without re-raising it (`on_stop` is
    called for each, on the main thread; subclasses add to it)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Handle SIGINT and SIGTERM while serving (main thread only: signals go there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        stop = {sig: signal.signal(sig, self.on_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in stop.items():
                signal.signal(sig, handler)

    def on_stop(self, sig: int, frame: FrameType | None) -> None:
        """Begin the graceful shutdown; a second Ctrl-C forces the exit."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
