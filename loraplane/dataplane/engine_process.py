"""The engine in a process of its own: the API server's process tokenizes, renders chat
templates, compiles grammars, detokenizes, checks stop strings and streams SSE; a child process
runs the engine loop (scheduler, model, sampler): only the model's work.

Why: in one interpreter the event loop's per-token work (JSON, SSE, the HTTP stack) and the
engine's step take turns at the GIL, so each slows the other. Here they share nothing but a pipe
(`multiprocessing`, a spawned child: START_METHOD; pickled plain dataclasses between the two
processes of one replica):

    server -> engine   ("add", id, prompt, params, constraint, lora, tenant) | ("abort", id)
                       ("cmd", call id | None, name, args)  (engine_commands.py) | ("stop",)
    engine -> server   Ready | Failed  (once, after the model loaded or failed to)
                       Step            (ONE per step: every request's new token ids of that
                                        step with their logprobs and finish reasons, no text;
                                        errors, adapter load times, health fields)
                       Reply           (a command's result) | Died (the loop ended: why)

The protocol's messages are engine_messages.py's, the child's side engine_child.py, the engine
it builds engine_setup.py's (as the in-process mode's). `ProcessEngine` is the server's side,
with AsyncEngine's interface (generate, abort, post,
command, health, alive, has_work, shutdown, tokenizer, vocab_size, grammars, is_registered):
the runtime uses either (`LORAPLANE_ENGINE_PROCESS`). The engine here does not detokenize
(`Engine(detokenize=False)`): the pipe's reader thread in the server's process turns each Step's
ids into text (output_text.py, the same `IncrementalDetokenizer.add_output` the engine on a
thread runs, so the text is the same byte for byte). When a stop string ends a request's text,
its stream ends at the token that completed it (finish_reason "stop", the same token counts)
and one ("abort", id) goes to the engine, which frees the sequence's KV blocks and seat; the
tokens the sequence made meanwhile are dropped. Compiled grammars do not pickle: the server
compiles a request's constraint (to answer 400 at once) and sends the constraint, which the
engine compiles again (cached).

Failure semantics as the thread's: a dead engine process (killed, crashed, out of memory) makes
the replica not ready and not alive (`health()` says why: "the engine process is gone (killed
by SIGKILL)"), every stream in flight gets an error at once and later requests a 503. The child
exits when the server does: it reads the pipe on a thread of its own and stops at end of file
(the server's process gone) or on "stop" (`shutdown` sends it, then kills a child that has not
exited). Stopping is the server's: the child ignores SIGINT and SIGTERM, which Ctrl-C in a
terminal or a signal to the process group deliver to it as well (the server drains, then stops
it); SIGKILL still ends it. At exit without `shutdown` (multiprocessing would terminate, then
join, a daemon child) it is asked to stop first, then killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Literal

from loraplane import fileaccess
from loraplane.dataplane.async_engine import EngineHealth, Stream, judge
from loraplane.dataplane.engine_messages import (
    EXIT_GRACE_S,
    Died,
    Failed,
    Ready,
    Reply,
    Step,
    rebuild,
)
from loraplane.dataplane.engine_setup import StartupError
from loraplane.dataplane.output_text import OutputText
from loraplane.dataplane.outputs import RequestOutput
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.structured import GrammarCompiler
from loraplane.dataplane.tokenizer import Tokenizer

if TYPE_CHECKING:
    from loraplane.dataplane.server.settings import ServerSettings

log = logging.getLogger(__name__)

# How the engine's process starts: "spawn" (a fresh interpreter), one engine a replica. A process
# that starts many engines (the test suite: tests/conftest.py) may set "forkserver" here, with
# the engine's modules preloaded (`set_forkserver_preload`): each engine then forks from a
# server that imported torch once, in a fraction of a second in place of seconds. Either way the
# child takes this process's environment as it is at the start (`engine_child.main`).
START_METHOD: Literal["spawn", "forkserver"] = "spawn"


def _child_main(*args: Any) -> None:
    """The engine process's target: `engine_child.main`, imported there. Named by reference
    from here, the server's process never imports the engine (nor torch) to start it."""
    from loraplane.dataplane import engine_child

    engine_child.main(*args)


class EngineGone(RuntimeError):
    """The engine process has exited: nothing will answer."""


# -- the server's side --------------------------------------------------------------------------


def _server_log_level() -> int:
    """The root logger's level when logging is configured (handlers on the root), else NOTSET."""
    root = logging.getLogger()
    return root.getEffectiveLevel() if root.handlers else logging.NOTSET


@dataclass(slots=True)
class _Call:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    name: str
    args: tuple[Any, ...] = field(default_factory=tuple)


class ProcessEngine:
    """The server's front for an engine in a child process (AsyncEngine's interface).

    `ProcessEngine(settings)` starts the child; `wait_ready()` (blocking: call it on a worker
    thread) loads the tokenizer here while the child loads the model, and raises StartupError
    when the child cannot serve."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        context = (
            multiprocessing.get_context("forkserver")
            if START_METHOD == "forkserver"
            else multiprocessing.get_context("spawn")
        )
        self._conn, child = context.Pipe()
        # a daemon process may not start processes: with tensor parallelism the engine starts
        # its workers (the finalizer below stops it at exit either way)
        self._proc = context.Process(
            target=_child_main, name="loraplane-engine",
            daemon=settings.tensor_parallel_size == 1,
            args=(child, settings, _server_log_level(), dict(os.environ)),
        )  # fmt: skip
        self._proc.start()
        child.close()  # the child's end lives in the child only: its exit means end of file
        self._send_lock = threading.Lock()
        # the child ignores SIGTERM: multiprocessing's exit (terminate, then join) would wait
        # for it, so at exit (or when this front is collected) without `shutdown`, stop it first
        mp_util.Finalize(self, _stop_child, (self._conn, self._send_lock, self._proc),
                         exitpriority=10)  # fmt: skip
        self._streams: dict[str, Stream] = {}
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._registered: dict[str, LoRARef] = {}
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.on_loads: Callable[[list[tuple[str, float]]], None] | None = None
        self.start_loads: list[tuple[str, float]] = []
        self._tokenizer: Tokenizer | None = None
        self._texts: OutputText | None = None  # the requests' text, made here (once ready)
        self.vocab_size = 0
        self.max_model_len = 0
        # health: fields the child reports with each step (monotonic clock: one per machine)
        self._progress_at = time.monotonic()
        self._failed_in_a_row = 0
        self._failed_at = 0.0
        self._died: str | None = None  # why the child is gone, once it is
        self._died_of: str | None = None  # what ended its loop, as it said before exiting
        self._stopping = False

    def wait_ready(self) -> None:
        """Block until the child has loaded the model (StartupError if it cannot)."""
        problem = None
        try:
            tokenizer = Tokenizer.from_dir(self.settings.model)  # meanwhile, the child loads
        except (ValueError, OSError) as e:  # as the engine's own load says it (the child's
            # message, if it failed too, comes first: it names the first file it could not read)
            reason = fileaccess.message(e)
            problem = StartupError(f"cannot load model {self.settings.model}: {reason}")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            why = self._exit()
            raise StartupError(f"the engine process exited while loading ({why})") from None
        if isinstance(message, Failed):
            self._proc.join(10)
            raise StartupError(message.message)
        assert isinstance(message, Ready)
        if problem is not None:
            self.shutdown()
            raise problem
        self._tokenizer = tokenizer
        self._texts = OutputText(tokenizer)
        self.vocab_size, self.max_model_len = message.vocab_size, message.max_model_len
        self._registered = {ref.key: ref for ref in message.registered}
        self.start_loads = message.loads
        self._progress_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="engine-pipe", daemon=True)
        self._reader.start()

    # -- what the server reads of the engine --------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The base model's tokenizer, loaded in this process (once ready)."""
        if self._tokenizer is None:
            raise EngineGone("the engine is not ready")
        return self._tokenizer

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid

    @property
    def registered(self) -> list[LoRARef]:
        """Every adapter version registered through this front (and the static ones)."""
        return list(self._registered.values())

    def is_registered(self, ref: LoRARef) -> bool:
        """Whether `ref` was registered (the engine re-registers a stored version it forgot
        as idle when a request for it comes)."""
        return ref.key in self._registered

    def grammars(self) -> GrammarCompiler:
        """A grammar compiler of the base model's tokenizer, in this process (to refuse a bad
        constraint before the request is queued)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._grammars

    # -- requests and commands ---------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora: LoRARef | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes (AsyncEngine.generate)."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running")
        constraint = None
        if params is not None and params.grammar is not None:
            constraint = params.grammar.constraint
            params = dataclasses.replace(params, grammar=None)
        texts = self._output_text()
        self._mark_busy()
        stream = Stream.here()
        texts.start(request_id, params)  # before the add: its first step's ids find it
        self._streams[request_id] = stream
        finished = False
        try:
            self._check_alive()  # after the stream is in: a death from now on reaches it
            self._send(("add", request_id, prompt, params, constraint, lora, tenant))
            async for item in stream.outputs():
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            texts.forget(request_id)
            if not finished:
                self.abort(request_id)

    def _output_text(self) -> OutputText:
        if self._texts is None:
            raise EngineGone("the engine is not ready")
        return self._texts

    def abort(self, request_id: str) -> None:
        """Abort a request between steps (its blocks are freed)."""
        with contextlib.suppress(EngineGone):
            self._send(("abort", request_id))

    def post(self, name: str, *args: Any) -> None:
        """Send the named command (engine_commands.py); its result is dropped."""
        with contextlib.suppress(EngineGone):
            self._send(("cmd", None, name, args))

    async def command(self, name: str, *args: Any) -> Any:
        """Run the named command (engine_commands.py) between steps; its result or error."""
        call = next(self._ids)
        loop = asyncio.get_running_loop()
        self._mark_busy()
        pending = _Call(loop, loop.create_future(), name, args)
        self._calls[call] = pending
        try:
            self._check_alive()
            self._send(("cmd", call, name, args))
            result = await pending.future
        finally:
            self._calls.pop(call, None)
        if name in ("register_stored", "register_lora"):
            self._registered[result.key] = result
        elif name == "warm_stored":
            self._registered[args[0].key] = args[0]
        elif name == "unregister":
            for ref in result:
                self._registered.pop(ref.key, None)
        return result

    def _mark_busy(self) -> None:
        """Work arrives: an idle loop had made progress until now (as the thread's notes)."""
        if not self.has_work:
            self._progress_at = max(self._progress_at, time.monotonic())

    def _check_alive(self) -> None:
        if self._died is not None:
            raise EngineGone(f"the engine stopped: {self._died}")

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:  # a closed pipe: the child is gone
            raise EngineGone(f"the engine stopped: {self._died or 'its pipe closed'}") from e

    # -- the pipe's reader ---------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, Step):
                    self._on_step(message)
                elif isinstance(message, Reply):
                    self._on_reply(message)
                elif isinstance(message, Died):
                    self._died_of = message.reason
        except (EOFError, OSError):
            pass
        except Exception:  # a message that does not unpickle: the pipe cannot be trusted
            log.exception("the engine's pipe failed")
        self._gone()

    def _on_step(self, step: Step) -> None:
        self._progress_at = max(self._progress_at, step.progress_at)
        self._failed_in_a_row, self._failed_at = step.failed_in_a_row, step.failed_at
        if step.loads and self.on_loads is not None:
            self.on_loads(step.loads)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]] = {}
        texts = self._output_text()
        for raw in step.outputs:
            out, abort = texts.render(raw)  # ids to text, here; None once its text ended
            if abort:  # before its stream ends: a request sent after has its id free
                self.abort(raw.request_id)
            stream = self._streams.get(raw.request_id)
            if out is not None and stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for request_id, error in step.errors:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, rebuild(error)))
        for loop, items in by_loop.items():  # one wake-up of each event loop per step
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_put_all, items)

    def _on_reply(self, reply: Reply) -> None:
        pending = self._calls.get(reply.call)
        if pending is None:
            return
        value = reply.value if reply.ok else rebuild(reply.value)
        with contextlib.suppress(RuntimeError):
            pending.loop.call_soon_threadsafe(_settle, pending.future, reply.ok, value)

    def _gone(self) -> None:
        """The pipe closed: the child exited (or is about to). Fail everything waiting."""
        self._proc.join(5)
        reason = "stopped" if self._stopping else self._exit()
        self._died = reason
        if not self._stopping:
            log.critical("the engine process is gone (%s); no request can run", reason)
        error = f"the engine stopped: {reason}"
        for stream in list(self._streams.values()):
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineGone(error))
        for pending in list(self._calls.values()):
            with contextlib.suppress(RuntimeError):
                pending.loop.call_soon_threadsafe(_settle, pending.future, False, EngineGone(error))

    def _exit(self) -> str:
        """Why the child ended, in words."""
        if self._died_of is not None:
            return self._died_of
        code = self._proc.exitcode
        if code is None:
            return "its pipe closed"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    # -- life cycle and health -----------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (asked first, then killed: it ignores SIGTERM); requests still
        running are abandoned."""
        self._stopping = True
        with contextlib.suppress(EngineGone):
            self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
        if self._reader is not None:
            self._reader.join(5)
        self._died = self._died or "stopped"

    @property
    def alive(self) -> bool:
        """Whether the engine process runs (False once it died, or after `shutdown`)."""
        return self._died is None and self._proc.is_alive()

    @property
    def has_work(self) -> bool:
        """Requests streaming, or commands waiting for their answer."""
        return bool(self._streams) or bool(self._calls)

    def health(
        self, *, stall_s: float, max_failed_steps: int, now: float | None = None
    ) -> EngineHealth:
        """The loop's verdict (async_engine.judge) from the fields its last step reported;
        it never waits for the child: a probe must answer while a step hangs."""
        gone = None
        if not self.alive:
            reason = self._died or self._exit()
            gone = f"the engine process is gone ({reason})"
        return judge(
            gone=gone, busy=self.has_work, progress_at=self._progress_at,
            failed=self._failed_in_a_row, failed_at=self._failed_at, stall_s=stall_s,
            max_failed_steps=max_failed_steps, now=time.monotonic() if now is None else now,
        )  # fmt: skip


def _stop_child(conn: Connection, lock: threading.Lock, proc: BaseProcess) -> None:
    """Ask the child to stop, give it EXIT_GRACE_S to end its step, then kill it (nothing when
    `shutdown` already did)."""
    with contextlib.suppress(OSError, ValueError), lock:
        conn.send(("stop",))
    if proc.is_alive():
        proc.join(EXIT_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _put_all(items: list[tuple[Stream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
