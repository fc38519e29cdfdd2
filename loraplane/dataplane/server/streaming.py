"""Server-sent event responses that always close their source.

Starlette cancels a streaming response when its client disconnects; `EventStream` then closes
the body generator explicitly (which aborts the engine requests behind it and frees their KV
blocks) and releases the request's adapter lease, whether the stream ended, failed or was
cancelled, or never started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.5


class EventStream(StreamingResponse):
    """`text/event-stream` over `body`; `on_close` runs once the response is over."""

    def __init__(self, body: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._source = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._source.aclose()
            finally:
                self._on_close()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_disconnected(request: Request, work: asyncio.Task[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise ClientGone
