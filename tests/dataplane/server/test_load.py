"""200 concurrent streams over 20 adapters: no failure, each output equal to the same request
run alone on a separate engine, and every metric of docs/dataplane.md "Metrics: three views"
present and moving."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.server.conftest import API_KEY, Running

NUM_REQUESTS = 200
MAX_TOKENS = 12
WORDS = ["many", "tenants", "share", "one", "base", "model", "small", "adapter", "fast"]

REQUIRED: dict[str, set[str]] = {
    "vllm:lora_requests_info": {"running_lora_adapters", "waiting_lora_adapters", "max_lora"},
    "vllm:num_requests_running": set(),
    "vllm:num_requests_waiting": set(),
    "vllm:kv_cache_usage_perc": set(),
    "vllm:num_requests_waiting_by_reason": {"reason"},
    "loraplane_adapter_resident": {"tenant", "adapter", "tier"},
    "loraplane_adapter_waiting_requests": {"tenant", "adapter"},
    "loraplane_adapter_loads_total": {"tier", "result"},
    "loraplane_adapter_load_seconds_count": {"tier"},
    "loraplane_adapter_cache_hits_total": {"tier"},
    "loraplane_adapter_evictions_total": {"tier"},
    "loraplane_gpu_adapter_bytes_used": set(),
    "loraplane_gpu_adapter_bytes_capacity": set(),
    "loraplane_kv_blocks": {"holder"},
    "loraplane_requests_refused_total": {"reason"},
    "loraplane_requests_deferred_total": set(),
    "loraplane_tokens_total": {"tenant", "kind"},
    "loraplane_time_to_first_token_seconds_count": set(),
    "loraplane_inter_token_latency_seconds_count": set(),
}


def scrape(
    server: Running, *, api_port: bool = False
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] of the metrics port (or of the API port's /metrics)"""
    text = httpx.get((server.url if api_port else server.metrics_url) + "/metrics", timeout=10).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    return sum(v for lab, v in samples.get(name, []) if labels.items() <= lab.items())


def workload() -> list[tuple[str, str]]:
    rng = random.Random(3)
    return [
        (f"ad{i % 20:02d}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))))
        for i in range(NUM_REQUESTS)
    ]


async def stream_all(server: Running, work: list[tuple[str, str]]) -> list[str]:
    client = AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)

    async def one(model: str, prompt: str) -> str:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    try:
        return await asyncio.gather(*(one(m, p) for m, p in work))
    finally:
        await client.close()


def reference(server: Running, work: list[tuple[str, str]], alone: int) -> list[str]:
    """The same requests on a separate engine: the first `alone` each in a batch of its own
    (as if run alone), the rest together in one batch (greedy outputs are batch-invariant,
    which tests/dataplane/test_engine.py checks; running all 200 alone takes ~14 s)."""
    s = server.settings
    engine = Engine(EngineConfig(model=s.model, device="cpu", dtype="float32", max_loras=8,
                                 num_kv_blocks=1024))  # fmt: skip
    refs = {n: engine.register_lora(n, Path(p), "default") for n, p in server.adapters.items()}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    texts = [engine.generate([p], params, [refs[m]])[0].text for m, p in work[:alone]]
    rest = work[alone:]
    outs = engine.generate([p for _, p in rest], params, [refs[m] for m, _ in rest])
    return texts + [o.text for o in outs]


def test_200_concurrent_streams_over_20_adapters_match_requests_run_alone(server: Running) -> None:
    work = workload()
    before = scrape(server)
    for name, labels in REQUIRED.items():
        assert name in before, name
        for lab, _ in before[name]:
            assert labels <= set(lab), (name, lab)

    outputs = asyncio.run(stream_all(server, work))

    assert outputs == reference(server, work, alone=40)
    after = scrape(server)
    for name, labels in REQUIRED.items():
        assert name in after, name
        assert all(labels <= set(lab) for lab, _ in after[name]), name
    moved = [
        ("loraplane_requests_total", {"tenant": "default", "code": "200"}),
        ("loraplane_tokens_total", {"kind": "completion", "tenant": "default"}),
        ("loraplane_tokens_total", {"kind": "prompt"}),
        ("loraplane_time_to_first_token_seconds_count", {}),
        ("loraplane_inter_token_latency_seconds_count", {}),
        ("loraplane_adapter_loads_total", {"tier": "gpu", "result": "ok"}),
        ("loraplane_adapter_load_seconds_count", {"tier": "gpu"}),
        ("loraplane_adapter_evictions_total", {"tier": "gpu"}),
        ("loraplane_adapter_cache_hits_total", {"tier": "gpu"}),
        ("loraplane_requests_deferred_total", {}),
    ]
    for name, labels in moved:
        assert total(after, name, **labels) > total(before, name, **labels), name
    served = total(after, "loraplane_requests_total", tenant="default", code="200")
    assert served - total(before, "loraplane_requests_total", tenant="default", code="200") == (
        NUM_REQUESTS
    )
    assert (
        total(after, "loraplane_time_to_first_token_seconds_count")
        - total(before, "loraplane_time_to_first_token_seconds_count")
        == NUM_REQUESTS
    )
    resident = [lab for lab, v in after["loraplane_adapter_resident"] if v > 0]
    assert {lab["tier"] for lab in resident} == {"gpu", "cpu"}
    assert len([lab for lab in resident if lab["tier"] == "gpu"]) <= 8
    assert total(after, "loraplane_gpu_adapter_bytes_used") > 0
    capacity = total(after, "loraplane_gpu_adapter_bytes_capacity")
    assert capacity >= total(after, "loraplane_gpu_adapter_bytes_used")
    blocks = {lab["holder"]: v for lab, v in after["loraplane_kv_blocks"]}
    assert blocks["adapters"] == 0  # CPU: adapters in buffers of their own (kv_lora_shared off)
    assert blocks["sequences"] + blocks["free"] == 512  # the server's LORAPLANE_NUM_KV_BLOCKS
    (info,) = after["vllm:lora_requests_info"]
    assert info[0]["max_lora"] == "8"
    # the API port shows vLLM's protocol gauges only: no tenant, no adapter named
    gateway = scrape(server, api_port=True)
    assert set(gateway) == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting_by_reason",
    }
