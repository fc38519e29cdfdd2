"""tool_choice "auto" with each `--tool-call-parser` through the openai client, streaming and
not: the model is made to write its family's call text (a regex constraint stands in for a
model trained to call tools), and the answer carries the calls in OpenAI's shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from loraplane.dataplane.server.protocol import ChatCompletionRequest
from tests.dataplane.server.conftest import API_KEY, server_settings, start_server
from tests.dataplane.server.test_tools import CHAT, TIME, WEATHER

OSLO = {"city": "Oslo", "days": 3}
# (parser, what the model writes, the content, the calls)
CASES: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ("llama3_json", 'Let me check.\n{"name": "get_weather", "parameters": {"city": "Oslo", '
     '"days": 3}}', "Let me check.", [("get_weather", OSLO)]),
    ("mistral", 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 3}',
     "Let me check.", [("get_weather", OSLO)]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]', None,
     [("get_time", {"zone": "UTC"})]),
    ("pythonic", '[get_weather(city="Oslo", days=3), get_time(zone="CET")]', None,
     [("get_weather", OSLO), ("get_time", {"zone": "CET"})]),
]  # fmt: skip


NOT_CALLS = {
    "llama3_json": '{"name": "Oslo", "population": 709000}',  # JSON, not a call
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": ]',  # malformed
    "pythonic": '[get_weather("Oslo")]',  # positional
}


def _literal(text: str) -> str:
    """A regex that matches `text` only."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in text)


@pytest.fixture(scope="module", params=["llama3_json", "mistral", "pythonic"])
def parser_server(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, adapter_names: dict[str, Path]
) -> Iterator[tuple[str, OpenAI]]:
    settings = server_settings(tiny_llama_dir, adapter_names, tool_call_parser=request.param)
    with start_server(settings) as (url, _):
        yield request.param, OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def test_auto_reads_each_familys_calls_out_of_the_text(parser_server: tuple[str, OpenAI]) -> None:
    parser, client = parser_server
    for case_parser, text, content, expected in CASES:
        if case_parser != parser:
            continue
        args: dict[str, Any] = {
            "model": "ad02", "messages": CHAT, "tools": [WEATHER, TIME], "max_tokens": 160,
            "extra_body": {"structured_outputs": {"regex": _literal(text)}},
        }  # fmt: skip
        out = client.chat.completions.create(**args).choices[0]
        assert out.finish_reason == "tool_calls"
        assert out.message.content == content
        calls = out.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
        assert all(c.type == "function" and c.id for c in calls)
        if parser == "mistral":
            assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)

        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            **args,
        ))  # fmt: skip
        entries = [c.choices[0] for c in chunks if c.choices]
        assert "".join(e.delta.content or "" for e in entries) == (content or "")
        deltas = [t for e in entries for t in (e.delta.tool_calls or [])]
        assert [d.index for d in deltas] == list(range(len(expected)))
        assert [(d.function.name, json.loads(d.function.arguments or ""))
                for d in deltas if d.function] == expected  # fmt: skip
        assert all(d.id and d.type == "function" for d in deltas)
        assert entries[-1].finish_reason == "tool_calls"
        # usage on every chunk, the last one's as the request's
        assert all(c.usage is not None for c in chunks)
        final = chunks[-1].usage
        assert not chunks[-1].choices and final is not None
        assert chunks[-2].usage is not None
        assert chunks[-2].usage.completion_tokens == final.completion_tokens > 0


def test_text_that_is_not_a_call_stays_the_content(parser_server: tuple[str, OpenAI]) -> None:
    parser, client = parser_server
    text = NOT_CALLS[parser]
    args: dict[str, Any] = {
        "model": "ad02", "messages": CHAT, "tools": [WEATHER, TIME], "max_tokens": 160,
        "extra_body": {"structured_outputs": {"regex": _literal(text)}},
    }  # fmt: skip
    out = client.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "stop"
    assert out.message.content == text and not out.message.tool_calls
    entries = [c.choices[0] for c in client.chat.completions.create(stream=True, **args)
               if c.choices]  # fmt: skip
    assert "".join(e.delta.content or "" for e in entries) == text
    assert not any(e.delta.tool_calls for e in entries)
    assert entries[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("parser", "choice", "asked", "kept"),
    [
        ("mistral", None, None, False),  # [TOOL_CALLS] is a special token: kept for the parser
        ("mistral", None, True, True),  # what the client says wins
        ("mistral", "required", None, True),  # forced calls are not parsed out of text
        ("hermes", None, None, True),
    ],
)
def test_the_mistral_parser_keeps_special_tokens_unless_told(
    parser: str, choice: str | None, asked: bool | None, kept: bool
) -> None:
    fields: dict[str, Any] = {"model": "ad02", "messages": CHAT, "tools": [WEATHER, TIME]}
    if choice is not None:
        fields["tool_choice"] = choice
    if asked is not None:
        fields["skip_special_tokens"] = asked
    body = ChatCompletionRequest(**fields)
    body.tool_plan(parser)
    assert body.skip_special_tokens is kept
