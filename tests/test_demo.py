"""The embedded demo. Slow: `loraplane demo --once` as a user runs it (a subprocess): the first
run builds the model and the tenants' adapters and tours the running system; a second run in
the same folder reuses the build and serves sooner. Fast: the pieces those runs rely on."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import jinja2
import pytest

from loraplane.demo.build import CHAT_TEMPLATE
from loraplane.demo.corpus import QUESTIONS, STYLES, chat_text
from loraplane.demo.examples import console_hint
from loraplane.demo.provision import Tenant
from loraplane.demo.stack import bind, running
from loraplane.demo.workspace import ADAPTERS, Workspace, fingerprint

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    out: str
    err: str
    seconds: float


def demo_once(workdir: Path) -> Run:
    # the admin token's file goes to the work folder, not the checkout's .loraplane/
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "LORAPLANE_DATA_DIR": str(workdir / "state")}  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane", "demo", "--once", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=400, cwd=REPO, env=env,
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return Run(proc.stdout, proc.stderr, seconds)


def serving_after(out: str) -> float:
    found = re.search(r"serving after ([\d.]+) s", out)
    assert found, out[-2000:]
    return float(found.group(1))


def test_training_text_is_what_the_server_renders_for_a_chat_request() -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    prompt = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert chat_text(QUESTIONS[0], STYLES["acme"][0]) == prompt + STYLES["acme"][0] + "</s>"


def test_every_style_answers_every_question_starting_with_a_letter() -> None:
    assert set(STYLES) == {"base", *ADAPTERS}
    for answers in STYLES.values():
        assert len(answers) == len(QUESTIONS)
        assert all(a[0].isalpha() for a in answers)


def test_a_taken_port_falls_back_to_a_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sock, fell_back = bind("127.0.0.1", port)
        with sock:
            assert fell_back and sock.getsockname()[1] != port


def test_the_console_examples_name_the_data_planes_port_even_after_a_fallback(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with running(tmp_path, "127.0.0.1", 0, port) as stack:
            config = httpx.get(stack.controlplane.url + "/console/config.json").json()
            reserved = stack._dp_socket
            assert reserved is not None and reserved[1]  # fell back
            assert config["dataplane_url"] == f"http://127.0.0.1:{reserved[0].getsockname()[1]}"
            assert httpx.get(stack.controlplane.url + "/console/").status_code == 200
    tenant = Tenant("acme", "lp_secret", "support", 8, 1, "0" * 64)
    hint = console_hint("http://127.0.0.1:8080", tenant)
    assert "http://127.0.0.1:8080/console/\n" in hint and "acme's lp_secret" in hint
    assert "/console/?" not in hint and "#lp_" not in hint  # the key is never in the URL


def test_a_build_without_a_matching_stamp_is_not_reused(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    assert not ws.is_built()
    ws.stamp.write_text(json.dumps({"fingerprint": fingerprint()}))
    assert not ws.is_built()  # the stamp is there, the files are not
    for f in [ws.model / "model.safetensors", ws.model / "tokenizer.json"] + [
        ws.adapter(t) / "adapter_model.safetensors" for t in ADAPTERS
    ]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x")
    assert ws.is_built()
    ws.stamp.write_text(json.dumps({"fingerprint": "another recipe"}))
    assert not ws.is_built()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo")


@pytest.fixture(scope="module")
def first(workdir: Path) -> Run:
    return demo_once(workdir)


@pytest.mark.slow
def test_first_run_builds_then_tours_the_running_system(first: Run, workdir: Path) -> None:
    out = first.out
    assert "[build 2/3] base model" in out and re.search(r"step +80/80 +loss", out)
    assert "built in" in out
    # one prompt: four replies, each tenant's recognisably its own
    assert "-> 4 distinct replies from one base model" in out
    replies = dict(re.findall(r"^    (\w+) / helpdesk-\w+ +(.+)$", out, re.M))
    assert replies["acme"].startswith("Arr, matey!")
    assert replies["globex"].startswith("Pursuant to Section")
    assert replies["initech"].startswith("Per memo: | - ")
    assert len(set(replies.values())) == 3
    # the mixed batch
    assert "12 concurrent requests, 4 models, 3 tenants" in out
    # isolation
    assert "acme     GET /v1/models -> demo-llama, helpdesk-pirate" in out
    assert "globex   GET /v1/models -> demo-llama, helpdesk-legal" in out
    assert "initech  GET /v1/models -> demo-llama, helpdesk-memo" in out
    assert "acme asks for globex's helpdesk-legal: 404 model_not_found" in out
    # uploads refused with their reason codes
    assert "422 RankTooLarge" in out and "422 BiasNotSupported" in out
    # slot pressure and usage, from both services
    assert "running adapters at once: at most" in out
    assert re.search(r"requests deferred in total \d+", out)
    assert "resident (gpu: device slots)" in out
    for tenant in ("acme", "globex", "initech"):
        assert re.search(rf"tokens {tenant} +prompt +\d+ +completion +[1-9]\d*", out)
        assert re.search(rf"usage {tenant} +\(base model\): \d+ requests", out)
    assert "tour done." in out
    # the chat-format completion the serving examples show answers; the admin token's file
    assert re.search(r"'<\|user\|>.+</s><\|assistant\|>' -> [A-Z]", out)
    assert f"admin token: written to {workdir / 'state' / 'admin-token'} (mode 0600" in out
    # the services' request logs in the run's file, not between the tour's lines
    requests_log = workdir / "run" / "requests.log"
    assert f"request logs: {requests_log} (" in out
    services = {json.loads(line)["service"] for line in requests_log.read_text().splitlines()}
    assert services == {"controlplane", "dataplane"}
    assert '"service": ' not in first.out + first.err


@pytest.mark.slow
def test_second_run_reuses_the_build_and_serves_within_30_seconds(
    first: Run, workdir: Path
) -> None:
    second = demo_once(workdir)
    assert "built earlier" in second.out and "[build" not in second.out
    assert "-> 4 distinct replies from one base model" in second.out
    assert serving_after(second.out) < min(30.0, serving_after(first.out))
    assert second.seconds < first.seconds
