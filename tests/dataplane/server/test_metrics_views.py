"""The three views of a server's metrics: everything (the metrics port); the endpoint picker's
(the gateway-metrics port): vLLM's protocol gauges with the adapter names of
vllm:lora_requests_info, no tenant label; and the API port's, which anyone who can call the API
reads: the same protocol gauges, without any adapter name."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loraplane.dataplane.server.metrics import ServerMetrics
from loraplane.dataplane.snapshot import EngineSnapshot

GATEWAY = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting_by_reason",
}


def _metrics() -> ServerMetrics:
    metrics = ServerMetrics()
    metrics.snapshot = EngineSnapshot(
        running=1, running_adapters=["b-secret"], max_loras=4, lora_running=["b-secret"],
        resident=Counter({("tenant-b", "b-secret"): 1}),
        registered=Counter({("tenant-b", "b-secret"): 1}), cpu_bytes_used=4096,
    )  # fmt: skip
    metrics.gateway_snapshot = EngineSnapshot(running=1, max_loras=4, lora_running=["b-secret"])
    metrics.count_tokens("tenant-b", 7, 11)
    metrics.requests.labels(tenant="tenant-b", code="200").inc()
    return metrics


def _names(text: bytes) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text.decode())}


def test_the_api_port_view_has_protocol_gauges_only_and_no_adapter_name() -> None:
    text = _metrics().render_api()
    assert _names(text) == GATEWAY
    assert b"tenant" not in text and b"b-secret" not in text and b"lora" not in text


def test_the_gateway_view_adds_adapter_names_and_nothing_tenant_labelled() -> None:
    text = _metrics().render_gateway()
    assert _names(text) == GATEWAY | {"vllm:lora_requests_info"}
    assert b'running_lora_adapters="b-secret"' in text
    assert b"tenant" not in text and b"loraplane_" not in text


def test_the_metrics_port_view_has_everything() -> None:
    text = _metrics().render()
    names = _names(text)
    assert GATEWAY | {"vllm:lora_requests_info", "loraplane_tokens", "loraplane_requests",
                      "loraplane_adapter_resident"} <= names  # fmt: skip
    assert b'loraplane_tokens_total{kind="completion",tenant="tenant-b"} 11.0' in text
    assert b'loraplane_adapter_resident{adapter="b-secret",tenant="tenant-b",tier="gpu"}' in text
    assert b"loraplane_cpu_adapter_bytes_used 4096.0" in text  # the host tier's bytes
    assert b"loraplane_cpu_adapter_bytes_limit" not in text  # no byte limit: no gauge


def test_the_host_byte_limit_gauge_shows_max_cpu_lora_bytes_when_set() -> None:
    metrics = _metrics()
    assert metrics.snapshot is not None
    metrics.snapshot.cpu_bytes_limit = 8192
    text = metrics.render()
    assert b"loraplane_cpu_adapter_bytes_limit 8192.0" in text


def test_the_protocol_gauge_read_as_the_endpoint_picker_reads_it(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    """A real engine with one seat: the running request's adapter is resident on the device
    and listed as running; the waiting requests' adapters are listed as waiting, by the names
    clients send; the value is the time of the reading; max_lora is the engine's slots."""
    import time

    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                 num_kv_blocks=64, max_num_seqs=1))  # fmt: skip
    refs = {n: engine.register_lora(n, peft_adapters[n]) for n in ("r4", "r16", "r64")}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, name in enumerate(("r4", "r16", "r64")):
        engine.add_request(f"q{i}", [5, 6, 7], params, refs[name])
    engine.step()  # q0 runs with r4; the others wait
    metrics = ServerMetrics()
    metrics.gateway_snapshot = EngineSnapshot.gateway(engine)
    before = time.time()
    families = {f.name: f for f in text_string_to_metric_families(
        metrics.render_gateway().decode())}  # fmt: skip
    (sample,) = families["vllm:lora_requests_info"].samples
    running = sample.labels["running_lora_adapters"].split(",")
    waiting = set(sample.labels["waiting_lora_adapters"].split(","))
    (seq,) = engine.scheduler.running
    assert seq.lora is not None and seq.lora.name in running
    assert running == sorted(r.name for r in engine.loras.resident)
    queued = {s.lora.name for s in engine.scheduler.waiting if s.lora is not None}
    assert waiting == queued - set(running) and len(waiting) == 2
    assert int(sample.labels["max_lora"]) == engine.config.lora_slots
    assert abs(sample.value - before) < 5  # a timestamp: the picker keeps the newest reading
    assert families["vllm:num_requests_running"].samples[0].value == 1
    assert families["vllm:num_requests_waiting"].samples[0].value == 2
    assert 0 < families["vllm:kv_cache_usage_perc"].samples[0].value <= 1


def test_tenant_share_series_are_on_the_metrics_port_and_not_the_api_port(server) -> None:  # type: ignore[no-untyped-def]
    """A served request shows as the tenant's served tokens and weight (metrics port only)."""
    import httpx

    from tests.dataplane.server.conftest import API_KEY

    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 3}
    assert httpx.post(server.v1 + "/completions", json=body, headers=headers).status_code == 200
    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(server.metrics_url + "/metrics").text)
    }
    served = {
        s.labels["tenant"]: s.value for s in families["loraplane_tenant_served_tokens"].samples
    }
    assert served["default"] >= 3  # at least the prompt chunk and the decodes
    weights = {s.labels["tenant"]: s.value for s in families["loraplane_tenant_weight"].samples}
    assert weights["default"] == 1.0
    for name in ("loraplane_tenant_running_requests", "loraplane_tenant_waiting_requests",
                 "loraplane_tenant_preemptions"):  # fmt: skip
        assert name in families
    assert b"loraplane_tenant" not in httpx.get(server.url + "/metrics").content
