"""With the engine in a process of its own, the engine only runs the model: its Step messages
carry token ids, no text; the API server's process makes the text and checks stop strings, and
a stop string it finds aborts the engine's sequence (once), which frees its KV blocks. What
clients get is the same as with the engine on a thread (`--engine-process off`): texts, finish
reasons, logprobs and usage, streamed or not, with stop strings, include_stop_str_in_output,
stop tokens, min_tokens and multi-byte UTF-8 split across tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplane.dataplane.engine_messages import Step
from loraplane.dataplane.engine_process import ProcessEngine
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.snapshot import EngineSnapshot
from tests.dataplane.server.conftest import API_KEY, server_settings, start_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "the quick brown fox"
MULTI_BYTE = "東京 Grüße naïve café 🎉"  # the tokenizer splits some of these characters
KEPT = {"include_stop_str_in_output": True}
GREEDY = {"model": "tiny-llama", "prompt": PROMPT, "temperature": 0, "max_tokens": 40,
          "ignore_eos": True}  # fmt: skip


@dataclass
class Pipe:
    """What crossed the engine process's pipe: the Steps' outputs, and the aborts sent."""

    outputs: list[Any] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


@dataclass
class Pair:
    on: str  # the server with its engine in a process
    off: str  # the server with its engine on a thread
    engine: ProcessEngine
    pipe: Pipe
    bias: dict[str, float]  # logit_bias towards the tokens of multi-byte characters


def _watch(engine: ProcessEngine) -> Pipe:
    pipe = Pipe()
    on_step, send = engine._on_step, engine._send

    def step(message: Step) -> None:
        pipe.outputs += message.outputs
        on_step(message)

    def sent(message: tuple[Any, ...]) -> None:
        if message[0] == "abort":
            pipe.aborts.append(message[1])
        send(message)

    setattr(engine, "_on_step", step)  # noqa: B010 (an instance's method, wrapped)
    setattr(engine, "_send", sent)  # noqa: B010
    return pipe


@pytest.fixture(scope="module")
def pair(tiny_llama_dir: Path) -> Iterator[Pair]:
    with contextlib.ExitStack() as stack:
        servers: dict[bool, tuple[str, Runtime]] = {}
        for mode in (True, False):
            settings = server_settings(tiny_llama_dir, {}, engine_process=mode)
            servers[mode] = stack.enter_context(start_server(settings))
        engine = servers[True][1].engine
        assert isinstance(engine, ProcessEngine)
        ids = engine.tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
        assert any("\ufffd" in engine.tokenizer.decode([i]) for i in ids)  # split characters
        bias = {str(i): 4.0 for i in ids}
        yield Pair(servers[True][0], servers[False][0], engine, _watch(engine), bias)


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1" + path, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's chunks, each with its usage so far (ids and times left out), per
    choice in order (choices interleave as their steps come), the usage chunk last."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**body, "stream": True, "stream_options": options}
    r = httpx.post(url + "/v1" + path, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    chunks = [e for e in r.text.split("\n\n") if e]
    assert chunks[-1] == "data: [DONE]"
    parsed = [json.loads(e[len("data: ") :]) for e in chunks[:-1]]
    chunks_of = [{"choices": c["choices"], "usage": c.get("usage")} for c in parsed]
    return sorted(chunks_of, key=lambda c: [e["index"] for e in c["choices"]] or [1 << 30])


def snapshot(engine: ProcessEngine) -> EngineSnapshot:
    async def read() -> EngineSnapshot:
        return await engine.command("snapshot")  # type: ignore[no-any-return]

    return asyncio.run(read())


def probe(pair: Pair, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The thread server's answer, asked of both (their prefix caches stay alike)."""
    post(pair.on, path, body)
    return post(pair.off, path, body)


def greedy_text(pair: Pair) -> str:
    return str(probe(pair, "/completions", GREEDY)["choices"][0]["text"])


def clean_stop(text: str, *, multi_byte: bool = False) -> str:
    """A few characters of `text` after its start, none of them U+FFFD (a broken character);
    with `multi_byte`, one of them a whole multi-byte character."""
    for i in range(4, len(text) - 2):
        piece = text[i : i + 2]
        if "\ufffd" not in piece and (piece.isascii() != multi_byte) and piece.strip():
            return piece
    raise AssertionError(f"no stop string to pick from {text!r}")


def test_the_engine_process_sends_token_ids_and_no_text(pair: Pair) -> None:
    before = len(pair.pipe.outputs)
    body = {**GREEDY, "logprobs": 1}
    text = post(pair.on, "/completions", body)["choices"][0]["text"]
    crossed = pair.pipe.outputs[before:]
    assert text and len(crossed) == 40
    assert all(out.text == "" and len(out.token_ids) == 1 for out in crossed)
    assert all(out.logprobs for out in crossed)  # what only the engine knows still crosses


def test_a_stop_string_found_by_the_server_aborts_the_engine_sequence_once(pair: Pair) -> None:
    full = greedy_text(pair)
    stop = clean_stop(full)
    free = snapshot(pair.engine).kv_blocks_free
    aborts = len(pair.pipe.aborts)
    body = {**GREEDY, "max_tokens": 240, "stop": [stop]}
    choice = post(pair.on, "/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.index(stop)]
    assert len(pair.pipe.aborts) == aborts + 1  # one abort, for the one sequence
    after = snapshot(pair.engine)  # the abort went before this command: it ran first
    assert after.running == 0 and after.waiting == 0
    assert after.kv_blocks_free == free  # its blocks are back


def _cases(pair: Pair) -> dict[str, tuple[str, dict[str, Any]]]:
    full = greedy_text(pair)
    stop = clean_stop(full)
    sampled = {**GREEDY, "temperature": 1.0, "seed": 7, "logit_bias": pair.bias}
    multi = clean_stop(probe(pair, "/completions", sampled)["choices"][0]["text"],
                       multi_byte=True)  # fmt: skip
    before = len(pair.pipe.outputs)
    probe(pair, "/completions", GREEDY)
    stop_token = pair.pipe.outputs[before + 6].token_ids[0]  # the 7th greedy token's id
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0, "max_tokens": 40, "ignore_eos": True}  # fmt: skip
    chat_stop = clean_stop(probe(pair, "/chat/completions", chat)["choices"][0]["message"]
                           ["content"])  # fmt: skip
    return {
        "stop-logprobs": ("/completions", {**GREEDY, "stop": [stop], "logprobs": 2}),
        "stop-kept": ("/completions", {**GREEDY, "stop": [stop], **KEPT}),
        # the stop string's first place is before min_tokens: it does not count there
        "stop-after-min-tokens": ("/completions", {**GREEDY, "stop": [stop], "min_tokens": 12}),
        "multi-byte": ("/completions", {**sampled, "logprobs": 1}),
        "stop-multi-byte": ("/completions", {**sampled, "stop": [multi], "n": 2}),
        "stop-multi-byte-kept": ("/completions", {**sampled, "stop": [multi], **KEPT}),
        "stop-token": ("/completions", {**GREEDY, "stop_token_ids": [stop_token]}),
        "stop-token-kept": ("/completions", {**GREEDY, "stop_token_ids": [stop_token], **KEPT}),
        "chat-stop": ("/chat/completions", {**chat, "stop": [chat_stop], "logprobs": True}),
    }


def test_answers_are_the_same_with_the_engine_in_a_process_or_on_a_thread(pair: Pair) -> None:
    stopped = 0
    for name, (path, body) in _cases(pair).items():
        on, off = post(pair.on, path, body), post(pair.off, path, body)
        assert (on["choices"], on["usage"]) == (off["choices"], off["usage"]), name
        assert events(pair.on, path, body) == events(pair.off, path, body), name
        stopped += any(c["finish_reason"] == "stop" for c in on["choices"])
        assert on["usage"]["completion_tokens"] <= 40 * len(on["choices"])
    assert stopped >= 7  # the stop strings and stop tokens did end their answers early
