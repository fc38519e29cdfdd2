"""The gateway-metrics port (`--gateway-metrics-port`) of a real `loraplane serve` process: the
endpoint picker's view names the adapter a request made resident and carries nothing
tenant-labelled, while the API port's /metrics names no adapter; the deprecated
`--api-metrics-adapters` starts, warns and changes nothing; a bad or taken port fails start
naming the setting."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.dataplane.server.conftest import spawn, wait_ready
from tests.servers import free_port

PROTOCOL = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting_by_reason",
}


def _families(text: str) -> dict[str, list[dict[str, str]]]:
    return {f.name: [s.labels for s in f.samples] for f in text_string_to_metric_families(text)}


def test_the_picker_port_names_the_resident_adapter_and_the_api_port_none(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    port, metrics_port, gateway_port = free_port(), free_port(), free_port()
    proc = spawn(
        ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--port", str(port),
         "--metrics-port", str(metrics_port), "--gateway-metrics-port", str(gateway_port),
         "--lora-modules", f"sql-helper={peft_adapters['r4']}", "--api-key", "sk-only",
         "--api-metrics-adapters"],
        env={"LORAPLANE_NUM_KV_BLOCKS": "64"},
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc=proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-only", max_retries=0)
        out = client.completions.create(model="sql-helper", prompt="select", max_tokens=3)
        assert out.choices[0].text
        picker = httpx.get(f"http://127.0.0.1:{gateway_port}/metrics").text
        families = _families(picker)
        assert set(families) == PROTOCOL | {"vllm:lora_requests_info"}
        (info,) = families["vllm:lora_requests_info"]
        assert info["running_lora_adapters"] == "sql-helper"  # resident after its request
        assert "tenant" not in picker and "loraplane_" not in picker
        # the API port: the same gauges, no adapter named, whatever --api-metrics-adapters says
        api = httpx.get(url + "/metrics").text
        assert set(_families(api)) == PROTOCOL
        assert "sql-helper" not in api and "lora_requests_info" not in api
        # the metrics port keeps everything
        private = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "vllm:lora_requests_info" in private and 'tenant="default"' in private
        # the picker's port serves /metrics only
        assert httpx.get(f"http://127.0.0.1:{gateway_port}/v1/models").status_code == 404
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "--api-metrics-adapters" in err and "deprecated and has no effect" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_taken_gateway_metrics_port_fails_start_naming_the_setting(tiny_llama_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        proc = spawn(["--model", str(tiny_llama_dir), "--port", str(free_port()),
                      "--gateway-metrics-port", str(busy)])  # fmt: skip
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{busy}" in err
    assert "LORAPLANE_GATEWAY_METRICS_PORT" in err


def test_the_gateway_metrics_port_may_be_neither_the_api_nor_the_metrics_port(
    tiny_llama_dir: Path,
) -> None:
    cases = [(["--port", "8123"], "the API port"),
             (["--port", "8124", "--metrics-port", "8123"], "the metrics port")]  # fmt: skip
    for flags, other in cases:
        proc = spawn(["--model", str(tiny_llama_dir), *flags, "--gateway-metrics-port", "8123"])
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert "LORAPLANE_GATEWAY_METRICS_PORT / --gateway-metrics-port" in err and other in err
