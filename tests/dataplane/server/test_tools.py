"""Tool calling: the hermes parser on its own (pure logic), then `tools` and every
`tool_choice` through the OpenAI API with the openai client, streaming and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from loraplane.dataplane.server import tools
from loraplane.dataplane.server.tools import HermesStream, Tool, ToolPlan, ToolStream, hermes_calls
from tests.dataplane.server.conftest import API_KEY, Running, server_settings, start_server

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                           "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
CHAT: Any = [{"role": "user", "content": "Weather in Paris?"}]


def test_hermes_blocks_become_calls_and_the_rest_content() -> None:
    text = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
            '</tool_call> and <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            " <tool_call>not json</tool_call>")  # fmt: skip
    content, calls = hermes_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {}),
    ]
    assert content == "Sure.  and  <tool_call>not json</tool_call>"
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert hermes_calls("plain") == ("plain", [])


def test_hermes_stream_holds_back_only_what_may_start_a_call() -> None:
    stream = HermesStream()
    pieces = ["Hello <to", "ol_call>{\"name\": \"get_time\", ", '"arguments": {"zone": "UTC"}}',
              "</tool_call> bye <", "x"]  # fmt: skip
    sent, calls = "", []
    for i, piece in enumerate(pieces):
        content, found = stream.feed(piece, final=i == len(pieces) - 1)
        sent += content
        calls += found
    assert sent == "Hello  bye <x"
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone":"UTC"}')]
    unclosed = HermesStream()
    assert unclosed.feed("a <tool_call>{", final=False) == ("a ", [])
    assert unclosed.feed('"x"', final=True) == ('<tool_call>{"x"', [])


def _required(parallel: bool = True) -> ToolPlan:
    plan = tools.plan([Tool.model_validate(t) for t in (WEATHER, TIME)], "required", parallel,
                      None)  # fmt: skip
    assert plan is not None
    return plan


def test_required_bounds_the_array_and_reads_the_calls_of_a_cut_one() -> None:
    assert tools.MAX_REQUIRED_CALLS == 8
    for parallel, most in ((True, tools.MAX_REQUIRED_CALLS), (False, 1)):
        constraint = _required(parallel).constraint
        assert constraint is not None
        schema = json.loads(constraint.spec)
        assert (schema["minItems"], schema["maxItems"]) == (1, most)
    whole = '[{"name":"get_time","parameters":{"zone":"UTC"}}, {"name":"get_weather",' \
            '"parameters":{"city":"Oslo","days":2}}]'  # fmt: skip
    cut = whole[:-20]  # inside the second call
    content, calls = _required().calls(whole)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"zone":"UTC"}'), ("get_weather", '{"city":"Oslo","days":2}'),
    ]  # fmt: skip
    assert [(c.name, c.arguments) for c in _required().calls(cut)[1]] == [
        ("get_time", '{"zone":"UTC"}')
    ]
    assert _required().calls('[{"name":"get_ti')[1] == [] and _required().calls("")[1] == []
    # streamed: each call once its element is closed, never twice
    stream, sent = ToolStream(_required()), []
    for i, piece in enumerate([whole[:30], whole[30:48], whole[48:60], whole[60:]]):
        sent.append([c.name for c in stream.feed(piece, finished=i == 3)[1]])
    assert sent == [[], ["get_time"], [], ["get_weather"]]
    assert stream.finish_reason("stop") == "tool_calls"
    cut_stream = ToolStream(_required())
    assert [c.name for c in cut_stream.feed(cut, finished=True)[1]] == ["get_time"]
    assert cut_stream.finish_reason("length") == "length"


@pytest.fixture
def client(server: Running) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7


def test_a_named_tool_choice_forces_that_call(client: OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "ad03", "messages": CHAT, "tools": [WEATHER, TIME], "max_tokens": 60,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 1,
    }  # fmt: skip
    out = client.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "stop" and out.message.content is None
    (call,) = out.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    _check_weather(call.function.arguments)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **args)
              if c.choices]  # fmt: skip
    streamed = [t for d in deltas for t in (d.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].index == 0 and streamed[0].id
    assert streamed[0].function is not None
    assert streamed[0].function.arguments == call.function.arguments


def test_required_makes_calls_of_the_listed_tools_only(client: OpenAI) -> None:
    for parallel in (True, False):
        out = client.chat.completions.create(
            model="ad04", messages=CHAT, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=120, seed=5,
        ).choices[0]  # fmt: skip
        calls: list[Any] = list(out.message.tool_calls or [])
        # cut at max_tokens, the calls completed before the cut still come back
        assert out.finish_reason in ("tool_calls", "length") and calls
        assert len(calls) == 1 or parallel
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                _check_weather(call.function.arguments)


def test_none_answers_in_text_and_earlier_tool_turns_are_accepted(client: OpenAI) -> None:
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
         "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    out = client.chat.completions.create(
        model="ad01", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=5,
    ).choices[0]  # fmt: skip
    assert out.message.tool_calls is None and isinstance(out.message.content, str)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [WEATHER]}, "tool_choice"),  # auto without a parser
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [WEATHER["function"]]}, "functions"),
    ],
)  # fmt: skip
def test_tool_requests_that_cannot_be_served_are_400s(
    server: Running, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "ad01", "messages": CHAT, "max_tokens": 4, **extra}
    r = httpx.post(server.v1 + "/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def hermes_server(tiny_llama_dir: Path, adapter_names: dict[str, Path]) -> Iterator[str]:
    settings = server_settings(tiny_llama_dir, adapter_names, tool_call_parser="hermes")
    with start_server(settings) as (url, _):
        yield url


def test_auto_reads_hermes_calls_out_of_the_text(hermes_server: str) -> None:
    """The model is made to write a hermes block (a regex constraint stands in for a model
    trained to call tools): the call comes back parsed, and the text around it as content."""
    client = OpenAI(base_url=hermes_server + "/v1", api_key=API_KEY, max_retries=0)
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'
    pattern = "Let me check\\. " + block.replace("{", "\\{").replace("}", "\\}") + "</tool_call>"
    args: dict[str, Any] = {
        "model": "ad02", "messages": CHAT, "tools": [WEATHER, TIME], "max_tokens": 200,
        "extra_body": {"structured_outputs": {"regex": pattern}},
    }  # fmt: skip
    out = client.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content == "Let me check."
    (call,) = out.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 3}
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **args)
              if c.choices]  # fmt: skip
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.delta.tool_calls or [])]
    assert content.strip() == "Let me check."
    assert len(calls) == 1 and calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert chunks[-1].finish_reason == "tool_calls"


REQUIRED: Any = {
    "model": "ad04", "messages": CHAT, "tools": [WEATHER, TIME], "tool_choice": "required",
    "seed": 34,
}  # fmt: skip


def _streamed(client: OpenAI, **args: Any) -> tuple[list[Any], str | None]:
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **args)
              if c.choices]  # fmt: skip
    assert all(c.delta.content in (None, "") for c in chunks)
    return [t for c in chunks for t in (c.delta.tool_calls or [])], chunks[-1].finish_reason


def test_required_cut_at_max_tokens_answers_the_calls_completed(client: OpenAI) -> None:
    """Seed 34 lists 4 calls (185 tokens) when it may: cut at 100 tokens, the 2 calls
    completed by then come back, with finish_reason "length"; streaming the same."""
    whole = client.chat.completions.create(max_tokens=220, **REQUIRED).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls or []) == 4
    out = client.chat.completions.create(max_tokens=100, **REQUIRED).choices[0]
    assert out.finish_reason == "length" and out.message.content is None
    calls: list[Any] = list(out.message.tool_calls or [])
    assert len(calls) == 2
    expected = [(c.function.name, c.function.arguments) for c in (whole.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == expected[:2]
    streamed, reason = _streamed(client, max_tokens=100, **REQUIRED)
    assert reason == "length"
    assert [t.index for t in streamed] == [0, 1] and all(t.id for t in streamed)
    assert [(t.function.name, t.function.arguments) for t in streamed] == expected[:2]


def test_required_closes_the_array_at_its_cap(
    client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the cap lowered to 2, seed 34 (4 calls uncapped) gets its array closed after its
    second call: finish_reason "tool_calls", streaming the same."""
    monkeypatch.setattr(tools, "MAX_REQUIRED_CALLS", 2)
    out = client.chat.completions.create(max_tokens=220, **REQUIRED).choices[0]
    assert out.finish_reason == "tool_calls" and len(out.message.tool_calls or []) == 2
    streamed, reason = _streamed(client, max_tokens=220, **REQUIRED)
    assert reason == "tool_calls" and [t.index for t in streamed] == [0, 1]


def test_required_in_the_responses_api_keeps_the_calls_of_a_cut_output(client: OpenAI) -> None:
    """The Responses API reads its calls the same way: cut at max_output_tokens, the response
    is incomplete and holds the calls completed before the cut; streaming the same."""
    fns = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    args: Any = {
        "model": "ad04", "input": "Weather in Paris?", "tools": fns, "tool_choice": "required",
        "temperature": 1.0, "extra_body": {"seed": 34},
    }  # fmt: skip
    whole = client.responses.create(max_output_tokens=220, **args)
    assert whole.status == "completed"
    calls = [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    assert len(calls) == len(whole.output) == 4
    cut = client.responses.create(max_output_tokens=100, **args)
    assert cut.status == "incomplete"
    assert [(o.name, o.arguments) for o in cut.output if o.type == "function_call"] == calls[:2]
    events = list(client.responses.create(stream=True, max_output_tokens=100, **args))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(o.name, o.arguments) for o in done if o.type == "function_call"] == calls[:2]
    assert events[-1].type == "response.incomplete"
