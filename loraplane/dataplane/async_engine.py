"""An asyncio front for the engine: each request is an async stream of its outputs.

The engine steps on its own thread (a forward pass must not block the event loop); requests
and aborts are handed to that thread through a queue and applied between steps, and each step's
outputs are delivered to the waiting coroutines with `call_soon_threadsafe`.

    async for out in async_engine.generate("r1", "Hello", params, lora=ref):
        print(out.text, end="")

Leaving the `async for` early (a client disconnected) aborts the request and frees its blocks.

`health()` is what the server's probes answer from (`server/admin_routes.py`): whether the loop
thread runs, and whether it makes progress (its last step ended recently while work waits, and
not every one of its last steps raised). It reads a few fields the loop writes, never calls into
the loop: a probe must answer while a step hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplane.dataplane.outputs import RequestOutput
from loraplane.dataplane.parallel.errors import WorkerLost
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.structured import GrammarCompiler
from loraplane.dataplane.tokenizer import Tokenizer

if TYPE_CHECKING:  # the API server's process reads EngineHealth and Stream without the engine
    from loraplane.dataplane.engine import Engine

log = logging.getLogger(__name__)

# engine steps that may fail in a row before their batch was formed (a scheduler fault)
# before every request is failed: retrying forever would spin with no request ever answered
MAX_FAILED_STEPS = 3


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """The engine loop's verdict: `alive` (its thread runs), `ready` (it makes progress) and,
    when either is false, why. The figures it was drawn from come with it (for metrics)."""

    alive: bool
    ready: bool
    reason: str = ""
    seconds_since_step: float = 0.0  # since a step last ended, or the loop last had no work
    failed_steps: int = 0  # steps that raised, in a row


def judge(
    *,
    gone: str | None,
    busy: bool,
    progress_at: float,
    failed: int,
    failed_at: float,
    stall_s: float,
    max_failed_steps: int,
    now: float,
) -> EngineHealth:
    """The verdict on an engine loop from the fields it writes (shared by the thread and the
    process front). `gone`: why the loop cannot run (None while it runs); `busy`: requests
    or calls wait for it. Not ready when it has work but no step has ended for `stall_s`
    seconds, or when its last `max_failed_steps` steps all raised; ready again once a step
    returns. With no work to try, a failed streak stands for `stall_s` after its last failure
    only: a replica taken out of rotation gets no requests, so it would never have a step to
    succeed with and would stay out for good."""
    since = max(0.0, now - progress_at)
    figures: dict[str, Any] = {"seconds_since_step": since, "failed_steps": failed}
    if gone is not None:
        return EngineHealth(False, False, gone, **figures)
    if busy and since >= stall_s:
        reason = f"the engine has work but no step has ended for {since:.1f} s"
        return EngineHealth(True, False, f"{reason} (limit {stall_s:g} s)", **figures)
    if failed >= max_failed_steps and (busy or now - failed_at < stall_s):
        return EngineHealth(True, False, f"the engine's last {failed} steps failed", **figures)
    return EngineHealth(True, True, **figures)


class EngineLoop:
    """The step loop around one engine: actions queued from other threads are applied between
    steps, a step that raises fails its requests (not the loop), and the health fields probes
    read are kept. Where outputs and errors go is the subclass's `_deliver` and `_stepped`:
    streams of this interpreter (AsyncEngine) or a pipe to the API server's process
    (engine_process.py). Whoever watches the steps adds a step observer to the engine
    (step_observer.py); when the loop finds no work it hands the observers the adapter loads
    that ended meanwhile."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._actions: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._failed_steps = 0  # steps failed in a row before a give-up (see _step_failed)
        # health, written by the loop only (plain attribute writes, read by probes)
        self.last_step_at: float | None = None  # monotonic time of the last step that returned
        self._progress_at = time.monotonic()  # a step ended (returned or raised), or no work
        self._failed_in_a_row = 0  # steps that raised since the last that returned
        self._failed_at = 0.0  # monotonic time of the last step that raised
        self._died: str | None = None  # the type of what ended the loop, if anything

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        raise NotImplementedError

    def _step_failed(self, error: Exception) -> None:
        """A step raised past the engine's own isolation (a fault in the engine, not in one
        adapter or request). The requests of that step fail with the error; the rest go on.
        A step that failed before its batch was formed is retried; the engine gives up on
        every request only after MAX_FAILED_STEPS such failures in a row, rather than spin."""
        batch = list(self.engine.last_batch)
        self._failed_steps += 1
        if not batch and self._failed_steps < MAX_FAILED_STEPS:
            log.error("an engine step failed before its batch was formed; retrying", exc_info=error)
            return
        log.error("an engine step failed; failing %s", "its requests" if batch else "every request",
                  exc_info=error)  # fmt: skip
        for request_id in batch or self.engine.request_ids():
            self.engine.abort(request_id)
            self._deliver(request_id, error)
        self._failed_steps = 0

    @staticmethod
    def _apply(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # an action's failure must not stop the loop
            log.exception("engine action failed")

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished:  # idle: sleep until something is queued
                self._progress_at = time.monotonic()
                self.engine.observers.flush_loads()
                self._idle()
                try:
                    action = self._actions.get(timeout=0.5)
                except queue.Empty:
                    continue
                self._progress_at = time.monotonic()  # it had no work until now
                self._apply(action)
            while True:  # apply everything queued before the next step
                try:
                    self._apply(self._actions.get_nowait())
                except queue.Empty:
                    break
            if not self.engine.has_unfinished:
                continue
            try:
                outputs = self.engine.step()
            except WorkerLost:  # a tensor-parallel rank is gone: the loop ends (not ready)
                raise
            except Exception as e:  # a failed step fails the requests in it, not the loop
                self._failed_at = self._progress_at = time.monotonic()
                self._failed_in_a_row += 1
                self._step_failed(e)
                self._stepped([])
                continue
            self.last_step_at = self._progress_at = time.monotonic()
            self._failed_steps = 0
            if self.engine.broken:  # its rows failed alone, but the step counts as failed
                self._failed_at = self.last_step_at
                self._failed_in_a_row += 1
            else:
                self._failed_in_a_row = 0
            self._stepped(outputs)

    def _idle(self) -> None:
        """Called each time the loop finds no work, before it waits for an action."""

    def _stepped(self, outputs: list[RequestOutput]) -> None:
        """A step ended (with no outputs when it raised): deliver its outputs."""
        for out in outputs:
            self._deliver(out.request_id, out)


@dataclass(slots=True)
class Stream:
    """One request's outputs (or the error that ends it) on their way to the coroutine that
    reads them, on that coroutine's event loop (both engine fronts use it)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    @classmethod
    def here(cls) -> Stream:
        """A stream read on the running event loop."""
        return cls(asyncio.get_running_loop(), asyncio.Queue())

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs as they arrive, until the finished one; a delivered error is raised."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class AsyncEngine(EngineLoop):
    """Runs `engine` on a background thread; `generate` streams one request's outputs."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._streams: dict[str, Stream] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- what the server reads of the engine (engine_process.ProcessEngine has the same) ----

    @property
    def tokenizer(self) -> Tokenizer:
        """The base model's tokenizer (the engine's own object)."""
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (ids past the tokenizer's are padding)."""
        return self.engine.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len or 0

    @property
    def registered(self) -> list[LoRARef]:
        """Every adapter version the engine knows (a read of a dict's keys)."""
        return self.engine.loras.registered

    def is_registered(self, ref: LoRARef) -> bool:
        """Whether the engine knows `ref` (a dict lookup: safe from any thread)."""
        return self.engine.loras.is_registered(ref)

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler of the base model's tokenizer (thread-safe)."""
        return self.engine.grammars()

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora: LoRARef | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        Raises ValueError (from the engine) if the request can never run.
        """
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running")
        stream = Stream.here()
        self._streams[request_id] = stream

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params, lora, tenant)
            except Exception as e:  # delivered to the caller, not fatal to the loop
                self._deliver(request_id, e)

        self._actions.put(add)
        finished = False
        try:
            async for item in stream.outputs():
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request between steps (its blocks are freed)."""
        self._actions.put(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def call(self, fn: Callable[[Engine], Any]) -> None:
        """Run `fn(engine)` on the engine thread between steps (e.g. register an adapter)."""
        self._actions.put(lambda: fn(self.engine))

    def post(self, name: str, *args: Any) -> None:
        """Run the named command (engine_commands.py) between steps; its result is dropped."""
        from loraplane.dataplane.engine_commands import run_command

        self.call(lambda e: run_command(e, name, args))

    async def command(self, name: str, *args: Any) -> Any:
        """Run the named command (engine_commands.py) between steps; return its result (or
        raise its error)."""
        from loraplane.dataplane.engine_commands import run_command

        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def run(e: Engine) -> None:
            try:
                result = run_command(e, name, args)
            except Exception as error:
                loop.call_soon_threadsafe(settle, None, error)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self.call(run)
        return await future

    # -- life cycle -------------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; requests still running are abandoned."""
        self._stop.set()
        self._actions.put(lambda: None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the loop thread runs (False once it died, or after `shutdown`)."""
        return self._thread.is_alive()

    @property
    def has_work(self) -> bool:
        """Requests waiting or running, or actions queued for the loop (a racy read that
        needs no lock: two container sizes)."""
        return self.engine.has_unfinished or not self._actions.empty()

    def health(
        self, *, stall_s: float, max_failed_steps: int, now: float | None = None
    ) -> EngineHealth:
        """The loop's verdict (see `judge`); it reads a few fields the loop writes, never
        calls into it."""
        gone = None
        if not self._thread.is_alive():
            gone = f"the engine thread is gone ({self._died or 'stopped'})"
        return judge(
            gone=gone, busy=self.has_work, progress_at=self._progress_at,
            failed=self._failed_in_a_row, failed_at=self._failed_at, stall_s=stall_s,
            max_failed_steps=max_failed_steps, now=time.monotonic() if now is None else now,
        )  # fmt: skip

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the thread ends: say why, and answer every waiting stream
            # the type only: probes and clients see it, the message may name a request
            self._died = type(e).__name__
            log.critical("the engine loop died; no request can run", exc_info=e)
            for request_id in list(self._streams):
                self._deliver(request_id, RuntimeError(f"the engine stopped: {self._died}"))
