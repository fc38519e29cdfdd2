"""Real HTTP servers for tests: a free loopback port, and an ASGI app served by uvicorn from a
thread (the control plane, the data plane), started and stopped by a context manager."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int | None = None, timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 from a thread; yield its base URL once uvicorn listens."""
    port = port or free_port()
    with _serving(app, port, None, timeout):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serve_sockets_in_thread(
    app: Any, sockets: list[socket.socket], timeout: float = 60.0
) -> Iterator[list[str]]:
    """Serve `app` on every one of `sockets` (bound to 127.0.0.1) from one uvicorn server in a
    thread; yield their base URLs, in order, once it listens."""
    ports = [int(sock.getsockname()[1]) for sock in sockets]
    with _serving(app, ports[0], sockets, timeout):
        yield [f"http://127.0.0.1:{port}" for port in ports]


@contextlib.contextmanager
def _serving(
    app: Any, port: int, sockets: list[socket.socket] | None, timeout: float
) -> Iterator[None]:
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": sockets}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(30)
