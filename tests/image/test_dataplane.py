"""The data plane from the full image, run as the chart runs it: it serves a model with an
adapter (both mounted read-only), its greedy completions equal the same model and adapter served
by `loraplane serve` on this machine, and it runs the native CPU LoRA kernel the image's build
stage compiled (loaded from the prebuilt folder: not compiled at run time, not the torch path)."""

from __future__ import annotations

import re
from pathlib import Path

import openai

from tests.dataplane.server.conftest import spawn, wait_ready
from tests.image.conftest import container, readable_copy
from tests.servers import free_port

PROMPTS = ["The quick brown fox", "hello world", "a b c d e", "Once upon a time"]
# no side ports: the defaults may be taken on a shared machine
ENV = {"LORAPLANE_METRICS_PORT": "0", "LORAPLANE_GATEWAY_METRICS_PORT": "0",
       "LORAPLANE_NUM_KV_BLOCKS": "64"}  # fmt: skip


def _greedy(url: str) -> list[tuple[str, str, str | None, int]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    base = client.models.list().data[0].id
    out = []
    for model in (base, "support"):
        for prompt in PROMPTS:
            r = client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            usage = r.usage.completion_tokens if r.usage else -1
            out.append((model, r.choices[0].text, r.choices[0].finish_reason, usage))
    return out


def test_the_data_plane_serves_like_the_host_with_the_prebuilt_native_kernel(
    full_image: str, tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    model = readable_copy(tiny_llama_dir, tmp_path / "model")
    adapter = readable_copy(peft_adapters["r16"], tmp_path / "support")
    port, host_port = free_port(), free_port()
    args = ["serve", "--model", "/models/tiny", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "tiny",
            "--lora-modules", "support=/adapters/support"]  # fmt: skip
    mounts = {model: "/models/tiny", adapter: "/adapters/support"}
    host = spawn(["--model", str(model), "--port", str(host_port), "--served-model-name", "tiny",
                  "--lora-modules", f"support={adapter}"], env=ENV)  # fmt: skip
    try:
        with container(full_image, args, env=ENV, mounts=mounts) as c:
            url, host_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{host_port}"
            c.wait_http(url + "/ready", timeout=180)
            wait_ready(host_url, timeout=180, proc=host)
            inside, outside = _greedy(url), _greedy(host_url)
            logs = c.logs()
        assert inside == outside
        assert all(usage == 24 and finish == "length" for _, _, finish, usage in inside)
        assert len({text for model, text, _, _ in inside if model == "support"}) > 1
        # the adapter changes what the model says (it was applied, by the kernel below)
        assert [t for m, t, _, _ in inside if m == "support"] != [
            t for m, t, _, _ in inside if m == "tiny"
        ]
        loaded = re.search(r"the native CPU LoRA kernel: prebuilt (\S+) \((\w+)\), (\S+)", logs)
        assert loaded, logs[-4000:]
        assert loaded[3].startswith("/opt/loraplane/kernels/sgmv-"), loaded[0]
        assert "compiled here" not in logs and "the torch path serves" not in logs, logs[-4000:]
        assert "Traceback" not in logs, logs[-4000:]
    finally:
        if host.poll() is None:
            host.kill()
        host.communicate(timeout=30)
