"""Real collaborators for the operator's tests, each in its own thread: the control plane
(uvicorn on a free port, SQLite) and the operator itself (Kopf, with its own event loop)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import kopf
import uvicorn
from fastapi import FastAPI

from loraplane.operator.context import OperatorContext
from loraplane.operator.registry import build_registry
from tests.servers import free_port


class UvicornThread:
    """An ASGI app served by uvicorn on 127.0.0.1 from a thread."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="controlplane", daemon=True)

    def start(self) -> None:
        """Serve; returns once uvicorn listens."""
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the control plane did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for it."""
        self.server.should_exit = True
        self._thread.join(15)


class OperatorThread:
    """The Kopf operator with a fresh registry, run in its own thread and event loop.

    `stop()` is a kill as far as handlers are concerned: Kopf cancels what is running and the
    next operator starts from what the API server holds.
    """

    def __init__(self, ctx: OperatorContext, api_url: str, *, pool_interval: float = 0.5) -> None:
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=api_url, insecure=True)

        self.ctx = ctx
        self.registry = build_registry(pool_interval=pool_interval, login=login)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.finished = threading.Event()  # Kopf returned (threads may still be running)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(
                kopf.operator(
                    registry=self.registry,
                    standalone=True,
                    clusterwide=True,
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                    memo=kopf.Memo(ctx=self.ctx),
                )
            )
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished.set()
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def start(self) -> None:
        """Start Kopf and wait until it is ready."""
        self._thread.start()
        if not self.ready_flag.wait(20):
            raise RuntimeError(f"the operator did not start: {self.error!r}")

    def stop(self, *, before_join: Callable[[], None] | None = None) -> None:
        """Stop Kopf; `before_join` runs once Kopf returned (e.g. to release a stuck thread)."""
        self.stop_flag.set()
        self.finished.wait(30)
        if before_join is not None:
            before_join()
        self._thread.join(30)


def wait_for(
    probe: Callable[[], Any], *, timeout: float = 20.0, interval: float = 0.1, what: str = ""
) -> Any:
    """Poll `probe` until it returns something truthy; fail with the last value after timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what or probe}: last {last!r}")
