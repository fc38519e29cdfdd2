"""Waiting for a server that was just started to answer: poll a URL until it says 200, stop at
once when the server's process or thread is gone, give up after a deadline. The demo stack
uses it, and so do the tests and benchmarks that start servers as a user would."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from typing import Any

import httpx


class NotReady(Exception):
    """The server stopped (`stopped` True) or did not answer 200 in time."""

    def __init__(self, message: str, stopped: bool) -> None:
        super().__init__(message)
        self.stopped = stopped


def wait_ok(
    url: str,
    timeout: float,
    alive: Callable[[], bool] | subprocess.Popen[Any] | None = None,
    interval: float = 0.05,
    request_timeout: float = 1.0,
) -> None:
    """Return once GET `url` answers 200. NotReady when `alive()` turns False first (checked
    before each try; a process: when it has exited) or `timeout` seconds pass."""
    if isinstance(alive, subprocess.Popen):
        proc = alive
        alive = lambda: proc.poll() is None  # noqa: E731
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None and not alive():
            raise NotReady(f"{url}: the server stopped while starting", stopped=True)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=request_timeout).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise NotReady(f"{url} did not answer 200 within {timeout:g} s", stopped=False)
        time.sleep(interval)
