"""The engine in a process of its own (engine_process.py): a real server whose engine process
is killed mid-stream, stopped, or orphaned, and the pieces that cross its pipe.

The rest of the server's tests run this mode too (it is the default); test_health_probes.py
injects its faults into an engine on a thread (LORAPLANE_ENGINE_PROCESS=0), where they reach."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.dataplane import engine_process
from loraplane.dataplane.engine_messages import portable, rebuild
from loraplane.dataplane.engine_process import EngineGone, ProcessEngine
from loraplane.dataplane.engine_setup import StartupError
from loraplane.dataplane.server.runtime import Runtime
from tests.dataplane.server.conftest import (
    API_KEY,
    REPO,
    children_of,
    server_settings,
    spawn,
    start_server,
    wait_ready,
)
from tests.servers import free_port

TENANT = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": "tiny-llama", "prompt": "the quick brown fox", "max_tokens": 240,
        "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {check}")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts: it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def front(runtime: Runtime) -> ProcessEngine:
    assert isinstance(runtime.engine, ProcessEngine)
    return runtime.engine


@pytest.fixture
def serve(tiny_llama_dir: Path) -> Iterator[Callable[..., tuple[str, Runtime]]]:
    with contextlib.ExitStack() as stack:

        def start(**overrides: object) -> tuple[str, Runtime]:
            settings = server_settings(tiny_llama_dir, {}, engine_process=True, **overrides)
            return stack.enter_context(start_server(settings))

        yield start


def test_a_killed_engine_process_fails_the_stream_at_once_and_the_replica_turns_unready(
    serve: Callable[..., tuple[str, Runtime]],
) -> None:
    url, runtime = serve()
    engine = front(runtime)
    assert engine.pid is not None and engine.pid != os.getpid()
    assert (httpx.get(url + "/health").status_code, httpx.get(url + "/ready").status_code) == (
        200,
        200,
    )
    with httpx.stream("POST", url + "/v1/completions", json=LONG, headers=TENANT,
                      timeout=30) as r:  # fmt: skip
        lines = r.iter_lines()
        assert r.status_code == 200
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(engine.pid, signal.SIGKILL)  # as the OOM killer would
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 5  # answered, not left hanging for its 240 tokens
    assert any('"error"' in line for line in rest), rest[-3:]
    health = httpx.get(url + "/health")
    assert health.status_code == 503
    assert health.json() == {
        "alive": False,
        "reason": "the engine process is gone (killed by SIGKILL)",
    }
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503 and "engine process is gone" in ready.json()["reason"]
    later = httpx.post(url + "/v1/completions", json={**LONG, "stream": False}, headers=TENANT)
    assert later.status_code == 503 and "engine has stopped" in later.json()["error"]["message"]


def test_a_stopped_engine_process_is_a_stall_not_a_death_and_recovers(
    serve: Callable[..., tuple[str, Runtime]],
) -> None:
    """A hung step (here: the engine process stopped by SIGSTOP) with work waiting: /ready turns
    503 once no step has ended for LORAPLANE_READY_STALL_S, /health stays 200 (slow is not
    dead); the stream resumes and /ready comes back once the process runs again."""
    url, runtime = serve(ready_stall_s=1.0)
    pid = front(runtime).pid
    assert pid is not None
    with httpx.stream("POST", url + "/v1/completions", json=LONG, headers=TENANT,
                      timeout=30) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: httpx.get(url + "/ready").status_code == 503, timeout=10)
            reason = httpx.get(url + "/ready").json()["reason"]
            assert reason.startswith("the engine has work but no step has ended for"), reason
            assert httpx.get(url + "/health").status_code == 200
        finally:
            os.kill(pid, signal.SIGCONT)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    wait_until(lambda: httpx.get(url + "/ready").status_code == 200)


def test_the_engine_process_takes_the_servers_environment_as_it_is_at_the_start(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suite forks engines from a forkserver that started earlier, with the environment of
    that time (tests/conftest.py); the child still reads the server's, as a spawned one does:
    a LORAPLANE_CPU_THREADS set now fails its start, naming the variable."""
    assert engine_process.START_METHOD == "forkserver"
    assert multiprocessing.get_context("forkserver").get_start_method() == "forkserver"
    settings = server_settings(tiny_llama_dir, {}, engine_process=True)
    first = ProcessEngine(settings)  # the forkserver runs (started here if no test did yet)
    first.wait_ready()
    first.shutdown()
    monkeypatch.setenv("LORAPLANE_CPU_THREADS", "none")
    second = ProcessEngine(settings)
    with pytest.raises(StartupError, match=r"LORAPLANE_CPU_THREADS must be a positive integer"):
        second.wait_ready()


def test_commands_cross_to_the_engine_process_and_shutdown_leaves_no_child(
    serve: Callable[..., tuple[str, Runtime]], peft_adapters: dict[str, Path]
) -> None:
    name, path = next(iter(peft_adapters.items()))
    url, runtime = serve(lora_modules=[f"{name}={path}"], admin_token="t")
    engine = front(runtime)
    assert [ref.name for ref in engine.registered] == [name]
    body = {"model": name, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    first = httpx.post(url + "/v1/completions", json=body, headers=TENANT, timeout=30)
    assert first.status_code == 200, first.text
    admin = {"Authorization": "Bearer t"}
    unloaded = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin)
    assert unloaded.status_code == 200, unloaded.text
    assert engine.registered == []  # the engine's answer: the versions it freed
    assert httpx.post(url + "/v1/completions", json=body, headers=TENANT).status_code == 404
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name}, headers=admin)
    assert loaded.status_code == 200, loaded.text
    again = httpx.post(url + "/v1/completions", json=body, headers=TENANT, timeout=30)
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    metrics = runtime.metrics.render().decode()
    # load times measured in the engine's process reach this one's histogram
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith('loraplane_adapter_load_seconds_count{tier="cpu"}')
    )
    assert float(line.split()[-1]) >= 2  # the static load at start, and the load route's
    pid = engine.pid
    assert pid is not None
    runtime.draining = True
    engine.shutdown()
    assert gone(pid) and not engine.alive
    assert engine.health(stall_s=30, max_failed_steps=3).reason == (
        "the engine process is gone (stopped)"
    )


def test_sigint_and_sigterm_leave_stopping_the_engine_process_to_the_server(
    serve: Callable[..., tuple[str, Runtime]], caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C in a terminal (SIGINT to the foreground process group) or a SIGTERM to the group
    reaches the engine process too: it ignores both and serves on; the server's shutdown then
    stops it when asked (no kill after the grace), with no CRITICAL "gone" line."""
    url, runtime = serve()
    engine = front(runtime)
    pid = engine.pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)  # a default disposition would have ended it by now
    assert not gone(pid) and engine.alive
    body = {**LONG, "stream": False, "max_tokens": 3}
    done = httpx.post(url + "/v1/completions", json=body, headers=TENANT, timeout=30)
    assert done.status_code == 200, done.text
    assert httpx.get(url + "/health").status_code == 200
    runtime.draining = True
    start = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - start < 5  # it stopped on "stop", not killed after the timeout
    assert gone(pid) and pid not in children_of(os.getpid()) and not engine.alive
    critical = [r.getMessage() for r in caplog.records if r.levelno >= logging.CRITICAL]
    assert critical == []


def test_the_engine_process_exits_when_the_server_process_is_killed(
    tiny_llama_dir: Path,
) -> None:
    port = free_port()
    proc = spawn(["--model", str(tiny_llama_dir), "--port", str(port)],
                 env={"LORAPLANE_NUM_KV_BLOCKS": "64"})  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=120, proc=proc)
        # the engine process (and multiprocessing's resource tracker beside it)
        children = children_of(proc.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children]
        assert any(b"multiprocessing.spawn" in c for c in commands), commands
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown, no atexit: only the pipe tells
        proc.wait(10)
        wait_until(lambda: all(gone(pid) for pid in children), timeout=15)  # no orphans
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_server_exiting_without_shutdown_still_stops_the_engine_process(
    tiny_llama_dir: Path,
) -> None:
    """The child ignores SIGTERM, so multiprocessing's exit alone (terminate its daemon
    children, then join them) would wait for it forever: a process exiting without `shutdown`
    asks it to stop first."""
    script = (
        "import sys\n"
        "from loraplane.dataplane.engine_process import ProcessEngine\n"
        "from loraplane.dataplane.server.settings import ServerSettings\n"
        "engine = ProcessEngine(ServerSettings.load(model=sys.argv[1], num_kv_blocks=64))\n"
        "engine.wait_ready()\n"
        "print(engine.pid, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script, str(tiny_llama_dir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=90)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert gone(int(done.stdout.split()[0]))


def test_errors_cross_the_pipe_as_what_the_routes_catch() -> None:
    rejected = rebuild(portable(AdapterRejected(ReasonCode.RANK_TOO_LARGE, "rank 128 > 64")))
    assert isinstance(rejected, AdapterRejected)
    assert (rejected.code, rejected.message) == (ReasonCode.RANK_TOO_LARGE, "rank 128 > 64")
    value = rebuild(portable(ValueError("adapter acme/x@1 is not registered")))
    assert type(value) is ValueError and "not registered" in str(value)
    oserror = rebuild(portable(PermissionError(13, "Permission denied", "/a/b")))
    assert isinstance(oserror, PermissionError) and oserror.filename == "/a/b"

    class Local(Exception):  # not importable by name: does not unpickle
        pass

    other = rebuild(portable(Local("boom")))
    assert type(other) is RuntimeError and str(other) == "Local: boom"
    assert issubclass(EngineGone, RuntimeError)
