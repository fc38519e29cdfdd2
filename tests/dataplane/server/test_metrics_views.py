"""The two views of a server's metrics: everything (the metrics port) and the API port's, which
anyone who can call the API reads: vLLM's protocol gauges, no tenant label, and adapter names
only when the server is told nothing but a gateway reaches its API port."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from loraplane.dataplane.server.metrics import EngineSnapshot, ServerMetrics

GATEWAY = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting_by_reason",
}


def _metrics(**kw: bool) -> ServerMetrics:
    metrics = ServerMetrics(**kw)
    metrics.snapshot = EngineSnapshot(
        running=1, running_adapters=["b-secret"], max_loras=4,
        resident=Counter({("tenant-b", "b-secret"): 1}),
        registered=Counter({("tenant-b", "b-secret"): 1}),
    )  # fmt: skip
    metrics.count_tokens("tenant-b", 7, 11)
    metrics.requests.labels(tenant="tenant-b", code="200").inc()
    return metrics


def _names(text: bytes) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text.decode())}


def test_the_api_port_view_has_protocol_gauges_only() -> None:
    text = _metrics().render_gateway()
    assert _names(text) == GATEWAY
    assert b"tenant" not in text and b"b-secret" not in text


def test_adapter_names_reach_the_api_port_only_when_asked() -> None:
    text = _metrics(api_adapters=True).render_gateway()
    assert _names(text) == GATEWAY | {"vllm:lora_requests_info"}
    assert b'running_lora_adapters="b-secret"' in text
    assert b"tenant" not in text


def test_the_metrics_port_view_has_everything() -> None:
    text = _metrics().render()
    names = _names(text)
    assert GATEWAY | {"vllm:lora_requests_info", "loraplane_tokens", "loraplane_requests",
                      "loraplane_adapter_resident"} <= names  # fmt: skip
    assert b'loraplane_tokens_total{kind="completion",tenant="tenant-b"} 11.0' in text
    assert b'loraplane_adapter_resident{adapter="b-secret",tenant="tenant-b",tier="gpu"}' in text
