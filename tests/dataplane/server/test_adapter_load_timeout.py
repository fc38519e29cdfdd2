"""A request whose adapter does not load in time answers 504 AdapterLoadTimeout, OpenAI-shaped,
naming the adapter and never where it is kept; the server's other adapters go on serving.

A real server (in this process) with two static adapters and room for one in host memory: the
one evicted from the host must be read again from its folder, and that read is held.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplane.dataplane.lora import registry as registry_module
from tests.dataplane.server.conftest import API_KEY, server_settings, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_an_adapter_that_does_not_load_in_time_answers_504_naming_it_and_no_path(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_dir, fast_dir = peft_adapters["r4"], peft_adapters["r16"]
    held = threading.Event()
    release = threading.Event()
    real = registry_module.load_lora

    def load(path: Any, *args: Any, **kwargs: Any) -> Any:
        if held.is_set() and Path(path) == slow_dir:  # the slow adapter's read hangs
            release.wait(timeout=30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(registry_module, "load_lora", load)
    settings = server_settings(
        tiny_llama_dir,
        {"slowbot": slow_dir, "fastbot": fast_dir},
        max_loras=1,
        max_cpu_loras=1,  # registering fastbot evicts slowbot's host copy
        adapter_load_timeout_s=1.0,
        engine_process=False,  # the patched loader is this process's: the engine on a thread
    )
    try:
        with start_server(settings) as (url, _):
            held.set()
            body = {"model": "slowbot", "prompt": [5, 6, 7], "max_tokens": 2}
            start = time.monotonic()
            late = httpx.post(url + "/v1/completions", headers=AUTH, json=body, timeout=30)
            elapsed = time.monotonic() - start
            fast = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30,
                              json={**body, "model": "fastbot"})  # fmt: skip
    finally:
        release.set()
    assert late.status_code == 504, late.text
    error = late.json()["error"]
    assert error["code"] == "AdapterLoadTimeout" and error["type"] == "server_error"
    assert "slowbot" in error["message"] and "1 s" in error["message"]
    assert str(slow_dir) not in late.text and slow_dir.name not in late.text
    assert "/" not in error["message"]
    assert 1.0 <= elapsed < 15, elapsed  # the deadline, not the held load's 30 s
    assert fast.status_code == 200, fast.text
