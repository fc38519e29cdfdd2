"""The probes mean health: a real server whose engine thread dies, whose every step fails, or
whose step hangs, answers /health and /ready as a kubelet needs (docs/operations.md, Probes).

Faults are injected into the running server's engine: its step raising a BaseException (which
ends the loop thread), its scheduler raising (every step fails before its batch is formed), its
step blocking on an event (a hung kernel or driver call). The engine runs on a thread of this
process here (LORAPLANE_ENGINE_PROCESS=0), where a test can reach it; the same faults in the
engine's own process: test_engine_process.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.dataplane.async_engine import AsyncEngine
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine, RequestOutput
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.server.app import create_app
from loraplane.dataplane.server.runtime import Runtime
from tests.dataplane.server.conftest import API_KEY, server_settings, start_server

TENANT = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": "tiny-llama", "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}


class EngineKilled(BaseException):
    """Not an Exception: nothing in the loop catches it, so the loop thread ends."""


def complete(url: str, **extra: object) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={**BODY, **extra}, headers=TENANT, timeout=30)


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {check}")
        time.sleep(0.02)


def status(url: str, path: str) -> int:
    return httpx.get(url + path, timeout=5).status_code


@pytest.fixture
def serve(tiny_llama_dir: Path) -> Iterator[Callable[..., tuple[str, Runtime]]]:
    """Start a server of its own (no adapters) with the given settings; stopped at the end."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: object) -> tuple[str, Runtime]:
            settings = server_settings(tiny_llama_dir, {}, engine_process=False, **overrides)
            return stack.enter_context(start_server(settings))

        yield start


def gauge(runtime: Runtime, name: str) -> float:
    """A gauge of the metrics port's exposition (every series)."""
    text = runtime.metrics.render().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return float(family.samples[0].value)
    raise AssertionError(f"no {name}")


def engine_of(runtime: Runtime) -> Engine:
    assert isinstance(runtime.engine, AsyncEngine)
    return runtime.engine.engine


def test_a_dead_engine_thread_fails_health_and_ready_with_a_reason(
    serve: Callable[..., tuple[str, Runtime]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, runtime = serve()
    assert complete(url).status_code == 200
    assert (status(url, "/health"), status(url, "/ready")) == (200, 200)

    def killed() -> list[RequestOutput]:
        raise EngineKilled

    monkeypatch.setattr(engine_of(runtime), "step", killed)
    in_flight = complete(url)  # its step ends the loop: it is answered, not left hanging
    assert in_flight.status_code == 500, in_flight.text
    wait_until(lambda: runtime.engine is not None and not runtime.engine.alive)
    health = httpx.get(url + "/health")
    assert health.status_code == 503
    assert health.json() == {"alive": False, "reason": "the engine thread is gone (EngineKilled)"}
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503 and "engine thread is gone" in ready.json()["reason"]
    later = complete(url)  # refused at once: nothing would ever read its queue
    assert later.status_code == 503 and "engine has stopped" in later.json()["error"]["message"]
    runtime.draining = True  # a shutdown stops the thread on purpose: not a liveness failure
    assert status(url, "/health") == 200
    assert httpx.get(url + "/ready").json() == {"ready": False, "reason": "draining"}


def test_every_step_failing_takes_the_replica_out_of_rotation_until_a_step_succeeds(
    serve: Callable[..., tuple[str, Runtime]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, runtime = serve(ready_failed_steps=3)
    assert complete(url).status_code == 200
    scheduler = engine_of(runtime).scheduler
    calls = {"n": 0}

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(scheduler, "schedule", broken)
    in_flight = complete(url, max_tokens=64)  # every step of it fails; it gets the error
    assert in_flight.status_code == 500, in_flight.text
    assert calls["n"] == 3  # three steps failed, then every request was given up
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503
    assert ready.json() == {"ready": False, "reason": "the engine's last 3 steps failed"}
    assert status(url, "/health") == 200  # the thread runs: no restart for this
    assert gauge(runtime, "loraplane_engine_failed_steps") == 3
    monkeypatch.undo()  # the fault clears: the next step that returns brings it back
    assert status(url, "/ready") == 503  # no step has succeeded yet
    assert complete(url).status_code == 200
    assert httpx.get(url + "/ready").json() == {"ready": True}
    assert gauge(runtime, "loraplane_engine_failed_steps") == 0


def test_a_forward_that_fails_for_the_base_model_takes_the_replica_out_of_rotation(
    serve: Callable[..., tuple[str, Runtime]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poisoned device (every forward raises): the engine fails each step's rows alone, so
    no step raises, but a step whose base-model rows failed counts as failed for /ready."""
    url, runtime = serve(ready_failed_steps=3)
    assert complete(url).status_code == 200
    runner = engine_of(runtime).runner

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(runner, "execute", poisoned)
    for _ in range(3):  # each request fails alone, in its own step
        assert complete(url).status_code >= 500
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503
    assert ready.json() == {"ready": False, "reason": "the engine's last 3 steps failed"}
    assert status(url, "/health") == 200
    monkeypatch.undo()
    assert complete(url).status_code == 200
    assert httpx.get(url + "/ready").json() == {"ready": True}


def test_a_stuck_step_with_work_queued_fails_ready_until_it_ends(
    serve: Callable[..., tuple[str, Runtime]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, runtime = serve(ready_stall_s=4.0)  # room for a busy machine's HTTP round trip
    assert complete(url).status_code == 200
    engine = engine_of(runtime)
    step, release, entered = engine.step, threading.Event(), threading.Event()

    def stuck() -> list[RequestOutput]:
        entered.set()
        release.wait(30)
        return step()

    monkeypatch.setattr(engine, "step", stuck)
    answers: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answers.append(complete(url)))
    client.start()
    try:
        assert entered.wait(10)
        assert status(url, "/ready") == 200  # a step under the limit is no stall
        wait_until(lambda: status(url, "/ready") == 503, timeout=20)
        reason = httpx.get(url + "/ready").json()["reason"]
        assert reason.startswith("the engine has work but no step has ended for"), reason
        assert status(url, "/health") == 200  # slow is not dead: never killed for it
        assert gauge(runtime, "loraplane_engine_seconds_since_last_step") >= 4.0
    finally:
        release.set()
        client.join(30)
    assert answers and answers[0].status_code == 200
    wait_until(lambda: status(url, "/ready") == 200)
    assert gauge(runtime, "loraplane_engine_seconds_since_last_step") < 4.0


def test_an_idle_engine_is_ready_however_long_ago_its_last_step_and_a_failed_streak_expires(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle is not stalled; and a replica out of rotation for failed steps, with no request to
    try, comes back after the stall window (else it would stay out for good)."""
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          num_kv_blocks=64, block_size=4)  # fmt: skip
    engine = Engine(config)
    front = AsyncEngine(engine)
    try:
        later = time.monotonic() + 3600
        assert front.health(stall_s=30, max_failed_steps=3, now=later).ready

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("scheduler fault (injected)")

        monkeypatch.setattr(engine.scheduler, "schedule", broken)

        async def one() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=2)
            async for _ in front.generate("r", [5, 6, 7], params):
                pass

        with pytest.raises(RuntimeError, match="injected"):
            asyncio.run(one())
        wait_until(lambda: not front.has_work)  # the stream's abort, applied
        verdict = front.health(stall_s=30, max_failed_steps=3)
        assert (verdict.alive, verdict.ready, verdict.failed_steps) == (True, False, 3)
        assert front.health(stall_s=30, max_failed_steps=4).ready  # fewer than the limit
        assert front.health(stall_s=30, max_failed_steps=3, now=time.monotonic() + 31).ready
    finally:
        front.shutdown()
    gone = front.health(stall_s=30, max_failed_steps=3)
    assert (gone.alive, gone.ready, gone.reason) == (
        False,
        False,
        "the engine thread is gone (stopped)",
    )


def test_a_loading_server_is_alive_but_not_ready_and_a_failed_start_says_so(
    tiny_llama_dir: Path,
) -> None:
    """The app before its engine exists (its lifespan, which loads the model, not run)."""
    app = create_app(server_settings(tiny_llama_dir, {}))
    runtime: Runtime = app.state.runtime

    async def probe(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dp") as client:
            return await client.get(path)

    health, ready = asyncio.run(probe("/health")), asyncio.run(probe("/ready"))
    assert (health.status_code, health.json()) == (200, {"alive": True})  # never killed loading
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "reason": "loading"})
    runtime.fatal = "cannot load model /secret/path: bad config"  # the process exits on its own
    ready = asyncio.run(probe("/ready"))
    assert ready.json() == {"ready": False, "reason": "start failed (see the server's log)"}
    assert asyncio.run(probe("/health")).status_code == 200
