"""Prometheus metrics of one server (its own registry): the names and labels of
docs/dataplane.md, "Metrics: three views".

Engine state (queues, KV usage, adapters resident and waiting, the engine's counters) is read
as an `EngineSnapshot`, taken on the engine thread when /metrics is scraped, so no scrape
reads a queue while a step mutates it. Request-side figures (tokens, time to first token,
inter-token latency) are fed by the routes as requests run; adapter load times (host and
device tiers) by the engine's step records (step_observer.py), which a step observer that
`build_engine` adds hands to the runtime (in the engine process, carried back with each step's
message).

Three views (docs/security.md): `render` is every series, tenant-labelled and per-adapter ones
included, for the metrics port (`--metrics-port`) that only Prometheus may reach;
`render_gateway` is the inference gateway's, for the gateway-metrics port
(`--gateway-metrics-port`) that only the endpoint picker may reach: vLLM's protocol gauges and
`vllm:lora_requests_info`, which names the adapters resident and waiting (the picker's LoRA
affinity reads it), and no tenant label; `render_api` is what the API port's /metrics shows
anyone who can call the API: the same protocol gauges without `vllm:lora_requests_info`, so no
adapter name.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.dataplane.async_engine import EngineHealth
from loraplane.dataplane.fairness import TenantShare
from loraplane.dataplane.snapshot import EngineSnapshot

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0)  # fmt: skip
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _GatewayCollector(Collector):
    """vLLM's protocol gauges, the ones an inference gateway scrapes: no tenant label.
    `vllm:lora_requests_info` names the adapters running and waiting, so it is emitted only
    where `adapters` is true (the metrics port and the gateway-metrics port, never the API
    port)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], *, adapters: bool) -> None:
        self._snapshot = snapshot
        self._adapters = adapters

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        if self._adapters:
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Adapters resident on the device (running) and only queued (waiting); value:"
                " the time of the reading",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            info.add_metric(
                [",".join(s.lora_running), ",".join(s.lora_waiting), str(s.max_loras)],
                time.time(),
            )
            yield info
        yield _gauge("vllm:num_requests_running", "Requests in the running batch", s.running)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting for admission", s.waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use", s.kv_usage)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Waiting requests by reason", labels=["reason"]
        )
        by_reason.add_metric(["deferred"], s.deferred)
        yield by_reason


class _EngineCollector(Collector):
    """Emits loraplane's engine gauges and counters (per-adapter ones included) from the
    latest snapshot: the metrics port only."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        s, m = self._m.snapshot, self._m
        resident = GaugeMetricFamily(
            "loraplane_adapter_resident",
            "Adapter versions held per tier",
            labels=["tenant", "adapter", "tier"],
        )
        for tier, held in (("gpu", s.resident), ("cpu", s.in_host)):
            for (tenant, name), count in sorted(held.items()):
                resident.add_metric([tenant, name, tier], count)
        yield resident
        waiting = GaugeMetricFamily(
            "loraplane_adapter_waiting_requests",
            "Waiting requests per adapter",
            labels=["tenant", "adapter"],
        )
        # every registered adapter has a series (0 when nothing waits), so dashboards see it
        for tenant, name in sorted(set(s.registered) | set(s.waiting_per_adapter)):
            waiting.add_metric([tenant, name], s.waiting_per_adapter[(tenant, name)])
        yield waiting
        loads = CounterMetricFamily(
            "loraplane_adapter_loads", "Adapter loads per tier", labels=["tier", "result"]
        )
        loads.add_metric(["gpu", "ok"], s.gpu_loads)
        loads.add_metric(["gpu", "error"], s.gpu_load_errors)
        # host tier: background loads from disk (and static registrations, which the server
        # counts itself); disk tier: downloads from the object store
        loads.add_metric(["cpu", "ok"], s.host_loads)
        loads.add_metric(["cpu", "rejected"], m.cpu_loads["rejected"])
        loads.add_metric(["cpu", "error"], s.host_failures + m.cpu_loads["error"])
        loads.add_metric(["disk", "ok"], s.disk_loads)
        loads.add_metric(["disk", "error"], s.disk_failures)
        yield loads
        hits = CounterMetricFamily(
            "loraplane_adapter_cache_hits", "Adapter lookups served by a tier", labels=["tier"]
        )
        hits.add_metric(["gpu"], s.gpu_hits)
        hits.add_metric(["cpu"], m.cpu_hits)
        hits.add_metric(["disk"], s.disk_hits)
        yield hits
        evictions = CounterMetricFamily(
            "loraplane_adapter_evictions", "Adapters evicted from a tier", labels=["tier"]
        )
        evictions.add_metric(["gpu"], s.gpu_evictions)
        evictions.add_metric(["cpu"], s.host_evictions + m.cpu_evictions)
        evictions.add_metric(["disk"], s.disk_evictions)
        yield evictions
        yield _gauge("loraplane_gpu_adapter_bytes_used", "Device bytes of pool", s.gpu_bytes_used)
        yield _gauge(
            "loraplane_gpu_adapter_bytes_capacity",
            "Device bytes the adapter pool can hold",
            s.gpu_bytes_capacity,
        )
        yield _gauge(
            "loraplane_cpu_adapter_bytes_used",
            "Host bytes of the host tier's adapter copies (every rank's part under tensor"
            " parallelism)",
            s.cpu_bytes_used,
        )
        if s.cpu_bytes_limit is not None:  # --max-cpu-lora-bytes; absent: no byte limit
            yield _gauge(
                "loraplane_cpu_adapter_bytes_limit",
                "Host bytes the host tier's adapter copies may take (--max-cpu-lora-bytes)",
                s.cpu_bytes_limit,
            )
        blocks = GaugeMetricFamily(
            "loraplane_kv_blocks",
            "KV cache blocks by holder: sequences, adapters (when they share the pool), free",
            labels=["holder"],
        )
        by_sequences = s.kv_blocks_total - s.kv_blocks_free - s.kv_blocks_adapters
        for holder, value in (("sequences", by_sequences), ("adapters", s.kv_blocks_adapters),
                              ("free", s.kv_blocks_free)):  # fmt: skip
            blocks.add_metric([holder], value)
        yield blocks
        deferred = CounterMetricFamily(
            "loraplane_requests_deferred", "Requests deferred by the adapter limit"
        )
        deferred.add_metric([], s.deferred_total)
        yield deferred
        yield from _tenant_families(s.tenants)


def _tenant_families(tenants: dict[str, TenantShare]) -> Iterator[Metric]:
    """Per tenant: requests running and waiting, preemptions, served tokens and its weight
    (its share of contended seats and tokens is weight / the active tenants' weights)."""
    gauges: list[tuple[str, str, Callable[[TenantShare], float]]] = [
        ("loraplane_tenant_running_requests", "Running requests per tenant", lambda t: t.running),
        ("loraplane_tenant_waiting_requests", "Waiting requests per tenant", lambda t: t.waiting),
        ("loraplane_tenant_weight", "A tenant's share weight", lambda t: t.weight),
    ]
    counters: list[tuple[str, str, Callable[[TenantShare], float]]] = [
        ("loraplane_tenant_preemptions",
         "Sequences of a tenant preempted (to give way to a tenant below its share, or for KV)",
         lambda t: t.preemptions),
        ("loraplane_tenant_served_tokens",
         "Tokens computed for a tenant (prompt chunks and decodes)", lambda t: t.served_tokens),
    ]  # fmt: skip
    for name, doc, value in gauges:
        gauge = GaugeMetricFamily(name, doc, labels=["tenant"])
        for tenant, share in sorted(tenants.items()):
            gauge.add_metric([tenant], value(share))
        yield gauge
    for name, doc, value in counters:
        counter = CounterMetricFamily(name, doc, labels=["tenant"])
        for tenant, share in sorted(tenants.items()):
            counter.add_metric([tenant], value(share))
        yield counter


class _HealthCollector(Collector):
    """The engine loop's health figures, what /ready judges (the metrics port only); read
    without the engine thread, so they show while a step hangs."""

    def __init__(self, health: Callable[[], EngineHealth | None]) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        h = self._health()
        if h is None:  # no engine yet
            return
        yield _gauge(
            "loraplane_engine_seconds_since_last_step",
            "Seconds since an engine step last ended or the engine last had no work (grows"
            " only while work waits behind a stuck step)",
            h.seconds_since_step,
        )
        yield _gauge(
            "loraplane_engine_failed_steps",
            "Engine steps that raised, in a row (0 once a step returns)",
            h.failed_steps,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The registries of one server (everything; the gateway's view; the API port's view) and
    the request-side instruments."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.gateway_registry = CollectorRegistry(auto_describe=False)
        self.gateway_registry.register(
            _GatewayCollector(lambda: self.gateway_snapshot, adapters=True)
        )
        self.api_registry = CollectorRegistry(auto_describe=False)
        self.api_registry.register(_GatewayCollector(lambda: self.gateway_snapshot, adapters=False))
        self.snapshot = EngineSnapshot()
        # the gateway's and the API port's reading (EngineSnapshot.gateway)
        self.gateway_snapshot = EngineSnapshot()
        self.cpu_loads: Counter[str] = Counter()  # result -> host-tier loads (registrations)
        self.cpu_hits = 0  # catalog-mode resolutions found already registered
        self.cpu_evictions = 0  # adapters unregistered (unload)
        self.requests = PromCounter(
            "loraplane_requests",
            "Generation requests per tenant and HTTP status code",
            ["tenant", "code"],
            registry=self.registry,
        )
        # a rollout judged per version (docs/controlplane.md, "Weighted rollouts"): requests
        # for an adapter by the version they ran with, and those answered with a 5xx
        self.version_requests = PromCounter(
            "loraplane_adapter_version_requests",
            "Generation requests per tenant, adapter and adapter version",
            ["tenant", "adapter", "version"],
            registry=self.registry,
        )
        self.version_errors = PromCounter(
            "loraplane_adapter_version_errors",
            "Generation requests per tenant, adapter and version answered with a server error",
            ["tenant", "adapter", "version"],
            registry=self.registry,
        )
        # requests the split meant for a version that was not warm here, run on the current
        # version instead: "loading" (its first load) or "failed" (its loads keep failing)
        self.version_diverted = PromCounter(
            "loraplane_adapter_version_diverted",
            "Requests of a weighted rollout meant for a version not in host memory on this "
            "replica, served by the current version instead, per reason (loading, failed)",
            ["tenant", "adapter", "version", "reason"],
            registry=self.registry,
        )
        self.tokens = PromCounter(
            "loraplane_tokens",
            "Prompt and completion tokens per tenant",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self.load_seconds = Histogram(
            "loraplane_adapter_load_seconds",
            "Time to load an adapter into a tier",
            ["tier"],
            buckets=LOAD_BUCKETS,
            registry=self.registry,
        )
        self.refused = PromCounter(
            "loraplane_requests_refused",
            "Requests refused at the door by a queue, prompt or body cap",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("queue_full", "tenant_queue_full", "too_many_prompts", "body_too_large"):
            self.refused.labels(reason=reason)  # series exist at 0
        self.ttft = Histogram(
            "loraplane_time_to_first_token_seconds",
            "Time from request arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "loraplane_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        for tier in ("gpu", "cpu"):
            self.load_seconds.labels(tier=tier)  # series exist before the first load
        self.registry.register(_GatewayCollector(lambda: self.snapshot, adapters=True))
        self.registry.register(_EngineCollector(self))

    def watch_engine(self, health: Callable[[], EngineHealth | None]) -> None:
        """Export the engine loop's health figures from `health` (at each scrape)."""
        self.registry.register(_HealthCollector(health))

    def add_tenant(self, tenant: str) -> None:
        """Create the tenant's token series at 0 (standalone mode's one tenant, at start)."""
        for kind in ("prompt", "completion"):
            self.tokens.labels(tenant=tenant, kind=kind)

    def count_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        """Add a request's tokens to loraplane_tokens_total."""
        if prompt:
            self.tokens.labels(tenant=tenant, kind="prompt").inc(prompt)
        if completion:
            self.tokens.labels(tenant=tenant, kind="completion").inc(completion)

    def render(self) -> bytes:
        """The text exposition of every metric (the metrics port)."""
        return generate_latest(self.registry)

    def render_gateway(self) -> bytes:
        """The gateway-metrics port's exposition: vLLM's protocol gauges with the adapter names
        of `vllm:lora_requests_info`, no tenant label."""
        return generate_latest(self.gateway_registry)

    def render_api(self) -> bytes:
        """The API port's exposition: vLLM's protocol gauges, no adapter name, no tenant."""
        return generate_latest(self.api_registry)
