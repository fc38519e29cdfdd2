"""Two tenants on one replica over HTTP, in catalog mode against the real control plane: no
prefix-cache hit crosses tenants (the timing side channel), a flooding tenant gives a seat to
another at once, and the catalog's weight reaches the scheduler and the metrics port."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.dataplane import sequence
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import serve_metrics, start_server
from tests.test_e2e_catalog import controlplane

POOL, BASE = "pool-a", "tiny-base"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


@dataclass
class Replica:
    cp: str
    url: str
    metrics_url: str
    runtime: Runtime
    keys: dict[str, str]

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.keys[tenant], max_retries=0)

    def series(self, family: str) -> dict[str, float]:
        text = httpx.get(self.metrics_url + "/metrics", timeout=30).text
        for f in text_string_to_metric_families(text):
            if f.name == family:
                return {s.labels["tenant"]: s.value for s in f.samples if "tenant" in s.labels}
        return {}


@contextlib.contextmanager
def replica(
    model: Path, tmp: Path, weights: dict[str, float], **settings: object
) -> Iterator[Replica]:
    """The control plane with one tenant per `weights` entry (and a key each), and a data plane
    in catalog mode with `settings`."""
    with controlplane(tmp) as cp:
        pool = {"name": POOL, "base_model": {"name": BASE, "uri": str(model)}}
        assert httpx.post(cp + "/v1/pools", json=pool, headers=ADMIN_H).status_code == 201
        keys = {}
        for tenant, weight in weights.items():
            body = {"name": tenant, "weight": weight}
            assert httpx.post(cp + "/v1/tenants", json=body, headers=ADMIN_H).status_code == 201
            r = httpx.post(cp + f"/v1/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN_H)
            keys[tenant] = r.json()["key"]
        config = ServerSettings(
            model=str(model), served_model_name=BASE, controlplane_url=cp, service_token=SERVICE,
            store=str(tmp / "store"), pool=POOL, num_kv_blocks=256, **settings,  # type: ignore[arg-type]
        )  # fmt: skip
        with start_server(config) as (url, runtime), serve_metrics(runtime) as metrics_url:
            yield Replica(cp, url, metrics_url, runtime, keys)


def cached(client: openai.OpenAI, prompt: list[int]) -> int:
    out = client.completions.create(model=BASE, prompt=prompt, max_tokens=1, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0


def test_a_base_model_prompt_another_tenant_sent_is_no_cache_hit_but_ones_own_repeat_is(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The side channel, as a tenant would probe it: `cached_tokens` (and so its time to first
    token) on a prompt another tenant just sent. The negative control shares one base salt
    across tenants, as the code before did, and the same probe sees the other tenant's blocks."""
    rng = random.Random(time.time_ns())
    # the negative control patches the engine's classes: the engine on a thread of this process
    with replica(tiny_llama_dir, tmp_path, {"acme": 1, "globex": 1}, engine_process=False) as r:
        a, b = r.client("acme"), r.client("globex")
        sent = [rng.randrange(3, 300) for _ in range(96)]  # six blocks of 16
        assert cached(a, sent) == 0
        assert cached(b, sent) == 0  # acme's blocks are not globex's
        assert cached(a, sent) >= 80  # acme's own repeat hits its cache
        shared = property(lambda s: sequence.BASE_SALT if s.lora is None else s.lora.salt)
        monkeypatch.setattr(sequence.Sequence, "cache_salt", shared)
        probe = [rng.randrange(3, 300) for _ in range(96)]
        assert cached(a, probe) == 0
        assert cached(b, probe) >= 80  # what the salt per tenant prevents


def test_a_flooding_tenant_gives_a_seat_to_another_at_once_and_weights_reach_the_metrics(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """acme (weight 2.5) fills every seat (4) with long streams; globex's short request runs to
    the end while acme's streams still run, and is never preempted; acme gave a seat."""
    with replica(tiny_llama_dir, tmp_path, {"acme": 2.5, "globex": 1}, max_num_seqs=4) as r:

        async def scenario() -> tuple[float, list[bool]]:
            async with httpx.AsyncClient(base_url=r.url + "/v1", timeout=120) as http:

                def send(tenant: str, tokens: int) -> asyncio.Future[httpx.Response]:
                    body = {"model": BASE, "prompt": [5, 6, 7, 8], "max_tokens": tokens,
                            "temperature": 0, "ignore_eos": True}  # fmt: skip
                    headers = {"Authorization": f"Bearer {r.keys[tenant]}"}
                    return asyncio.ensure_future(
                        http.post("/completions", json=body, headers=headers)
                    )

                for tenant in r.keys:  # resolved (and cached) before the race
                    assert (await send(tenant, 1)).status_code == 200
                flood = [send("acme", 240) for _ in range(6)]  # the context is 256
                deadline = time.monotonic() + 30
                while r.series("loraplane_tenant_running_requests").get("acme", 0) < 4:
                    assert time.monotonic() < deadline and not any(f.done() for f in flood)
                    await asyncio.sleep(0.02)
                start = time.perf_counter()
                answer = await send("globex", 4)
                took = time.perf_counter() - start
                assert answer.status_code == 200
                still = [not f.done() for f in flood]
                for f in flood:
                    f.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
                return took, still

        took, still = asyncio.run(scenario())
        assert all(still)  # globex did not wait for acme's streams to end
        preempted = r.series("loraplane_tenant_preemptions")
        assert preempted.get("globex", 0) == 0 and preempted.get("acme", 0) >= 1
        assert r.series("loraplane_tenant_weight") == {"acme": 2.5, "globex": 1.0}
        assert took < 30  # a few steps, not acme's 240-token streams
