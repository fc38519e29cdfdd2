"""An adapter unloaded in catalog mode under traffic, against the real control plane: new
requests for it are refused at once (404 `model_unloading`, naming it) while the running ones
finish normally, the unload answers once they have, the adapter leaves every tier, and other
adapters are served throughout. An unload whose requests outlast LORAPLANE_UNLOAD_TIMEOUT_S is
given up (503 `unload_timeout`) and the adapter served as before."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import SERVICE
from tests.dataplane.server.conftest import serve_metrics, start_server
from tests.test_e2e_catalog import BASE_NAME, POOL, controlplane, pool_and_tenants

ADMIN_TOKEN = "admin-unload-token"
STREAM_TOKENS = 240  # the context is 256: long enough to be running when the unload comes


@dataclass
class Replica:
    url: str
    metrics_url: str
    runtime: Runtime
    keys: dict[str, str]

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def resident(self, tenant: str, adapter: str) -> list[str]:
        """The tiers (gpu, cpu) holding the adapter, from the metrics port."""
        text = httpx.get(self.metrics_url + "/metrics", timeout=30).text
        return sorted(
            line.split('tier="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("loraplane_adapter_resident{")
            and f'tenant="{tenant}"' in line
            and f'adapter="{adapter}"' in line
        )


def upload(cp: str, key: str, name: str, folder: Path) -> None:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    r = httpx.post(cp + "/v1/adapters", data={"name": name, "base_model": BASE_NAME},
                   files=files, headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 201, r.text


@pytest.fixture(scope="module")
def replica(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replica]:
    """acme's adapter `support` and globex's `other`, served by a catalog-mode replica."""
    tmp = tmp_path_factory.mktemp("catalog-unload")
    with controlplane(tmp) as cp:
        keys = pool_and_tenants(cp, tiny_llama_dir)
        upload(cp, keys["acme"], "support", peft_adapters["r16"])
        upload(cp, keys["globex"], "other", peft_adapters["r4"])
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp / "store"), pool=POOL, num_kv_blocks=256,
            max_loras=4, admin_token=ADMIN_TOKEN, metrics_port=0, gateway_metrics_port=0,
        )  # fmt: skip
        with start_server(settings) as (url, runtime), serve_metrics(runtime) as metrics_url:
            yield Replica(url, metrics_url, runtime, keys)


def body(model: str, tokens: int, stream: bool = False) -> dict[str, object]:
    payload = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": tokens, "temperature": 0,
               "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


@contextlib.asynccontextmanager
async def streaming(
    http: httpx.AsyncClient, payload: dict[str, object], headers: dict[str, str]
) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    """A completions stream, open once its first chunk has arrived: its chunks."""
    async with http.stream("POST", "/completions", json=payload, headers=headers) as r:
        assert r.status_code == 200, await r.aread()

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])

        it = chunks()
        await anext(it)
        yield it


async def finish(chunks: AsyncIterator[dict[str, Any]]) -> tuple[str | None, int]:
    """The rest of a stream: its finish_reason and its completion tokens (the usage chunk)."""
    reason, tokens = None, 0
    async for chunk in chunks:
        for choice in chunk.get("choices") or []:
            reason = choice.get("finish_reason") or reason
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return reason, tokens


async def unload(http: httpx.AsyncClient, name: str) -> httpx.Response:
    return await http.post("/unload_lora_adapter", json={"lora_name": name},
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})  # fmt: skip


def test_an_unload_under_traffic_refuses_new_requests_at_once_and_drains_the_running_ones(
    replica: Replica,
) -> None:
    acme, globex = replica.auth("acme"), replica.auth("globex")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=replica.url + "/v1", timeout=120) as http:
            for model, auth in (("support", acme), ("other", globex)):  # loaded before the race
                assert (
                    await http.post("/completions", json=body(model, 2), headers=auth)
                ).is_success
            assert replica.resident("acme", "support") == ["cpu", "gpu"]
            async with contextlib.AsyncExitStack() as open_streams:
                running = [
                    await open_streams.enter_async_context(
                        streaming(http, body("support", STREAM_TOKENS, True), acme)
                    )
                    for _ in range(3)
                ]
                neighbour = await open_streams.enter_async_context(
                    streaming(http, body("other", STREAM_TOKENS, True), globex)
                )
                began = time.monotonic()
                unloading = asyncio.ensure_future(unload(http, "acme/support"))
                # (2) once the unload has begun, a new request for the adapter is refused at once
                while True:
                    sent = time.perf_counter()
                    probe = await http.post("/completions", json=body("support", 1), headers=acme)
                    took = time.perf_counter() - sent
                    if probe.status_code != 200:  # 200: sent before the unload began
                        break
                    assert time.monotonic() - began < 10, "the unload never began"
                assert probe.status_code == 404, probe.text
                error = probe.json()["error"]
                assert error["code"] == "model_unloading" and "`support`" in error["message"]
                assert "unloaded" in error["message"] and error["param"] == "model"
                assert took < 5.0  # refused at the door, not after the streams' end
                assert not unloading.done()  # the running streams hold it
                # (4) another tenant's adapter is served meanwhile
                other = await http.post("/completions", json=body("other", 8), headers=globex)
                assert other.status_code == 200, other.text
                assert other.json()["choices"][0]["finish_reason"] == "length"
                assert other.json()["usage"]["completion_tokens"] == 8
                assert not unloading.done()
                # (1) the running requests run to their end
                for chunks in running:
                    assert await finish(chunks) == ("length", STREAM_TOKENS)
                assert await finish(neighbour) == ("length", STREAM_TOKENS)
            # (3) the unload answers once they have, in bounded time, and the adapter is gone
            answer = await asyncio.wait_for(unloading, 30)
            assert answer.status_code == 200, answer.text
            assert replica.resident("acme", "support") == []  # no device slot, no host copy
            assert replica.resident("globex", "other") == ["cpu", "gpu"]
            # catalog adapters load on first use: the next request registers it again
            again = await http.post("/completions", json=body("support", 4), headers=acme)
            assert again.status_code == 200, again.text
            assert (await unload(http, "acme/nothing")).status_code == 404

    asyncio.run(scenario())


def test_an_unload_that_outlasts_its_timeout_is_given_up_and_the_adapter_served_as_before(
    replica: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = replica.runtime
    monkeypatch.setattr(
        runtime, "settings", runtime.settings.model_copy(update={"unload_timeout_s": 0.05})
    )
    acme = replica.auth("acme")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=replica.url + "/v1", timeout=120) as http:
            assert (
                await http.post("/completions", json=body("support", 2), headers=acme)
            ).is_success
            async with streaming(http, body("support", STREAM_TOKENS, True), acme) as chunks:
                answer = await unload(http, "acme/support")
                assert answer.status_code == 503, answer.text
                error = answer.json()["error"]
                assert error["code"] == "unload_timeout" and "acme/support" in error["message"]
                assert "1 running request" in error["message"]
                assert answer.headers["Retry-After"] == "1"
                served = await http.post("/completions", json=body("support", 2), headers=acme)
                assert served.status_code == 200, served.text  # served as before
                assert await finish(chunks) == ("length", STREAM_TOKENS)
            assert replica.resident("acme", "support") == ["cpu", "gpu"]

    asyncio.run(scenario())
