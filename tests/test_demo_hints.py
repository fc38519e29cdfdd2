"""What the demo tells a user to paste works: the demo's model is chat-trained, so its serving
examples say so and give a completions example in the chat format, which answers (a bare
question gets an empty reply: the negative control); the admin token stays in its file.

The model is the demo's own base model, built and trained here as `loraplane demo` builds it
(the tokenizer and the base, not the adapters: about 20 s on two cores), served by the data
plane in standalone mode."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from loraplane.dataplane.server.app import create_app
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.demo import corpus, train, workspace
from loraplane.demo.build import build_tokenizer
from loraplane.demo.examples import CHAT_HINT, show_examples
from loraplane.demo.provision import Tenant
from loraplane.demo.tour import TourFailed, chat_format_completion
from loraplane.demo.workspace import BASE_NAME, Workspace
from tests.dataplane.server.conftest import wait_ready
from tests.servers import serve_in_thread

KEY = "lp_" + "d" * 43
QUESTION = corpus.QUESTIONS[1]


@pytest.fixture(scope="module")
def demo_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tokenizer and trained base model, as `workspace.build` makes them."""
    ws = Workspace(tmp_path_factory.mktemp("demo-base"))
    texts = [t for style in corpus.STYLES for t in corpus.corpus(style)]
    vocab = build_tokenizer(ws.model, vocab_size=workspace.VOCAB_SIZE, corpus=texts)
    with workspace._training_env():
        train.train_base(ws.model, vocab, workspace.SEED, lambda _: None)
    return ws.model


@pytest.fixture(scope="module")
def dataplane(demo_base: Path) -> Iterator[str]:
    settings = ServerSettings(
        model=str(demo_base), served_model_name=BASE_NAME, device="cpu", dtype="float32",
        api_key=KEY, num_kv_blocks=128, metrics_port=0, gateway_metrics_port=0,
    )  # fmt: skip
    with serve_in_thread(create_app(settings)) as url:
        wait_ready(url, timeout=120)
        yield url


def printed_examples(dp_url: str, token_file: Path, capsys: pytest.CaptureFixture[str]) -> str:
    tenant = Tenant("acme", KEY, "helpdesk-pirate", 8, 1, "0" * 64)
    show_examples(dp_url, "http://127.0.0.1:8080", token_file, BASE_NAME, {"acme": tenant},
                  metrics_url="http://127.0.0.1:8002")  # fmt: skip
    return capsys.readouterr().out


def completions_command(out: str) -> list[str]:
    """The printed `curl .../v1/completions` command, as the shell would split it."""
    start = out.index("curl -s ", out.index(CHAT_HINT))
    end = out.index("\n\n", start)
    return shlex.split(out[start:end].replace("\\\n", " "))


def test_the_printed_completions_example_answers_on_the_demos_model(
    dataplane: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = printed_examples(dataplane, tmp_path / "admin-token", capsys)
    assert "chat-trained" in out and "<|user|>QUESTION</s><|assistant|>" in out
    argv = completions_command(out)
    assert argv[2] == dataplane + "/v1/completions"
    body = json.loads(argv[argv.index("-d") + 1])
    header = argv[argv.index("-H") + 1]
    name, _, value = header.partition(": ")
    reply = httpx.post(argv[2], json=body, headers={name: value}, timeout=60)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    assert text.strip() == corpus.STYLES["base"][1]  # what the base was trained to answer


def test_a_bare_question_gets_an_empty_reply_which_is_why_the_hint_exists(
    dataplane: str,
) -> None:
    body = {"model": BASE_NAME, "prompt": QUESTION, "temperature": 0, "max_tokens": 64}
    reply = httpx.post(dataplane + "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
    assert reply.json()["choices"][0]["text"] == ""


def test_the_tours_chat_format_completion_is_not_empty(dataplane: str) -> None:
    client = openai.OpenAI(base_url=dataplane + "/v1", api_key=KEY, max_retries=0)
    assert chat_format_completion(BASE_NAME, client, QUESTION).strip()

    class Silent:  # a server that answers nothing: the tour's check fails
        class completions:  # noqa: N801
            @staticmethod
            def create(**_: object) -> SimpleNamespace:
                return SimpleNamespace(choices=[SimpleNamespace(text="")])

    with pytest.raises(TourFailed, match="came back empty"):
        chat_format_completion(BASE_NAME, Silent(), QUESTION)  # type: ignore[arg-type]


def test_the_examples_name_the_admin_tokens_file_never_the_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / ".loraplane" / "admin-token"
    out = printed_examples("http://127.0.0.1:8000", token_file, capsys)
    assert f"admin token (control plane): in {token_file} (mode 0600)" in out
    assert f'-H "Authorization: Bearer $(cat {token_file})"' in out
