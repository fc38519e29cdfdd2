"""Adapter load/unload (admin token only, never a client path), and a client that disconnects
mid-stream freeing its request's KV blocks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.dataplane.server.conftest import (
    ADMIN_TOKEN,
    API_KEY,
    Running,
    server_settings,
    start_server,
)
from tests.dataplane.server.test_load import scrape, total

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TENANT = {"Authorization": f"Bearer {API_KEY}"}


def post(server: Running, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(server.v1 + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("path", ["/load_lora_adapter", "/unload_lora_adapter"])
def test_admin_routes_refuse_tenant_keys_and_missing_tokens(server: Running, path: str) -> None:
    assert post(server, path, {"lora_name": "ad00"}, TENANT).status_code == 403
    r = post(server, path, {"lora_name": "ad00"}, {})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_path_given_to_load_lora_adapter_is_refused(server: Running, tmp_path: Path) -> None:
    r = post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post(server, "/load_lora_adapter", {"lora_name": "ad00", "extra": 1}, ADMIN)
    assert r.status_code == 400  # admin bodies forbid unknown fields


def test_unknown_names_are_404(server: Running) -> None:
    assert post(server, "/load_lora_adapter", {"lora_name": "nope"}, ADMIN).status_code == 404
    assert post(server, "/unload_lora_adapter", {"lora_name": "nope"}, ADMIN).status_code == 404


def test_unload_waits_for_running_requests_then_frees_and_load_restores(server: Running) -> None:
    client = OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)
    args = {"model": "ad19", "prompt": "fox", "temperature": 0}
    before = client.completions.create(max_tokens=8, **args).choices[0].text
    stream = client.completions.create(
        max_tokens=240, stream=True, extra_body={"ignore_eos": True}, **args
    )
    chunks = [next(iter(stream))]
    done: list[httpx.Response] = []
    unloader = threading.Thread(
        target=lambda: done.append(
            post(server, "/unload_lora_adapter", {"lora_name": "ad19"}, ADMIN)
        )
    )
    unloader.start()
    time.sleep(0.1)
    assert not done  # waiting for the running request
    chunks += [c for c in stream if c.choices]
    unloader.join(30)
    assert done[0].status_code == 200, done[0].text
    assert chunks[-1].choices[0].finish_reason == "length"  # it ran to the end
    with pytest.raises(openai.NotFoundError):
        client.completions.create(max_tokens=2, **args)
    assert "ad19" not in [m.id for m in client.models.list().data]
    cpu = [
        lab for lab, _ in scrape(server)["loraplane_adapter_resident"] if lab["adapter"] == "ad19"
    ]
    assert cpu == []  # freed from every tier
    r = post(server, "/load_lora_adapter", {"lora_name": "ad19"}, ADMIN)
    assert r.status_code == 200 and "added" in r.text
    assert client.completions.create(max_tokens=8, **args).choices[0].text == before


def test_a_client_disconnecting_mid_stream_frees_its_blocks(server: Running) -> None:
    idle = total(scrape(server), "vllm:kv_cache_usage_perc")
    tokens = total(scrape(server), "loraplane_tokens_total", kind="completion")
    body = {"model": "ad03", "prompt": "Many tenants", "max_tokens": 230, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.v1 + "/completions", json=body, headers=TENANT) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert total(scrape(server), "vllm:kv_cache_usage_perc") > idle
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = scrape(server)
        if total(now, "vllm:kv_cache_usage_perc") == idle:
            break
        time.sleep(0.05)
    assert total(now, "vllm:kv_cache_usage_perc") == idle
    assert total(now, "vllm:num_requests_running") == 0
    generated = total(now, "loraplane_tokens_total", kind="completion") - tokens
    assert 0 < generated < 230  # aborted, not finished


def test_admin_routes_are_disabled_without_an_admin_token(tiny_llama_dir: Path) -> None:
    settings = server_settings(tiny_llama_dir, {}, admin_token=None, api_key=None)
    with start_server(settings) as (url, _):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a"}, headers=ADMIN)
        assert r.status_code == 404
        # no --api-key: any caller may use the OpenAI routes
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-llama"
