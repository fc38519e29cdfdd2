"""Start and stop the demo's two services on this machine: the control plane and a data plane.

Both run under uvicorn, each on its own thread of this process, on sockets bound here (the
asked-for port, or a free one when it is taken). The control plane keeps its catalog in SQLite
and its adapter versions in a local store under the run folder; the data plane runs in catalog
mode on the CPU, resolving tenants' keys and adapters through the control plane and loading
stored versions from the same store.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from loraplane.accesslog import AccessLogSettings, make_logger, wrap
from loraplane.demo.errors import DemoError
from loraplane.readiness import NotReady, wait_ok

POOL = "demo"
MAX_LORAS = 2  # device slots: three tenants' adapters share two, so requests get deferred
MAX_LORA_RANK = 32
STARTUP_TIMEOUT_S = 120.0
AccessLog = tuple[str, logging.Logger | None]  # the service's name in its lines, the logger


class StackError(DemoError):
    """A service did not start."""


@dataclass(frozen=True, slots=True)
class Service:
    """One running uvicorn server."""

    name: str
    url: str
    port: int
    fell_back: bool  # the asked-for port was taken
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the server to exit (finishing its lifespan) and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout)


def bind(host: str, port: int) -> tuple[socket.socket, bool]:
    """A socket bound to `port`, or to a free port if that one is taken; (socket, fell back)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        return sock, False
    except OSError:
        sock.bind((host, 0))
        return sock, True


def serve(
    name: str,
    app: FastAPI,
    host: str,
    port: int,
    reserved: tuple[socket.socket, bool] | None = None,
    requests_log: AccessLog | None = None,
) -> Service:
    """Run `app` under uvicorn on a thread, on `port` or a free one if it is taken (or on the
    socket `bind` `reserved` earlier); `requests_log` (service name, logger) logs its requests."""
    sock, fell_back = reserved or bind(host, port)
    bound = int(sock.getsockname()[1])
    served = wrap(app, *requests_log) if requests_log else app
    config = uvicorn.Config(served, host=host, port=bound, log_level="warning", lifespan="on",
                            access_log=False)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return Service(name, f"http://{shown}:{bound}", bound, fell_back, server, thread)


def wait_ready(service: Service, path: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Poll `path` until it answers 200; StackError if the thread dies or time runs out."""
    try:
        wait_ok(service.url + path, timeout, alive=service.thread.is_alive, request_timeout=2)
    except NotReady as e:
        if e.stopped:
            raise StackError(f"the {service.name} stopped while starting") from None
        raise StackError(
            f"the {service.name} at {service.url} was not ready after {timeout:.0f} s"
        ) from None


def start_controlplane(
    run_dir: Path, host: str, port: int, admin: str, service: str, dataplane_url: str,
    requests_log: logging.Logger | None = None,
) -> Service:  # fmt: skip
    """The control plane on SQLite and a local store under `run_dir`, ready to use; its
    console's examples call `dataplane_url`."""
    from pydantic import SecretStr

    from loraplane.controlplane.main import create_app
    from loraplane.controlplane.settings import Settings

    settings = Settings(
        data_dir=run_dir, database_url=f"sqlite:///{run_dir / 'catalog.db'}",
        store=str(run_dir / "store"), admin_token=SecretStr(admin),
        service_token=SecretStr(service), console_dataplane_url=dataplane_url,
    )  # fmt: skip
    svc = serve("control plane", create_app(settings), host, port,
                requests_log=("controlplane", requests_log))  # fmt: skip
    wait_ready(svc, "/readyz")
    return svc


def start_dataplane(
    model: Path,
    base_name: str,
    run_dir: Path,
    host: str,
    port: int,
    cp_url: str,
    service: str,
    reserved: tuple[socket.socket, bool] | None = None,
    requests_log: logging.Logger | None = None,
) -> tuple[Service, Service]:
    """A CPU data plane in catalog mode; it loads the model in the background (see /ready).
    With it, its metrics port on a free port: every series, the per-tenant ones the tour shows
    included (the API port's /metrics has vLLM's protocol gauges only)."""
    from loraplane.dataplane.server.app import create_app
    from loraplane.dataplane.server.metrics_port import create_metrics_app
    from loraplane.dataplane.server.settings import ServerSettings

    settings = ServerSettings(
        model=str(model), served_model_name=base_name, controlplane_url=cp_url,
        service_token=service, store=str(run_dir / "store"), pool=POOL, device="cpu",
        dtype="float32", host=host, port=port, max_loras=MAX_LORAS,
        max_lora_rank=MAX_LORA_RANK, max_cpu_loras=8, num_kv_blocks=512,
        pressure_interval_s=1.0, resolve_ttl_s=5.0, shutdown_grace_s=5.0,
    )  # fmt: skip
    app = create_app(settings)
    api = serve("data plane", app, host, port, reserved, ("dataplane", requests_log))
    return api, serve("data plane metrics", create_metrics_app(app.state.runtime), host, 0)


class Stack:
    """The running system: the control plane, then the data plane, and the demo's tokens."""

    def __init__(
        self, run_dir: Path, host: str, cp_port: int, dp_port: int,
        access_log: AccessLogSettings | None = None, admin_token: str | None = None,
    ) -> None:  # fmt: skip
        self.run_dir, self.host, self.dp_port = run_dir, host, dp_port
        self.admin_token = admin_token or secrets.token_urlsafe(32)
        self.service_token = secrets.token_urlsafe(32)
        # one JSON line per request of either service, on stderr unless set otherwise
        access = access_log if access_log is not None else AccessLogSettings()
        tokens = [self.admin_token, self.service_token]
        self.requests_logs = {
            name: make_logger(access, name, tokens) for name in ("controlplane", "dataplane")
        }
        # the data plane's socket first, so the console's examples name its real port
        self._dp_socket: tuple[socket.socket, bool] | None = bind(host, dp_port)
        shown = f"[{host}]" if ":" in host else host
        dp_url = f"http://{shown}:{self._dp_socket[0].getsockname()[1]}"
        try:
            self.controlplane = start_controlplane(
                run_dir, host, cp_port, self.admin_token, self.service_token, dp_url,
                self.requests_logs["controlplane"],
            )  # fmt: skip
        except BaseException:
            self._dp_socket[0].close()
            raise
        self._dataplane: Service | None = None
        self._metrics: Service | None = None

    @property
    def dataplane(self) -> Service:
        """The data plane (StackError before `start_dataplane`)."""
        if self._dataplane is None:
            raise StackError("the data plane was not started")
        return self._dataplane

    @property
    def metrics(self) -> Service:
        """The data plane's metrics port (StackError before `start_dataplane`)."""
        if self._metrics is None:
            raise StackError("the data plane was not started")
        return self._metrics

    def start_dataplane(self, model: Path, base_name: str) -> Service:
        """Start the data plane; it loads the model in the background (see `wait_ready`)."""
        reserved, self._dp_socket = self._dp_socket, None
        self._dataplane, self._metrics = start_dataplane(
            model, base_name, self.run_dir, self.host, self.dp_port, self.controlplane.url,
            self.service_token, reserved, self.requests_logs["dataplane"],
        )  # fmt: skip
        return self._dataplane

    def wait_ready(self) -> None:
        """Wait until the data plane has loaded its model."""
        wait_ready(self.dataplane, "/ready")

    def stop(self) -> None:
        """Stop the data plane (it drains, then sends its last report), then the control plane."""
        if self._dataplane is not None:
            self._dataplane.stop()
        if self._metrics is not None:
            self._metrics.stop()
        if self._dp_socket is not None:  # reserved, never served
            self._dp_socket[0].close()
        self.controlplane.stop()


@contextlib.contextmanager
def running(
    run_dir: Path, host: str, cp_port: int, dp_port: int,
    access_log: AccessLogSettings | None = None, admin_token: str | None = None,
) -> Iterator[Stack]:  # fmt: skip
    """A stack with its control plane up (with `admin_token`, or a new one); everything
    started is stopped on exit."""
    stack = Stack(run_dir, host, cp_port, dp_port, access_log, admin_token)
    try:
        yield stack
    finally:
        stack.stop()
