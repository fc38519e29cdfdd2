"""`stream_options.continuous_usage_stats` as vLLM sends it: with include_usage, every chunk
carries its choice's usage so far (its prompt's tokens, the tokens it generated up to that
chunk), and the final usage chunk still comes; without include_usage it does nothing."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx
from openai import OpenAI

from tests.dataplane.server.conftest import API_KEY, Running

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BOTH = {"include_usage": True, "continuous_usage_stats": True}
PROMPTS = ["the quick brown fox jumps", "hi"]


def _events(server: Running, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(server.v1 + path, json={"stream": True, **body}, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def _prompt_tokens(server: Running, prompt: str) -> int:
    body = {"model": "ad07", "prompt": prompt, "max_tokens": 1}
    r = httpx.post(server.v1 + "/completions", json=body, headers=HEADERS, timeout=60)
    return int(r.json()["usage"]["prompt_tokens"])


def test_every_completion_chunk_counts_its_choice_so_far_over_prompts_and_n(
    server: Running,
) -> None:
    body = {"model": "ad07", "prompt": PROMPTS, "n": 2, "max_tokens": 6, "logprobs": 0,
            "temperature": 0.9, "seed": 11, "ignore_eos": True, "stream_options": BOTH}  # fmt: skip
    chunks = _events(server, "/completions", body)
    lengths = [_prompt_tokens(server, p) for p in PROMPTS]
    assert lengths[0] > lengths[1]
    made: dict[int, int] = defaultdict(int)  # tokens seen so far per choice
    for chunk in chunks[:-1]:
        (entry,) = chunk["choices"]
        made[entry["index"]] += len(entry["logprobs"]["tokens"])  # one entry per token
        assert chunk["usage"] == {
            "prompt_tokens": lengths[entry["index"] // 2],
            "completion_tokens": made[entry["index"]],
            "total_tokens": lengths[entry["index"] // 2] + made[entry["index"]],
        }
    assert sorted(made) == [0, 1, 2, 3] and all(v == 6 for v in made.values())
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"]["prompt_tokens"] == sum(lengths)  # each prompt once, whatever n is
    assert final["usage"]["completion_tokens"] == 24
    assert "cached_tokens" in final["usage"]["prompt_tokens_details"]


def test_chat_chunks_with_the_openai_client_role_first_then_growing(server: Running) -> None:
    client = OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model="ad05", messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, seed=4,
        temperature=0.9, stream=True, stream_options=BOTH,  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    chunks = list(stream)
    final = chunks[-1].usage
    assert final is not None and not chunks[-1].choices
    last: dict[int, int] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is not None
        (choice,) = chunk.choices
        assert chunk.usage.prompt_tokens == final.prompt_tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        if choice.delta.role == "assistant":  # the role chunk: nothing generated yet
            assert chunk.usage.completion_tokens == 0
        assert chunk.usage.completion_tokens >= last.get(choice.index, 0)
        last[choice.index] = chunk.usage.completion_tokens
    assert sorted(last) == [0, 1]
    assert sum(last.values()) == final.completion_tokens > 0


def test_continuous_usage_needs_include_usage_as_in_vllm(server: Running) -> None:
    base = {"model": "ad03", "prompt": "fox", "max_tokens": 4, "temperature": 0}
    for off in (False, None):  # include_usage false or null: no usage anywhere
        chunks = _events(server, "/completions", {**base, "stream_options": {
                         "include_usage": off, "continuous_usage_stats": True}})  # fmt: skip
        assert chunks and all(c["choices"] and "usage" not in c for c in chunks)
    # include_usage left out: true once stream_options is given, as vLLM's default
    alone = _events(server, "/completions",
                    {**base, "stream_options": {"continuous_usage_stats": True}})  # fmt: skip
    assert all(c["usage"]["completion_tokens"] > 0 for c in alone)
    assert alone[-1]["choices"] == []
    plain = _events(server, "/completions", {**base, "stream_options": {**BOTH,
                    "continuous_usage_stats": False}})  # fmt: skip
    assert all(c["usage"] is None for c in plain[:-1])
    assert plain[-1]["usage"]["completion_tokens"] > 0
    assert "usage" not in _events(server, "/completions", base)[0]  # no stream_options
    r = httpx.post(server.v1 + "/chat/completions", headers=HEADERS, timeout=30, json={
        "model": "ad03", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "stream_options": BOTH})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_an_echo_only_stream_counts_the_prompt_and_no_completion(server: Running) -> None:
    body = {"model": "ad03", "prompt": "the quick brown fox", "max_tokens": 0, "echo": True,
            "stream_options": BOTH}  # fmt: skip
    chunks = _events(server, "/completions", body)
    prompt = _prompt_tokens(server, "the quick brown fox")
    assert len(chunks) >= 2 and chunks[-1]["choices"] == []
    for chunk in chunks:
        assert chunk["usage"]["prompt_tokens"] == prompt
        assert chunk["usage"]["completion_tokens"] == 0


def test_an_echoed_prompt_chunk_counts_no_token_before_the_first_is_shown(server: Running) -> None:
    body = {"model": "ad03", "prompt": "the quick brown fox", "max_tokens": 3, "echo": True,
            "logprobs": 0, "ignore_eos": True, "stream_options": BOTH}  # fmt: skip
    chunks = _events(server, "/completions", body)
    echo, *outputs, final = chunks
    assert echo["choices"][0]["text"] == "the quick brown fox"
    assert echo["usage"]["completion_tokens"] == 0
    assert [c["usage"]["completion_tokens"] for c in outputs] == [1, 2, 3]
    assert final["usage"]["completion_tokens"] == 3
