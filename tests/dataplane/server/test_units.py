"""Unit tests: rate limiter, settings, CLI flags, and the catalog-mode clients (resolve with a
TTL cache, pressure reports) against a small FastAPI app standing in for the control plane.
The end-to-end tests against the real control plane are in tests/test_e2e_catalog.py."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Header, HTTPException, Request

from loraplane.dataplane.server.catalog import StaticCatalog
from loraplane.dataplane.server.catalog_http import CatalogDown, HttpCatalog
from loraplane.dataplane.server.cli import add_commands
from loraplane.dataplane.server.errors import (
    APIError,
    ModelNotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
    UpstreamError,
)
from loraplane.dataplane.server.limits import RateLimiter
from loraplane.dataplane.server.pressure import PressureReporter, UsageLog
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings, SettingsError
from loraplane.dataplane.snapshot import EngineSnapshot


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_answer_429_with_retry_after_then_refill() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    for _ in range(3):
        limiter.admit("t", requests_per_minute=3, tokens_per_minute=0, prompt_tokens=5)
    with pytest.raises(RateLimited) as e:
        limiter.admit("t", requests_per_minute=3, tokens_per_minute=0, prompt_tokens=5)
    assert e.value.status == 429 and e.value.retry_after == pytest.approx(20.0)
    limiter.admit("other", requests_per_minute=3, tokens_per_minute=0, prompt_tokens=5)
    clock.now = 20.0
    limiter.admit("t", requests_per_minute=3, tokens_per_minute=0, prompt_tokens=5)


def test_generated_tokens_count_against_tokens_per_minute() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limiter.admit("t", requests_per_minute=0, tokens_per_minute=600, prompt_tokens=100)
    limiter.charge("t", tokens_per_minute=600, tokens=600)  # now 100 below zero
    with pytest.raises(RateLimited) as e:
        limiter.admit("t", requests_per_minute=0, tokens_per_minute=600, prompt_tokens=10)
    assert e.value.retry_after == pytest.approx(11.0)  # 110 tokens at 10 per second
    clock.now = 11.0
    limiter.admit("t", requests_per_minute=0, tokens_per_minute=600, prompt_tokens=10)


def test_settings_come_from_env_and_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_MODEL", "/models/m")
    monkeypatch.setenv("LORAPLANE_LORA_MODULES", "a=/x,b=/y")
    monkeypatch.setenv("LORAPLANE_MAX_LORAS", "4")
    s = ServerSettings.load(max_loras=None, port=9000)
    assert s.lora_modules == {"a": "/x", "b": "/y"}
    assert (s.max_loras, s.port, s.device, s.effective_dtype) == (4, 9000, "cpu", "float32")
    assert ServerSettings.load(device="cuda").effective_dtype == "bfloat16"
    monkeypatch.setenv("LORAPLANE_MAX_LORAS", "zero")
    with pytest.raises(SettingsError, match="LORAPLANE_MAX_LORAS"):
        ServerSettings.load()


def test_kv_cache_dtype_flag_and_env_reach_the_engine_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "/m", "--kv-cache-dtype", "fp8"])
    assert ServerSettings.load(model="/m", kv_cache_dtype=args.kv_cache_dtype).engine_config(
    ).kv_cache_dtype == "fp8"  # fmt: skip
    assert ServerSettings.load(model="/m").engine_config().kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int8"])
    monkeypatch.setenv("LORAPLANE_KV_CACHE_DTYPE", "fp16")
    with pytest.raises(SettingsError, match="LORAPLANE_KV_CACHE_DTYPE"):
        ServerSettings.load(model="/m")


def test_serve_has_design_section_9_flags() -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--model", "m", "--served-model-name", "n", "--lora-modules", "a=/x", "b=/y",
         "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
         "--max-num-seqs", "8", "--dtype", "float32", "--device", "cpu", "--host", "0.0.0.0",
         "--port", "8001", "--controlplane-url", "http://cp", "--api-key", "k",
         "--admin-token", "t"]
    )  # fmt: skip
    assert args.lora_modules == ["a=/x", "b=/y"] and args.port == 8001 and args.func


def test_static_catalog_pins_and_keys() -> None:
    catalog = StaticCatalog("base", api_key="k")
    catalog.add("a", "0123456789abcdef" * 4)
    found = asyncio.run(catalog.resolve("k", "a@01234567"))
    assert (found.tenant, found.adapter, found.version) == ("default", "a", "1")
    for model in ("a@0123", "a@2", "b"):
        with pytest.raises(ModelNotFound):
            asyncio.run(catalog.resolve("k", model))
    with pytest.raises(Unauthorized):
        asyncio.run(catalog.resolve("wrong", "base"))


def stand_in() -> tuple[FastAPI, dict[str, Any]]:
    """A tiny control plane: one tenant key, one adapter; counts calls; records reports."""
    app = FastAPI()
    state: dict[str, Any] = {"calls": Counter(), "keys": {"lp_good"}, "reports": []}

    @app.get("/internal/v1/resolve")
    def resolve(
        model: str, x_tenant_key: str = Header(), authorization: str = Header()
    ) -> dict[str, Any]:
        state["calls"][model] += 1
        if authorization != "Bearer svc":
            raise HTTPException(401)
        if x_tenant_key not in state["keys"]:
            raise HTTPException(401)
        if model != "bot":
            raise HTTPException(404)
        return {"tenant": "acme", "base_model": "base", "adapter": "bot", "version": 3,
                "digest": "ab" * 32, "path": "adapters/acme/bot/v3-abababababab", "rank": 8,
                "alpha": 16.0, "requests_per_minute": 60, "tokens_per_minute": 0}  # fmt: skip

    @app.post("/internal/v1/pressure")
    async def pressure(request: Request) -> dict[str, Any]:
        state["reports"].append(await request.json())
        if state.get("refuse"):
            raise HTTPException(422)
        return {"namespace": "default", "pool": "p", "replica": "r", "usage_rows": 0,
                "usage_skipped": 0, "replicas": state.get("replicas", 1),
                "base_model_config_known": state.get("known", True)}  # fmt: skip

    return app, state


def test_http_catalog_resolves_and_caches_for_its_ttl() -> None:
    app, state = stand_in()
    clock = Clock()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    catalog = HttpCatalog("http://cp", "svc", "base", ttl=5.0, client=client, clock=clock)

    async def run() -> None:
        found = await catalog.resolve("lp_good", "bot")
        assert (found.tenant, found.adapter, found.version, found.rank) == ("acme", "bot", "3", 8)
        assert found.requests_per_minute == 60
        await catalog.resolve("lp_good", "bot")
        assert state["calls"]["bot"] == 1  # cached
        with pytest.raises(ModelNotFound):
            await catalog.resolve("lp_good", "other")
        state["keys"].clear()  # the key is revoked
        await catalog.resolve("lp_good", "bot")  # still cached
        clock.now = 5.1
        with pytest.raises(Unauthorized):
            await catalog.resolve("lp_good", "bot")  # stops working within the TTL
        await catalog.aclose()

    asyncio.run(run())


def test_http_catalog_serves_known_tenants_through_an_outage_and_revocation_wins_after() -> None:
    app, state = stand_in()
    clock = Clock()
    down = {"how": ""}
    asgi = httpx.ASGITransport(app=app)

    async def handler(request: httpx.Request) -> httpx.Response:
        if down["how"] == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if down["how"] == "500":
            return httpx.Response(500, json={"detail": "database gone"})
        return await asgi.handle_async_request(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    catalog = HttpCatalog(
        "http://cp", "svc", "base", ttl=5.0, client=client, clock=clock, stale=300.0
    )

    async def run() -> None:
        assert (await catalog.resolve("lp_good", "bot")).tenant == "acme"
        state["keys"].add("lp_other")
        for how in ("refused", "500"):
            down["how"] = how
            clock.now += 10.0  # past the TTL: the control plane is asked again, and is down
            calls = sum(state["calls"].values())
            found = await catalog.resolve("lp_good", "bot")  # known: its last good answer
            assert (found.tenant, found.adapter, found.version) == ("acme", "bot", "3")
            with pytest.raises(Unavailable) as info:  # never resolved: 503, retry later
                await catalog.resolve("lp_other", "bot")
            assert info.value.status == 503 and info.value.retry_after == 5.0
            assert sum(state["calls"].values()) == calls  # left alone after a failed call
        assert catalog.stale_answers == 2
        clock.now += 301.0  # the last good answer is too old to stand in any more
        with pytest.raises(Unavailable):
            await catalog.resolve("lp_good", "bot")
        down["how"] = ""  # back: answers are fresh again, and a revocation takes effect
        clock.now += 10.0
        assert (await catalog.resolve("lp_good", "bot")).tenant == "acme"
        state["keys"].discard("lp_good")
        clock.now += 10.0
        with pytest.raises(Unauthorized):
            await catalog.resolve("lp_good", "bot")
        down["how"] = "refused"  # a revoked key is not served from its old answer either
        clock.now += 10.0
        with pytest.raises(Unavailable):
            await catalog.resolve("lp_good", "bot")
        await catalog.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("status", "body", "raised", "answered"),
    [
        (401, {"error": {"code": "Unauthorized"}}, Unauthorized, 401),
        (404, {"error": {"code": "NotFound"}}, ModelNotFound, 404),
        (429, {"error": {"code": "RateLimited"}}, Unavailable, 503),
        (503, {"error": {"code": "DatabaseUnavailable"}}, CatalogDown, 503),
        (400, {"error": {"code": "InvalidRequest"}}, UpstreamError, 502),
        (200, "not json", UpstreamError, 502),
    ],
)
def test_catalog_answers_become_openai_errors(
    status: int, body: Any, raised: type[APIError], answered: int
) -> None:
    """The one mapping of the internal API's errors to the data plane's: only an unanswered
    call or a 5xx is CatalogDown (stale answers may serve); a busy control plane is not."""

    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    catalog = HttpCatalog("http://cp", "svc", "base", client=client)
    with pytest.raises(raised) as info:
        asyncio.run(catalog.resolve("lp_good", "bot"))
    assert type(info.value) is raised and info.value.status == answered
    if answered == 503:
        assert info.value.retry_after == 5.0


def test_a_report_without_answer_is_sent_again_as_the_same_batch() -> None:
    """No answer (the control plane may or may not have counted it): the same usage goes again
    under the same batch id; usage that came meanwhile waits for the next batch."""
    sent: list[dict[str, Any]] = []
    answer = {"how": "drop"}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if answer["how"] == "drop":
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, json={"replicas": 1, "base_model_config_known": True})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    usage = UsageLog()
    usage.add("acme", "bot", requests=1, prompt=5, completion=2)

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot()

    reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, usage, client=client,
                                base_model_config={"model_type": "llama"})  # fmt: skip

    async def run() -> None:
        assert not await reporter.report_once()
        assert reporter.reports_failed == 1 and reporter.base_model_config is not None
        usage.add("acme", "bot", requests=1, prompt=7, completion=3)  # arrives meanwhile
        answer["how"] = "ok"
        assert await reporter.report_once()  # the first batch again
        assert await reporter.report_once()  # then the new usage, in a batch of its own

    asyncio.run(run())
    first, again, then = sent
    assert again["usage_batch"] == first["usage_batch"] and again["usage"] == first["usage"]
    assert first["usage"] == [{"tenant": "acme", "adapter": "bot", "requests": 1,
                               "prompt_tokens": 5, "completion_tokens": 2}]  # fmt: skip
    assert then["usage_batch"] != first["usage_batch"]
    assert then["usage"][0]["prompt_tokens"] == 7
    assert usage.drain() == {}


def test_pressure_reporter_posts_the_snapshot_and_usage() -> None:
    app, state = stand_in()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    usage = UsageLog()
    usage.add("acme", "bot", requests=2, prompt=30, completion=12)
    snap = EngineSnapshot(
        deferred=3,
        waiting_adapters=["x"],
        running_adapters=["bot"],
        resident=Counter({("acme", "bot"): 1}),
        gpu_bytes_used=1024,
        gpu_bytes_capacity=4096,
        cpu_bytes_used=2048,
        kv_usage=0.25,
        waiting_per_adapter=Counter({("acme", "x"): 3}),
    )

    async def snapshot() -> EngineSnapshot:
        return snap

    async def run() -> None:
        reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, usage, client=client)
        assert await reporter.report_once()

    asyncio.run(run())
    (report,) = state["reports"]
    assert report["deferred"] == 3 and report["slots_used"] == 1 and report["kv_usage"] == 0.25
    assert (report["gpu_bytes"], report["gpu_bytes_capacity"]) == (1024, 4096)
    assert (report["cpu_bytes"], report["cpu_bytes_capacity"]) == (2048, None)  # no byte limit
    assert report["adapters_waiting"] == [{"tenant": "acme", "adapter": "x", "waiting_requests": 3}]
    assert report["usage"] == [{"tenant": "acme", "adapter": "bot", "requests": 2,
                                "prompt_tokens": 30, "completion_tokens": 12}]  # fmt: skip
    assert usage.drain() == {}
    # the body fits the control plane's schema (it forbids unknown fields)
    schemas = pytest.importorskip("loraplane.controlplane.schemas.internal")
    schemas.PressureReport.model_validate(report)


def test_reports_name_the_pools_namespace_and_carry_the_config_until_the_pool_has_it() -> None:
    app, state = stand_in()
    state["known"] = False
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    config = {"model_type": "llama", "hidden_size": 64}

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot()

    reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, UsageLog(), client=client,
                                namespace="team-b", base_model_config=config)  # fmt: skip

    async def run() -> None:
        assert await reporter.report_once()
        state["known"] = True  # the pool has a config now (this one, or an earlier replica's)
        assert await reporter.report_once()
        assert await reporter.report_once()

    asyncio.run(run())
    sent = [(r["namespace"], r["pool"], r.get("base_model_config")) for r in state["reports"]]
    assert sent == [("team-b", "p", config), ("team-b", "p", config), ("team-b", "p", None)]
    schemas = pytest.importorskip("loraplane.controlplane.schemas.internal")
    schemas.PressureReport.model_validate(state["reports"][0])


def test_a_config_the_control_plane_refuses_is_not_sent_again() -> None:
    app, state = stand_in()
    state["refuse"] = True
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    usage = UsageLog()
    usage.add("acme", None, requests=1, prompt=1, completion=1)

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot()

    reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, usage, client=client,
                                base_model_config={"model_type": "gpt2"})  # fmt: skip

    async def run() -> None:
        assert not await reporter.report_once()  # 422: the usage stays for the next report
        state["refuse"] = False
        assert await reporter.report_once()

    asyncio.run(run())
    first, second = state["reports"]
    assert first["namespace"] == "default" and "base_model_config" in first
    assert "base_model_config" not in second and second["usage"] == first["usage"]


def test_reports_carry_the_host_tiers_bytes_and_its_byte_limit() -> None:
    app, state = stand_in()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot(cpu_bytes_used=3000, cpu_bytes_limit=8192)

    reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, UsageLog(), client=client)
    assert asyncio.run(reporter.report_once())
    (report,) = state["reports"]
    assert (report["cpu_bytes"], report["cpu_bytes_capacity"]) == (3000, 8192)
    schemas = pytest.importorskip("loraplane.controlplane.schemas.internal")
    recorded = schemas.PressureReport.model_validate(report)
    assert (recorded.cpu_bytes, recorded.cpu_bytes_capacity) == (3000, 8192)


def test_a_control_plane_older_than_the_host_bytes_gets_reports_without_them() -> None:
    """A control plane from before the host tier's bytes refuses them (its schema forbids
    unknown fields: 400 naming the field); the usage of that report goes again in the next,
    which leaves them out, as do the ones after it."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        if "cpu_bytes" in body:
            message = "cpu_bytes: not a known field; cpu_bytes_capacity: not a known field"
            return httpx.Response(400, json={"error": {"code": "InvalidRequest",
                                                       "message": message}})  # fmt: skip
        return httpx.Response(200, json={"replicas": 1, "base_model_config_known": True})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    usage = UsageLog()
    usage.add("acme", "bot", requests=1, prompt=5, completion=2)

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot(cpu_bytes_used=3000)

    reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, usage, client=client)

    async def run() -> None:
        assert not await reporter.report_once()
        assert await reporter.report_once()
        assert await reporter.report_once()

    asyncio.run(run())
    first, second, third = sent
    assert "cpu_bytes" in first and "cpu_bytes" not in second and "cpu_bytes" not in third
    assert second["usage"] == first["usage"] and second["usage"][0]["prompt_tokens"] == 5


def test_the_pools_namespace_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_POOL_NAMESPACE", "team-b")
    assert ServerSettings.load(model="/m").pool_namespace == "team-b"
    monkeypatch.setenv("LORAPLANE_POOL_NAMESPACE", "Team_B")
    with pytest.raises(SettingsError, match="LORAPLANE_POOL_NAMESPACE"):
        ServerSettings.load(model="/m")
    monkeypatch.delenv("LORAPLANE_POOL_NAMESPACE")
    assert ServerSettings.load(model="/m").pool_namespace == "default"


def test_a_tenants_rate_limits_are_split_among_the_pools_live_replicas(tmp_path: Path) -> None:
    """The control plane answers each report with the pool's live replicas; each replica
    enforces its share of a tenant's per-minute limits, so the tenant's limit holds pool-wide."""
    app, state = stand_in()
    state["replicas"] = 3
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))

    async def snapshot() -> EngineSnapshot:
        return EngineSnapshot()

    reporter = PressureReporter("http://cp", "svc", "p", "r", snapshot, UsageLog(), client=client)
    runtime = Runtime(ServerSettings.load(model=str(tmp_path)))
    assert runtime.share(60) == 60  # alone (or standalone): the whole limit
    runtime._reporter = reporter
    assert asyncio.run(reporter.report_once())
    assert reporter.replicas == 3
    assert (runtime.share(60), runtime.share(10), runtime.share(0)) == (20, 4, 0)  # 0: unlimited


def test_serve_help_lists_every_setting_with_its_meaning() -> None:
    from loraplane.dataplane.server.settings import SETTINGS_HELP

    assert set(SETTINGS_HELP) == set(ServerSettings.model_fields)  # a new setting needs a line
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr, index]
    text = serve.format_help()
    for name in ServerSettings.model_fields:
        assert f"LORAPLANE_{name.upper()} " in text, name
    assert "LORAPLANE_RESOLVE_STALE_S (default: 300.0)" in text
