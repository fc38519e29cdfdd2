"""An adapter heavier than a replica's whole host byte limit (`--max-cpu-lora-bytes`) is refused
for good over HTTP: 400 with the adapter reason code `TooLarge` (the data plane answers its
adapter refusals so: `/v1/load_lora_adapter` refuses a static adapter with 400 and the reason
code), a message naming the flag and no Retry-After, in a stream too; a second request does not
read its files again, and the replica's other adapters and the base model go on serving.

A real server in catalog mode against the real control plane, the engine on a thread of this
process so the loader's reads can be counted.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.dataplane.server.test_tenant_shares import BASE, replica
from tests.dataplane.test_host_tier_bytes import copy_bytes, reads


def _upload(cp: str, key: str, name: str, source: Path) -> None:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(source.iterdir())]
    up = httpx.post(cp + "/v1/adapters", data={"name": name, "base_model": BASE}, files=files,
                    headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert up.status_code == 201, up.text


def test_an_adapter_heavier_than_the_host_byte_limit_is_a_400_TooLarge_and_read_once(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    limit = copy_bytes(tiny_llama_dir, peft_adapters["r4"])  # r4 fits, r16 does not
    heavy = copy_bytes(tiny_llama_dir, peft_adapters["r16"])
    assert heavy > limit
    folders = reads(monkeypatch)
    with replica(tiny_llama_dir, tmp_path, {"acme": 1}, engine_process=False,
                 max_cpu_lora_bytes=str(limit)) as r:  # fmt: skip
        key = r.keys["acme"]
        _upload(r.cp, key, "big", peft_adapters["r16"])
        _upload(r.cp, key, "small", peft_adapters["r4"])
        engine = r.runtime.engine.engine  # type: ignore[union-attr]
        engine.loras.retry_after_s = 0.0  # a failed load would be tried again at once
        client = r.client("acme")
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="big", prompt=[5, 6, 7], max_tokens=2)
        assert caught.value.code == "TooLarge"
        assert len(folders) == 1
        body = {"model": "big", "prompt": [5, 6, 7], "max_tokens": 2}
        auth = {"Authorization": f"Bearer {key}"}
        again = httpx.post(r.url + "/v1/completions", json=body, headers=auth, timeout=60)
        streamed = httpx.post(r.url + "/v1/completions", json={**body, "stream": True},
                              headers=auth, timeout=60)  # fmt: skip
        assert len(folders) == 1  # refused by its weight: its files are not read again
        small = client.completions.create(model="small", prompt=[5, 6, 7], max_tokens=2)
        base = client.completions.create(model=BASE, prompt=[5, 6, 7], max_tokens=2)
    assert again.status_code == 400 and "Retry-After" not in again.headers, again.text
    error = again.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "TooLarge", "model"
    )  # fmt: skip
    assert error["message"] == (
        f"adapter big needs {heavy} bytes of host memory, more than the whole host adapter"
        f" limit ({limit} bytes, --max-cpu-lora-bytes)"
    )
    assert '"code": "TooLarge"' in streamed.text and "--max-cpu-lora-bytes" in streamed.text
    assert small.choices[0].finish_reason and base.choices[0].finish_reason
    assert len(folders) == 2  # small's one read


def test_an_adapter_larger_than_the_whole_adapter_memory_is_a_400_TooLarge_too(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    folders = reads(monkeypatch)
    with replica(tiny_llama_dir, tmp_path, {"acme": 1}, engine_process=False,
                 lora_memory="1024") as r:  # fmt: skip
        key = r.keys["acme"]
        _upload(r.cp, key, "big", peft_adapters["r16"])
        client = r.client("acme")
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="big", prompt=[5, 6, 7], max_tokens=2)
        assert caught.value.code == "TooLarge"
        again = httpx.post(r.url + "/v1/completions",
                           json={"model": "big", "prompt": [5, 6, 7], "max_tokens": 2},
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
        base = client.completions.create(model=BASE, prompt=[5, 6, 7], max_tokens=2)
    assert again.status_code == 400 and "Retry-After" not in again.headers, again.text
    error = again.json()["error"]
    assert error["code"] == "TooLarge" and "--lora-memory" in error["message"], error
    assert len(folders) == 1  # read once, to learn its size
    assert base.choices[0].finish_reason
