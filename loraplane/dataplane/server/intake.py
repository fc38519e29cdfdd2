"""Intake workers: bounded thread pools that serve tenants fairly.

Tokenization (chat templates included), grammar compilation and the formatting of large
answers run off the event loop, each kind in a `FairPool` of its own, so that one tenant's
8 MiB prompts or distinct JSON schemas cannot hold up another tenant's intake. A pool starts a
job only on a free worker; when several tenants wait, the next free worker goes to the waiting
tenant with the fewest jobs running (ties in turn), so while another tenant waits nobody holds
more than ceil(workers / 2) of the workers for longer than its running jobs last. A tenant
alone uses every worker (work-conserving). A job that has started runs to its end (a thread
cannot be stopped); a waiting job whose caller gave up (its client went away) is dropped.

    pool = FairPool("tokenize", workers=2)
    ids = await pool.run("acme", lambda: tokenizer.encode(text))
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from loraplane.dataplane.cpus import usable_cpus

T = TypeVar("T")
MAX_AUTO_WORKERS = 4


def auto_workers(cores: int | None = None) -> int:
    """Workers per intake pool when unset: a quarter of the cores, between 2 and 4.

    The engine thread and the event loop need cores of their own, and each pool's jobs are
    short bursts; two workers per pool is the least that lets a second tenant in while one
    holds a worker, four keeps the pools from taking a large machine's cores from the engine.
    """
    cores = usable_cpus() if cores is None else cores
    return max(2, min(MAX_AUTO_WORKERS, cores // 4))


@dataclass(slots=True)
class _Job(Generic[T]):
    fn: Callable[[], T]
    result: asyncio.Future[T]


class FairPool:
    """`workers` threads shared by tenants, the fewest-running waiting tenant served first."""

    def __init__(self, name: str, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"{name} workers must be >= 1, got {workers}")
        self.name, self.workers = name, workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._running: Counter[str] = Counter()
        self._busy = 0
        # tenant -> its waiting jobs, oldest first; dict order is the turn among equals
        self._waiting: dict[str, deque[_Job[Any]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def running(self, tenant: str | None = None) -> int:
        """Jobs running now, of one tenant or in total."""
        return self._busy if tenant is None else self._running[tenant]

    def waiting(self, tenant: str | None = None) -> int:
        """Jobs waiting for a worker, of one tenant or in total (given-up ones included until
        their turn comes)."""
        if tenant is not None:
            return len(self._waiting.get(tenant, ()))
        return sum(len(q) for q in self._waiting.values())

    async def run(self, tenant: str, fn: Callable[[], T]) -> T:
        """Run `fn()` on a worker in `tenant`'s turn; its result or its exception. Cancelling
        the caller drops the job if it has not started yet."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        job: _Job[T] = _Job(fn, loop.create_future())
        self._waiting.setdefault(tenant, deque()).append(job)
        self._dispatch()
        return await job.result

    def shutdown(self) -> None:
        """Stop the workers; waiting jobs are never started."""
        self._waiting.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _next_tenant(self) -> str | None:
        """The waiting tenant with the fewest running jobs, first in turn among equals."""
        best: str | None = None
        for tenant, queue in list(self._waiting.items()):
            while queue and queue[0].result.done():  # its caller gave up
                queue.popleft()
            if not queue:
                del self._waiting[tenant]
            elif best is None or self._running[tenant] < self._running[best]:
                best = tenant
        return best

    def _dispatch(self) -> None:
        while self._busy < self.workers:
            tenant = self._next_tenant()
            if tenant is None:
                return
            queue = self._waiting.pop(tenant)  # back in at the end: the others' turn first
            job = queue.popleft()
            if queue:
                self._waiting[tenant] = queue
            self._running[tenant] += 1
            self._busy += 1
            future = self._executor.submit(job.fn)
            future.add_done_callback(functools.partial(self._from_worker, tenant=tenant, job=job))

    def _from_worker(self, future: Future[Any], *, tenant: str, job: _Job[Any]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._finished, future, tenant, job)

    def _finished(self, future: Future[Any], tenant: str, job: _Job[Any]) -> None:
        self._busy -= 1
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        if not job.result.done():  # else the caller went away: the result is dropped
            if future.cancelled():
                job.result.cancel()
            elif (error := future.exception()) is not None:
                job.result.set_exception(error)
            else:
                job.result.set_result(future.result())
        self._dispatch()
