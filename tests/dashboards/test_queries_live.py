"""Every dashboard query returns data from live components: Debian's Prometheus (1 s scrapes, a
temporary TSDB, 127.0.0.1 only) scrapes a data plane in catalog mode, the control plane, and the
operator (Kopf, on kmock's emulated Kubernetes API, running the ServingPool the data plane
reports for) while the openai client sends a short, bounded load over several tenants'
adapters; each panel's PromQL is then evaluated through Prometheus's HTTP API.

Prometheus scrapes what the chart's monitors scrape: the data plane's metrics port (the API
port's /metrics has vLLM's protocol gauges only) and the control plane's internal port (its
public port does not serve /metrics)."""

from __future__ import annotations

import contextlib
import math
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kubernetes import client

from loraplane.adapters.store import LocalStore
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.operator.context import OperatorContext
from loraplane.operator.settings import OperatorSettings
from loraplane.operator.specs import GROUP, POOLS, VERSION
from tests.controlplane.conftest import SERVICE
from tests.dashboards.dashboards import queries, substitute, variable_queries
from tests.dataplane.server.conftest import serve_metrics, start_server
from tests.operator.conftest import PLATFORM, pool_body
from tests.operator.emulator import running_emulator
from tests.operator.harness import OperatorThread
from tests.prometheus import MISSING, PROMETHEUS, instant, running_prometheus
from tests.servers import free_port
from tests.test_e2e_catalog import admin, split_controlplane

POOL, BASE = "pool-a", "tiny-base"
# tenant -> its adapters (fixture adapter names); more adapters than max_loras, so requests are
# deferred and device-pool slots are evicted and reloaded under the load
TENANTS = {"acme": ["r4", "r8-qv", "r16"], "globex": ["r16-rslora", "r8-layer1"]}
MAX_LORAS = 2
# The load runs until the queries have been evaluated (rates and quantiles need requests in
# their 15 s window), paced and capped in count and time.
MAX_REQUESTS, MAX_LOAD_SECONDS, WORKERS, PAUSE_SECONDS = 200, 45.0, 4, 0.4
SCRAPED_SECONDS = 8  # rate() over 15 s needs a few samples


@contextlib.contextmanager
def prometheus(tmp: Path, dataplane: str, controlplane: str, operator: str) -> Iterator[str]:
    """Prometheus on a free 127.0.0.1 port scraping the three components every second."""
    scrape_configs = [
        # `pool` is what the chart's PodMonitor relabels from the pod's pool label
        {
            "job_name": "dataplane",
            "static_configs": [{"targets": [dataplane], "labels": {"pool": POOL}}],
        },
        {"job_name": "controlplane", "static_configs": [{"targets": [controlplane]}]},
        {"job_name": "operator", "static_configs": [{"targets": [operator]}]},
    ]
    with running_prometheus(tmp, scrape_configs) as url:
        yield url


@dataclass
class Load:
    """A bounded load in background threads: completions and streamed chats over every
    tenant's adapters and the base model, plus a few requests with unknown keys or models."""

    url: str
    keys: dict[str, str]
    stop: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _next(self) -> int | None:
        with self.lock:
            if self.stop.is_set() or self.sent >= MAX_REQUESTS:
                return None
            self.sent += 1
            return self.sent

    def _one(self, n: int, plan: list[tuple[str, str]]) -> None:
        tenant, model = plan[n % len(plan)]
        key = self.keys[tenant]
        expected: type[Exception] | None = None
        if n % 13 == 0:  # an unknown key: the control plane answers the resolve with 401
            key, expected = f"lp_unknown{n:04d}", openai.AuthenticationError
        elif n % 17 == 0:  # an unknown model: 404
            model, expected = "no-such-adapter", openai.NotFoundError
        client = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)
        try:
            if n % 2:
                client.completions.create(
                    model=model, prompt=f"request {n} of a short load", max_tokens=6,
                    temperature=0, extra_body={"ignore_eos": True},
                )  # fmt: skip
            else:
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"hello {n}"}],
                    max_tokens=6, stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                for _ in stream:
                    pass
        except Exception as exc:
            if expected is None or not isinstance(exc, expected):
                self.unexpected.append(f"{model} ({tenant}): {exc!r}")
            return
        if expected is not None:
            self.unexpected.append(f"request {n} should have failed with {expected.__name__}")

    def _worker(self, plan: list[tuple[str, str]]) -> None:
        deadline = time.monotonic() + MAX_LOAD_SECONDS
        while time.monotonic() < deadline and (n := self._next()) is not None:
            self._one(n, plan)
            self.stop.wait(PAUSE_SECONDS)

    @contextlib.contextmanager
    def running(self) -> Iterator[Load]:
        plan = [(t, a) for t, adapters in TENANTS.items() for a in adapters] + [("acme", BASE)]
        threads = [
            threading.Thread(target=self._worker, args=(plan,), daemon=True) for _ in range(WORKERS)
        ]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(MAX_LOAD_SECONDS)


def _catalog(cp: str, tiny_llama_dir: Path, peft_adapters: dict[str, Path]) -> dict[str, str]:
    """A pool, two tenants with keys, and their adapters uploaded; tenant -> key."""
    pool = {"name": POOL, "base_model": {"name": BASE, "uri": str(tiny_llama_dir)}}
    assert admin(cp, "POST", "/v1/pools", json=pool).status_code == 201
    keys = {}
    for tenant, adapters in TENANTS.items():
        assert admin(cp, "POST", "/v1/tenants", json={"name": tenant}).status_code == 201
        keys[tenant] = admin(cp, "POST", f"/v1/tenants/{tenant}/keys", json={"name": "k"}).json()[
            "key"
        ]
        for name in adapters:
            src = peft_adapters[name]
            files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
            r = httpx.post(
                cp + "/v1/adapters",
                data={"name": name, "base_model": BASE},
                files=files,
                headers={"Authorization": f"Bearer {keys[tenant]}"},
            )
            assert r.status_code == 201, r.text
    _rollout(cp, keys["acme"], peft_adapters)
    return keys


def _rollout(cp: str, key: str, peft_adapters: dict[str, Path]) -> None:
    """acme's `r4` in a 50/50 rollout with a second version whose stored files are then
    deleted: the canary cannot load, so its share runs on v1 and counts as diverted."""
    auth = {"Authorization": f"Bearer {key}"}
    src = peft_adapters["r8-qv"]
    files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
    r = httpx.post(cp + "/v1/adapters", data={"name": "r4", "base_model": BASE}, files=files,
                   headers=auth)  # fmt: skip
    assert r.status_code == 201, r.text
    assert r.json()["version"]["version"] == 2
    for change in ({"current_version": 1}, {"rollout": {"1": 50, "2": 50}}):
        assert httpx.patch(cp + "/v1/adapters/r4", json=change, headers=auth).status_code == 200


def _wait_for_scrapes(prom: str) -> None:
    """Until both targets are up, tokens were counted and SCRAPED_SECONDS of scrapes are held."""
    deadline = time.monotonic() + 45
    promql = "min(count_over_time(up[30s]) and on () sum(loraplane_tokens_total) > 0)"
    while time.monotonic() < deadline:
        up = instant(prom, "up == 1")
        result = instant(prom, promql)
        if len(up) == 3 and result and float(result[0]["value"][1]) >= SCRAPED_SECONDS:
            return
        time.sleep(0.5)
    raise TimeoutError(f"not enough scrapes: up={instant(prom, 'up')}")


@contextlib.contextmanager
def operator(cp: str, store: Path, tiny_llama_dir: Path) -> Iterator[str]:
    """The operator on an emulated Kubernetes API, running the ServingPool POOL (the pool the
    data plane reports for); the address of its metrics."""
    with running_emulator() as emulator:
        configuration = client.Configuration()
        configuration.host = emulator.url
        api = client.ApiClient(configuration)
        client.CoreV1Api(api).create_namespace({"metadata": {"name": PLATFORM}})
        settings = OperatorSettings(
            controlplane_url=cp, service_token=SERVICE, store=str(store),
            pool_interval_seconds=0.5, retry_base_seconds=0.3, retry_max_seconds=1.0,
        )  # fmt: skip
        ctx = OperatorContext.create(
            settings, kube_configuration=configuration, store=LocalStore(store)
        )
        op = OperatorThread(ctx, emulator.url, pool_interval=0.5)
        server, _ = ctx.metrics.serve("127.0.0.1", free_port())
        op.start()
        try:
            body = pool_body(POOL, tiny_llama_dir)
            body["spec"]["baseModel"]["name"] = BASE
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                GROUP, VERSION, PLATFORM, POOLS, body
            )
            yield f"127.0.0.1:{server.server_port}"
        finally:
            server.shutdown()
            if not op.finished.is_set():
                op.stop()
            ctx.close()
            api.close()


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


@pytest.mark.slow
@pytest.mark.skipif(
    not PROMETHEUS.exists(),
    reason=MISSING,
)
def test_every_dashboard_query_returns_data_from_live_components(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    evaluated = queries()
    assert len(evaluated) >= 30
    store = tmp_path / "cp" / "store"
    with split_controlplane(tmp_path / "cp") as (cp, cp_internal, _):
        keys = _catalog(cp, tiny_llama_dir, peft_adapters)
        (canary,) = store.glob("adapters/*/r4/v2-*")
        shutil.rmtree(canary)  # the rollout's canary cannot load: its share is diverted
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE, controlplane_url=cp_internal,
            service_token=SERVICE, store=str(store), pool=POOL, pool_namespace=PLATFORM,
            pressure_interval_s=0.5, num_kv_blocks=256, max_loras=MAX_LORAS,
            max_cpu_lora_bytes="256MiB",  # every adapter fits; the limit's gauge has data
        )  # fmt: skip
        with (
            operator(cp_internal, store, tiny_llama_dir) as op,
            start_server(settings) as (dp, runtime),
            serve_metrics(runtime) as dp_metrics,
        ):
            targets = (dp_metrics.removeprefix("http://"), cp_internal.removeprefix("http://"), op)
            tsdb = tmp_path / "prometheus"
            tsdb.mkdir()
            with prometheus(tsdb, *targets) as prom, Load(dp, keys).running() as load:
                _wait_for_scrapes(prom)
                results = {q: instant(prom, q.promql()) for q in evaluated}
                still_running = not load.stop.is_set() and load.sent < MAX_REQUESTS
                variables = {
                    (board, label): instant(prom, f"count by ({label}) ({substitute(selector)})")
                    for board, selector, label in variable_queries()
                }
                variables = {
                    k: [r for r in v if r["metric"].get(k[1])] for k, v in variables.items()
                }
    assert not load.unexpected, load.unexpected[:5]
    assert still_running, f"the load ended ({load.sent} requests) before the queries ran"
    empty = [q.name for q, result in results.items() if not result]
    assert not empty, f"queries without data: {empty}"
    no_value = [q.name for q, result in results.items() if not _has_data(result)]
    assert not no_value, f"queries whose every value is NaN: {no_value}"
    assert all(variables.values()), [k for k, v in variables.items() if not v]
    # both tenants show up where the dashboards split by tenant
    tokens = {
        r["metric"]["tenant"] for q, res in results.items() if "Tokens/s" in q.panel for r in res
    }
    assert tokens == set(TENANTS)
