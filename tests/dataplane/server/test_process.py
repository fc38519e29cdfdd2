"""`serve` as a process: SIGTERM drains and exits 0; a rejected --lora-modules adapter fails
start with its reason code."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import threading
from pathlib import Path

import httpx

from tests.dataplane.server.conftest import children_of, spawn, wait_ready
from tests.servers import free_port


def test_sigterm_finishes_running_requests_and_exits_0(tiny_llama_dir: Path) -> None:
    port = free_port()
    proc = spawn(
        ["--model", str(tiny_llama_dir), "--port", str(port)],
        env={"LORAPLANE_SHUTDOWN_GRACE_S": "60", "LORAPLANE_NUM_KV_BLOCKS": "64"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc=proc)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "fox", "max_tokens": 200, "stream": True,
                "ignore_eos": True}  # fmt: skip
        received: list[str] = []
        started = threading.Event()

        def read() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    started.set()
                    if line:
                        received.append(line)

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        reader.join(30)
        assert proc.returncode == 0, err
        # the startup heap left the collector's walks before the first request was served
        frozen = re.search(r"froze (\d+) startup objects out of the garbage collector", err)
        assert frozen and int(frozen[1]) > 10_000, err
        assert received[-1] == "data: [DONE]"  # the running request was finished, not cut
        last = json.loads(received[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_rejected_lora_module_fails_start_with_its_reason(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "dora"
    shutil.copytree(peft_adapters["r4"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(config))
    proc = spawn(
        ["--model", str(tiny_llama_dir), "--port", str(free_port()), "--lora-modules",
         f"good={peft_adapters['r4']}", f"bad={bad}"]
    )  # fmt: skip
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    # use_dora without magnitude vectors: refused (DoRA itself is served)
    assert "adapter bad rejected: ShapeMismatch:" in err and "lora_magnitude_vector" in err


def test_bad_settings_are_a_usage_error(tiny_llama_dir: Path) -> None:
    proc = spawn(["--model", str(tiny_llama_dir), "--lora-modules", "no-equals-sign"])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "LORAPLANE_LORA_MODULES" in err and "NAME=DIR" in err


def test_a_model_path_that_is_no_folder_is_a_usage_error_before_anything_starts(
    tmp_path: Path,
) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    for model, found in ((tmp_path / "typo", "no such folder"), (weights, "not a folder")):
        proc = spawn(["--model", str(model)])
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert f"--model / LORAPLANE_MODEL {model}: {found}" in err, err
        assert "Started server process" not in err, "no server started for it"


def test_tenant_series_are_served_on_the_metrics_port_only(tiny_llama_dir: Path) -> None:
    """The process serves two ports: the API's /metrics has vLLM's protocol gauges and no
    tenant label; the metrics port has every series; both stop on SIGTERM with exit 0, and
    the log has uvicorn's start and stop lines once."""
    port, metrics_port = free_port(), free_port()
    proc = spawn(
        ["--model", str(tiny_llama_dir), "--port", str(port), "--metrics-port", str(metrics_port),
         "--api-key", "sk-only-tenant"],
        env={"LORAPLANE_NUM_KV_BLOCKS": "64"},
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc=proc)
        auth = {"Authorization": "Bearer sk-only-tenant"}
        model = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": model, "prompt": "fox", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, headers=auth).status_code == 200
        api = httpx.get(url + "/metrics").text
        private = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "vllm:num_requests_running" in api and "vllm:num_requests_running" in private
        for series in ("loraplane_tokens_total", "loraplane_requests_total", "tenant="):
            assert series not in api, series
        assert 'loraplane_tokens_total{kind="completion",tenant="default"} 3.0' in private
        assert 'loraplane_requests_total{code="200",tenant="default"} 1.0' in private
        # the metrics port serves /metrics only: the API is not reachable through it
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models").status_code == 404
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        # uvicorn's life-cycle lines once (the API's server), not once per port; the metrics
        # port says where it serves
        for line in ("Started server process", "Shutting down", "Finished server process"):
            assert err.count(line) == 1, (line, err)
        assert f"metrics (every series) on http://127.0.0.1:{metrics_port}/metrics" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _maps_torch(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_api_servers_process_serves_without_torch_which_only_its_engine_process_loads(
    tiny_llama_dir: Path,
) -> None:
    """The engine runs in a process of its own, so the API server's process (HTTP, tokenizing,
    grammars, detokenizing) never imports torch: it starts seconds sooner and holds hundreds
    of MB less. Checked after a completion with log-probabilities and a JSON-schema chat."""
    port = free_port()
    proc = spawn(["--model", str(tiny_llama_dir), "--port", str(port)],
                 env={"LORAPLANE_NUM_KV_BLOCKS": "64"})  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc=proc)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        done = httpx.post(url + "/v1/completions", json={
            "model": model, "prompt": "fox", "max_tokens": 3, "logprobs": 2}).json()  # fmt: skip
        assert len(done["choices"][0]["logprobs"]["top_logprobs"]) == 3
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        chat = httpx.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}})  # fmt: skip
        assert chat.status_code == 200, chat.text
        assert not _maps_torch(proc.pid), "the API server's process imported torch"
        engines = [pid for pid in children_of(proc.pid) if _maps_torch(pid)]
        assert len(engines) == 1, "one engine process, with torch"
    finally:
        proc.kill()
        proc.wait()


def test_a_taken_metrics_port_fails_start_naming_the_setting(tiny_llama_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        proc = spawn(["--model", str(tiny_llama_dir), "--port", str(free_port()),
                      "--metrics-port", str(metrics_port)])  # fmt: skip
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{metrics_port}" in err
    assert "LORAPLANE_METRICS_PORT" in err


def test_the_metrics_port_may_not_be_the_api_port(tiny_llama_dir: Path) -> None:
    proc = spawn(["--model", str(tiny_llama_dir), "--port", "8123", "--metrics-port", "8123"])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "LORAPLANE_METRICS_PORT / --metrics-port" in err and "the API port" in err
