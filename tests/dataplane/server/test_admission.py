"""Bounded work at the door: queue caps (429 with Retry-After), too many prompts (400), too
large a body (413), each counted in loraplane_requests_refused_total{reason}; idle tenants'
rate-limit buckets are forgotten."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from loraplane.dataplane.server.admission import QueueFull, QueueLimits
from loraplane.dataplane.server.errors import InvalidRequest
from loraplane.dataplane.server.limits import RateLimiter
from loraplane.ratelimit import PRUNE_EVERY
from tests.dataplane.server.conftest import API_KEY, serve_metrics, server_settings, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def refused_counter() -> PromCounter:
    return PromCounter("refused", "r", ["reason"], registry=CollectorRegistry())


def test_queue_limits_cap_each_tenant_and_the_replica_and_forget_idle_tenants() -> None:
    refused = refused_counter()
    queue = QueueLimits(total=5, per_tenant=3, refused=refused)
    queue.enter("a", 3)
    with pytest.raises(QueueFull, match="tenant 'a' has 3 requests in flight"):
        queue.enter("a", 1)
    queue.enter("b", 2)  # another tenant still gets in: a's backlog is its own
    with pytest.raises(QueueFull, match="this replica has 5 requests in flight"):
        queue.enter("c", 1)
    with pytest.raises(InvalidRequest, match="at most 3 fit"):
        queue.enter("c", 4)  # could never fit: 400, not 429
    queue.leave("a", 3)
    queue.enter("c", 1)
    assert (queue.in_flight("a"), queue.in_flight(), len(queue._by_tenant)) == (0, 3, 2)
    samples = refused.collect()[0].samples
    counts = {s.labels["reason"]: s.value for s in samples if s.name.endswith("_total")}
    assert counts == {"tenant_queue_full": 1.0, "queue_full": 1.0, "too_many_prompts": 1.0}


def test_rate_limit_buckets_of_idle_tenants_are_forgotten() -> None:
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    for i in range(PRUNE_EVERY - 1):
        limiter.admit(f"t{i}", requests_per_minute=60, tokens_per_minute=0, prompt_tokens=1)
    assert len(limiter._requests) == PRUNE_EVERY - 1
    now[0] = 120.0  # every bucket has refilled
    limiter.admit("late", requests_per_minute=60, tokens_per_minute=0, prompt_tokens=1)
    assert len(limiter._requests) == 1


def test_over_the_caps_the_server_answers_429_400_and_413_and_counts_them(
    tiny_llama_dir: Path, adapter_names: dict[str, Path]
) -> None:
    settings = server_settings(
        tiny_llama_dir,
        dict(list(adapter_names.items())[:2]),
        max_queued_requests_per_tenant=2,
        max_prompts_per_request=3,
        max_request_bytes=4096,
    )
    with start_server(settings) as (url, runtime):

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
                long = {"model": "ad00", "prompt": [5, 6, 7], "max_tokens": 200,
                        "ignore_eos": True}  # fmt: skip
                holders = [asyncio.create_task(client.post("/v1/completions", json=long))
                           for _ in range(2)]  # fmt: skip
                deadline = time.monotonic() + 60
                while runtime.queue.in_flight() < 2:
                    assert not any(h.done() for h in holders), "a holder ended before the test"
                    assert time.monotonic() < deadline, "the two never were in flight at once"
                    await asyncio.sleep(0.01)
                third = await client.post("/v1/completions", json={**long, "max_tokens": 2})
                held = await asyncio.gather(*holders)
                after = await client.post("/v1/completions", json={**long, "max_tokens": 2})
                return [third, *held, after]

        third, first, second, after = asyncio.run(scenario())
        assert third.status_code == 429 and third.headers["Retry-After"] == "1"
        assert third.json()["error"]["code"] == "queue_full"
        assert (first.status_code, second.status_code, after.status_code) == (200, 200, 200)
        assert runtime.queue.in_flight() == 0  # every place was given back

        many = httpx.post(url + "/v1/completions", headers=AUTH, json={
            "model": "ad00", "prompt": ["a", "b", "c", "d"], "max_tokens": 1})  # fmt: skip
        assert many.status_code == 400 and "4 prompts in one request; at most 3" in many.text
        big = {"model": "ad00", "prompt": "x" * 5000, "max_tokens": 1}
        sized = httpx.post(url + "/v1/completions", headers=AUTH, json=big)
        assert sized.status_code == 413 and sized.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the body is counted as it arrives
            payload = json.dumps(big).encode()
            for i in range(0, len(payload), 1000):
                yield payload[i : i + 1000]

        streamed = httpx.post(url + "/v1/completions", headers=AUTH, content=chunks())
        assert streamed.status_code == 413
        ok = httpx.post(url + "/v1/completions", headers=AUTH,
                        json={"model": "ad00", "prompt": "hi", "max_tokens": 1})  # fmt: skip
        assert ok.status_code == 200
        with serve_metrics(runtime) as metrics_url:  # refusals are counted on the metrics port
            metrics = httpx.get(metrics_url + "/metrics").text
        for reason, count in (("tenant_queue_full", 1), ("too_many_prompts", 1),
                              ("body_too_large", 2), ("queue_full", 0)):  # fmt: skip
            assert f'loraplane_requests_refused_total{{reason="{reason}"}} {count}.0' in metrics
