"""Intake: cheap refusals before any tokenizer or compiler work, worker pools that tenants share
fairly, the lease given back on every failure after it, and cached prompt tokens in usage."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.responses import JSONResponse

from loraplane.dataplane.server import openai_format as fmt
from loraplane.dataplane.server.intake import FairPool, auto_workers
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import API_KEY, Running, server_settings, start_server
from tests.test_e2e_catalog import controlplane

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def schema_body(field: str) -> dict[str, Any]:
    """A completions body with a JSON schema of its own (a new grammar to compile)."""
    schema = {**SCHEMA, "properties": {field: {"type": "integer"}}, "required": [field]}
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return {"model": "tiny-llama", "prompt": "x", "max_tokens": 4,
            "response_format": response_format}  # fmt: skip


# -- the fair pool, alone -------------------------------------------------------------------


def test_auto_workers_take_a_quarter_of_the_cores_between_two_and_four() -> None:
    assert [auto_workers(c) for c in (1, 2, 8, 12, 16, 64)] == [2, 2, 2, 3, 4, 4]


def test_a_tenant_alone_uses_every_worker_and_a_waiting_tenant_gets_the_next_one() -> None:
    async def scenario() -> list[str]:
        pool = FairPool("t", workers=2)
        gates = [threading.Event() for _ in range(6)]
        started: list[str] = []

        def job(name: str, gate: threading.Event) -> str:
            started.append(name)
            gate.wait(10)
            return name

        a = [asyncio.ensure_future(pool.run("a", functools.partial(job, f"a{i}", gates[i])))
             for i in range(5)]  # fmt: skip
        while pool.running("a") < 2:
            await asyncio.sleep(0.005)
        assert (pool.running(), pool.waiting("a")) == (2, 3)  # work-conserving: both workers
        b = asyncio.ensure_future(pool.run("b", lambda: job("b", gates[5])))
        await asyncio.sleep(0.05)
        gates[0].set()  # one of a's jobs ends: the worker goes to b, not to a's backlog
        while "b" not in started:
            await asyncio.sleep(0.005)
        assert (pool.running("a"), pool.running("b")) == (1, 1)
        for gate in gates:
            gate.set()
        assert await asyncio.gather(*a, b) == ["a0", "a1", "a2", "a3", "a4", "b"]
        pool.shutdown()
        return started

    started = asyncio.run(scenario())
    assert started.index("b") == 2  # behind the two running, ahead of a's three waiting


def test_a_job_whose_caller_gave_up_never_starts_and_errors_reach_the_caller() -> None:
    async def scenario() -> None:
        pool = FairPool("t", workers=1)
        gate, ran = threading.Event(), []
        first = asyncio.ensure_future(pool.run("a", lambda: gate.wait(10)))
        gone = asyncio.ensure_future(pool.run("a", lambda: ran.append("gone")))
        await asyncio.sleep(0.02)
        gone.cancel()  # its client went away while it waited
        gate.set()
        assert await first is True

        def fail() -> None:
            raise ValueError("bad template")

        with pytest.raises(ValueError, match="bad template"):
            await pool.run("a", fail)
        assert (ran, pool.running(), pool.waiting()) == ([], 0, 0)
        pool.shutdown()

    asyncio.run(scenario())


def test_answers_written_in_slices_are_the_same_json_as_one_call() -> None:
    top = [{"tok": -0.5, "é": -1.25} for _ in range(700)]
    body = {"id": "x", "choices": [{"index": 0, "logprobs": {"top_logprobs": [None, *top],
            "tokens": ["a"] * 300, "text_offset": list(range(1000))}}, {"index": 1}],
            "usage": {"prompt_tokens": 3}, "empty": [], "none": {}}  # fmt: skip
    assert fmt.json_text(body, fmt.BODY_JSON).encode() == JSONResponse(body).body
    assert fmt.sse(body, sliced=True) == fmt.sse(body)


# -- a real server --------------------------------------------------------------------------


@contextlib.contextmanager
def counting(runtime: Runtime) -> Iterator[dict[str, int]]:
    """Count the tokenizer's encode calls and the grammar compiler's compiles."""
    engine = runtime.require_engine()
    tokenizer, compiler = engine.tokenizer, engine.grammars()
    encode, compile_ = tokenizer.encode, compiler.compile
    calls = {"encode": 0, "compile": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kw)

        return wrapper

    tokenizer.encode = counted("encode", encode)  # type: ignore[method-assign]
    compiler.compile = counted("compile", compile_)  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del tokenizer.encode, compiler.compile


def test_over_its_rate_limit_a_tenant_is_refused_before_tokenizing_or_compiling(
    tiny_llama_dir: Path,
) -> None:
    settings = server_settings(tiny_llama_dir, {}, requests_per_minute=2, tokens_per_minute=50)
    huge = "many words " * 200_000  # 2.2 MB: estimated far over what the tenant has left
    with start_server(settings) as (url, runtime), counting(runtime) as calls:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        client.completions.create(model="tiny-llama", prompt="hello", max_tokens=1)
        assert calls == {"encode": 1, "compile": 0}
        bad = {"model": "tiny-llama", "prompt": huge, "stop": [str(i) for i in range(17)]}
        r = httpx.post(url + "/v1/completions", json=bad, headers=AUTH)
        assert r.status_code == 400 and "stop" in r.text  # a bad parameter: before any work
        with pytest.raises(openai.RateLimitError, match="50 tokens per minute"):
            client.completions.create(model="tiny-llama", prompt=huge, max_tokens=1)
        assert calls == {"encode": 1, "compile": 0}  # refused on its estimate, not tokenized
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=1)  # 2 of 2
        r = httpx.post(url + "/v1/completions", json=schema_body("fresh"), headers=AUTH)
        assert r.status_code == 429 and "2 requests" in r.text, r.text
        assert calls == {"encode": 2, "compile": 0}  # a new schema, refused uncompiled
        assert runtime.queue.in_flight() == 0


def test_the_queue_place_is_given_back_on_every_failure_after_the_lease(
    tiny_llama_dir: Path,
) -> None:
    settings = server_settings(tiny_llama_dir, {}, max_queued_requests_per_tenant=1)
    with start_server(settings) as (url, runtime):
        engine = runtime.require_engine()
        bad = [
            ({"model": "tiny-llama", "prompt": [10**6]}, "token ids must be in"),
            ({"model": "tiny-llama", "prompt": "x " * 400}, "maximum context length"),
            ({"model": "tiny-llama", "prompt": "x", "structured_outputs": {"regex": "(a"}},
             "invalid regex"),
        ]  # fmt: skip
        for body, message in bad:
            r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
            assert r.status_code == 400 and message in r.text, r.text
            assert runtime.queue.in_flight() == 0
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
        template = engine.tokenizer._template
        engine.tokenizer._template = None  # no chat template: a template error, after the lease
        try:
            r = httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=30)
        finally:
            engine.tokenizer._template = template
        assert r.status_code == 400 and "chat template" in r.text
        assert runtime.queue.in_flight() == 0
        # a client that goes away while its prompt waits for (and sits in) a tokenizer worker
        gate = threading.Event()
        encode = engine.tokenizer.encode
        engine.tokenizer.encode = lambda *a, **k: (gate.wait(5), encode(*a, **k))[1]  # type: ignore[method-assign]
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x"},
                           headers=AUTH, timeout=0.3)  # fmt: skip
            deadline = time.monotonic() + 5
            while runtime.queue.in_flight() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert runtime.queue.in_flight() == 0  # given back before the tokenizer returns
        finally:
            gate.set()
            del engine.tokenizer.encode
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x",
                       "max_tokens": 1}, headers=AUTH, timeout=30)  # fmt: skip
        assert r.status_code == 200  # the tenant's one place is free again


def test_a_tenant_waiting_behind_another_tenants_slow_prompts_is_tokenized_next(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Tenant A's prompts each hold a tokenizer worker until the test lets one go; B's prompt,
    sent after A's six, is tokenized by the first worker that frees (third), and answered while
    A's backlog still holds the other worker, not after it (seventh)."""
    with controlplane(tmp_path) as cp:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        pool = {"name": "pool-a", "base_model": {"name": "tiny-base", "uri": str(tiny_llama_dir)}}
        assert httpx.post(cp + "/v1/pools", json=pool, headers=admin).status_code == 201
        keys = {}
        for tenant in ("acme", "globex"):
            assert httpx.post(cp + "/v1/tenants", json={"name": tenant},
                              headers=admin).status_code == 201  # fmt: skip
            r = httpx.post(cp + f"/v1/tenants/{tenant}/keys", json={"name": "k"}, headers=admin)
            keys[tenant] = r.json()["key"]
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name="tiny-base", controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool="pool-a",
            num_kv_blocks=128, tokenize_workers=2,
        )  # fmt: skip
        with start_server(settings) as (url, runtime):
            tokenizer = runtime.require_engine().tokenizer
            encode, starts, lock = tokenizer.encode, [], threading.Lock()
            gate = threading.Semaphore(0)  # one release lets one of A's prompts finish

            def slow_encode(text: str, *args: Any, **kw: Any) -> list[int]:
                with lock:
                    starts.append(text.split()[0])
                if text.startswith("slow"):
                    assert gate.acquire(timeout=120), "the test never let this prompt go"
                return encode(text, *args, **kw)

            tokenizer.encode = slow_encode  # type: ignore[method-assign]

            async def until(what: str, done: Callable[[], bool]) -> None:
                deadline = time.monotonic() + 60
                while not done():
                    assert time.monotonic() < deadline, f"gave up waiting for {what}"
                    await asyncio.sleep(0.01)

            async def scenario() -> None:
                async with httpx.AsyncClient(base_url=url + "/v1", timeout=60) as client:

                    def send(tenant: str, prompt: str) -> Any:
                        body = {"model": "tiny-base", "prompt": prompt, "max_tokens": 1}
                        headers = {"Authorization": f"Bearer {keys[tenant]}"}
                        return asyncio.ensure_future(client.post("/completions", json=body,
                                                                  headers=headers))  # fmt: skip

                    for tenant in keys:  # both keys resolved (and cached) before the race
                        assert (await send(tenant, "warm up")).status_code == 200
                    a = [send("acme", f"slow {i}") for i in range(6)]
                    # both workers hold one of A's prompts, the other four wait
                    await until("A's backlog", lambda: runtime.tokenizing.waiting("acme") == 4)
                    b = send("globex", "quick")
                    await until("B's prompt", lambda: runtime.tokenizing.waiting("globex") == 1)
                    gate.release()  # one worker frees; the other still holds A's prompt
                    assert (await asyncio.wait_for(b, 30)).status_code == 200
                    for _ in range(5):
                        gate.release()
                    assert all(r.status_code == 200 for r in await asyncio.gather(*a))

            try:
                asyncio.run(scenario())
            finally:
                for _ in range(6):
                    gate.release()  # no worker stays blocked if the scenario failed
                del tokenizer.encode
    order = [s for s in starts if s in ("slow", "quick")]
    assert order.index("quick") == 2, order


def test_cached_tokens_are_0_on_a_fresh_prompt_and_counted_on_its_repeat(server: Running) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)
    rng = random.Random(time.time_ns())
    prompt = [rng.randrange(3, 300) for _ in range(80)]  # five blocks of 16, never sent before
    greedy: dict[str, Any] = {"model": "ad01", "max_tokens": 2, "temperature": 0}
    fresh = client.completions.create(prompt=prompt, **greedy)
    assert fresh.usage is not None and fresh.usage.prompt_tokens_details is not None
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(prompt=prompt, **greedy)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached <= again.usage.prompt_tokens == 80
    # two choices: the prompt is reported once, as its tokens are
    both = client.completions.create(prompt=prompt, n=2, **greedy)
    assert both.usage is not None and both.usage.prompt_tokens_details is not None
    assert both.usage.prompt_tokens == 80
    assert both.usage.prompt_tokens_details.cached_tokens == cached
    # the stream's usage chunk has it too
    stream = client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached
    # and a chat's answer: its rendered prompt, cached on the repeat
    words = " ".join("".join(rng.choices("abcdefgh", k=5)) for _ in range(20))
    chat: dict[str, Any] = {"model": "ad01", "max_tokens": 2, "temperature": 0,
                            "messages": [{"role": "user", "content": words}]}  # fmt: skip
    first, second = (client.chat.completions.create(**chat) for _ in range(2))
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0
