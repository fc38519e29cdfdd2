"""The engine's process (engine_process.py's child): build the engine, report, then serve the
pipe (requests, aborts, commands in; one Step message out per step) until the server says stop
or is gone."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from loraplane.dataplane.async_engine import EngineLoop
from loraplane.dataplane.engine import Engine, RequestOutput
from loraplane.dataplane.engine_commands import run_command
from loraplane.dataplane.engine_messages import (
    EXIT_GRACE_S,
    Died,
    Failed,
    Ready,
    Reply,
    Step,
    portable,
)
from loraplane.dataplane.engine_setup import LOG_FORMAT, StartupError, build_engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.structured import Constraint
from loraplane.redact import env_secrets, install_log_redaction

if TYPE_CHECKING:
    from loraplane.dataplane.server.settings import ServerSettings

log = logging.getLogger(__name__)


def _child_logging(level: int, settings: ServerSettings) -> None:
    """Log as the server does (its level and format, keys and tokens redacted) to the stderr
    both share: the engine's lines (the LoRA kernel it loaded, adapter loads) stay in the log."""
    if level == logging.NOTSET:  # the server configured no logging: neither does its engine
        return
    logging.basicConfig(level=level, format=LOG_FORMAT)
    keys = [settings.api_key, settings.admin_token, settings.service_token]
    install_log_redaction([*keys, *env_secrets()])


def _leave_stopping_to_the_server() -> None:
    """Ignore SIGINT and SIGTERM: Ctrl-C in a terminal (SIGINT to the foreground process group)
    or a SIGTERM to the group reaches this process as well as the server, which drains and then
    stops it (a "stop" message, or its pipe closing). SIGKILL still ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main(
    conn: Connection, settings: ServerSettings, log_level: int, environ: dict[str, str]
) -> None:
    """The engine process: build the engine, report, serve the pipe until told to stop or the
    server goes away. `environ`: the server's environment when it started this process (what a
    spawned child has anyway; a child forked from a forkserver has the forkserver's)."""
    _leave_stopping_to_the_server()  # before anything else: a signal may come while it loads
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    _child_logging(log_level, settings)
    loads: deque[tuple[str, float]] = deque()
    try:
        engine = build_engine(settings, lambda tier, s: loads.append((tier, s)), detokenize=False)
    except StartupError as e:
        conn.send(Failed(str(e)))
        return
    except Exception as e:
        conn.send(Failed(f"start failed: {type(e).__name__}: {e}"))
        return
    conn.send(Ready(engine.config.max_model_len or 0, engine.runner.vocab_size,
                    engine.loras.registered, _drain(loads)))  # fmt: skip
    try:
        _EngineServer(engine, conn, loads).run()
    finally:
        engine.close()  # its tensor-parallel workers, if any, stop with it


def _drain(loads: deque[tuple[str, float]]) -> list[tuple[str, float]]:
    out = []
    while loads:  # appended to by the engine's step observer (LoadTimes)
        out.append(loads.popleft())
    return out


class _EngineServer(EngineLoop):
    """The engine loop of the child: actions come from the pipe (read on a thread), each step
    goes back as one Step message."""

    def __init__(self, engine: Engine, conn: Connection, loads: deque[tuple[str, float]]):
        super().__init__(engine)
        self._conn = conn
        self._loads = loads
        self._errors: list[tuple[str, Any]] = []
        self._stored: dict[str, tuple[LoRARef, str]] = {}  # key -> (ref, store path)

    def run(self) -> None:
        threading.Thread(target=self._read, name="engine-pipe", daemon=True).start()
        try:
            self._loop()
        except (EOFError, OSError):  # the server is gone: nobody to answer
            return
        except BaseException as e:
            log.critical("the engine loop died; no request can run", exc_info=e)
            with contextlib.suppress(Exception):
                self._conn.send(Died(type(e).__name__))
            raise

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "stop":
                    break
                self._actions.put(self._action(message))
        except (EOFError, OSError):  # the server's process is gone: stop, then exit anyway
            threading.Timer(EXIT_GRACE_S, os._exit, (0,)).start()
        self._stop.set()
        self._actions.put(lambda: None)

    def _action(self, message: tuple[Any, ...]) -> Callable[[], None]:
        kind = message[0]
        if kind == "add":
            return lambda: self._add(*message[1:])
        if kind == "abort":
            return lambda: self._abort(message[1])
        if kind == "cmd":
            return lambda: self._command(*message[1:])
        raise ValueError(f"unknown message {kind!r}")

    def _add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        constraint: Constraint | None,
        lora: LoRARef | None,
        tenant: str | None,
    ) -> None:
        engine = self.engine
        try:
            if params is not None and constraint is not None:
                params = dataclasses.replace(params, grammar=engine.grammars().compile(constraint))
            stored = self._stored.get(lora.key) if lora is not None else None
            if stored is not None and not engine.loras.is_registered(stored[0]):
                engine.loras.register_stored(*stored)  # forgotten as idle since the server's
            engine.add_request(request_id, prompt, params, lora, tenant)
        except Exception as e:  # delivered to the caller, not fatal to the loop
            self._deliver(request_id, e)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _command(self, call: int | None, name: str, args: tuple[Any, ...]) -> None:
        try:
            result = run_command(self.engine, name, args)
        except Exception as e:
            reply = Reply(call or 0, False, portable(e))
        else:
            if name == "register_stored":
                self._stored[result.key] = (result, args[1])
            elif name == "warm_stored":  # re-registered as register_stored's are
                self._stored[args[0].key] = (args[0], args[1])
            elif name == "unregister":
                for ref in result:
                    self._stored.pop(ref.key, None)
            reply = Reply(call or 0, True, result)
        if call is not None:
            self._conn.send(reply)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._errors.append((request_id, portable(item)))

    def _stepped(self, outputs: list[RequestOutput]) -> None:
        self._send_step(outputs)

    def _idle(self) -> None:
        if self._errors or self._loads:
            self._send_step([])

    def _send_step(self, outputs: list[RequestOutput]) -> None:
        errors, self._errors = self._errors, []
        self._conn.send(Step(outputs, errors, _drain(self._loads), self._progress_at,
                             self._failed_in_a_row, self._failed_at))  # fmt: skip
