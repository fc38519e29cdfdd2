"""A real server (uvicorn in a thread, on a free 127.0.0.1 port) over the tiny Llama and 20
adapters (the 8 fixture adapters under 20 names), plus helpers to start one as a subprocess."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraplane.dataplane.server.app import create_app
from loraplane.dataplane.server.metrics_port import create_metrics_app
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.readiness import NotReady, wait_ok
from tests.servers import serve_in_thread

API_KEY = "sk-test-tenant"
ADMIN_TOKEN = "admin-test-token"
NUM_ADAPTERS = 20
REPO = Path(__file__).resolve().parents[3]


@dataclass
class Running:
    """A server running in this process."""

    url: str
    runtime: Runtime
    settings: ServerSettings
    adapters: dict[str, Path]
    metrics_url: str  # the metrics port (every series, per-tenant ones included)

    @property
    def v1(self) -> str:
        return self.url + "/v1"


def wait_ready(url: str, timeout: float = 60.0, proc: subprocess.Popen[str] | None = None) -> None:
    try:
        wait_ok(url + "/ready", timeout, alive=proc)
    except NotReady as e:
        if e.stopped:
            raise RuntimeError(f"server exited with {proc and proc.returncode}") from None
        raise TimeoutError(f"{url} not ready after {timeout} s") from None


@contextlib.contextmanager
def start_server(settings: ServerSettings) -> Iterator[tuple[str, Runtime]]:
    app = create_app(settings)
    with serve_in_thread(app) as url:
        wait_ready(url)
        yield url, app.state.runtime


@contextlib.contextmanager
def serve_metrics(runtime: Runtime) -> Iterator[str]:
    """The metrics port's app of a running server, on a port of its own; its base URL."""
    with serve_in_thread(create_metrics_app(runtime)) as url:
        yield url


@pytest.fixture(scope="session")
def adapter_names(peft_adapters: dict[str, Path]) -> dict[str, Path]:
    """20 adapter names over the 8 fixture adapters."""
    paths = list(peft_adapters.values())
    return {f"ad{i:02d}": paths[i % len(paths)] for i in range(NUM_ADAPTERS)}


def server_settings(model: Path, adapters: dict[str, Path], **overrides: object) -> ServerSettings:
    values: dict[str, object] = {
        "model": str(model),
        "served_model_name": "tiny-llama",
        "lora_modules": [f"{name}={path}" for name, path in adapters.items()],
        "max_loras": 8,
        "max_cpu_loras": 32,
        "num_kv_blocks": 512,
        "api_key": API_KEY,
        "admin_token": ADMIN_TOKEN,
    }
    values.update(overrides)
    return ServerSettings.load(**values)


@pytest.fixture(scope="session")
def server(tiny_llama_dir: Path, adapter_names: dict[str, Path]) -> Iterator[Running]:
    """The shared server: api key and admin token set, 20 adapters, max_loras 8."""
    settings = server_settings(tiny_llama_dir, adapter_names)
    with start_server(settings) as (url, runtime), serve_metrics(runtime) as metrics_url:
        yield Running(url, runtime, settings, adapter_names, metrics_url)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (read from /proc), zombies left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                    found.append(int(entry.name))
    return found


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`python -m loraplane.dataplane.server serve ARGS` in a subprocess (no metrics ports
    unless ARGS or `env` ask for them: the default ports may be taken on a shared machine)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "LORAPLANE_METRICS_PORT": "0",
                "LORAPLANE_GATEWAY_METRICS_PORT": "0", **(env or {})}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "loraplane.dataplane.server", "serve", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
