"""The tool-call parsers llama3_json, mistral and pythonic on their own (pure logic): the
formats those families' chat templates make the models write, what stays content, and the
stream, fed in any pieces, finding exactly what the whole text finds."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from loraplane.dataplane.server.tool_parsers import PARSERS, parse, pythonic_calls
from loraplane.dataplane.server.tools import ToolCall, ToolPlan, ToolStream

Expected = list[tuple[str, dict[str, Any]]]
WEATHER_OSLO = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}'

# (parser, model output, content, calls): realistic outputs of each family's template
CALLS: list[tuple[str, str, str | None, Expected]] = [
    # Llama 3.1/3.2/3.3 JSON tool calling: the JSON object is the whole answer
    ("llama3_json", WEATHER_OSLO, None, [("get_weather", {"city": "Oslo", "days": 3})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}', None,
     [("get_weather", {"city": "Paris", "days": 1})]),
    ("llama3_json", WEATHER_OSLO + '; {"name": "get_time", "parameters": {"zone": "UTC"}}', None,
     [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {"zone": "UTC"})]),
    ("llama3_json", "Let me look that up.\n" + WEATHER_OSLO, "Let me look that up.",
     [("get_weather", {"city": "Oslo", "days": 3})]),
    ("llama3_json", '  {"type": "function", "name": "note", "parameters": {"text": "a } b {"}}',
     None, [("note", {"text": "a } b {"})]),
    ("llama3_json", '{"name": "get_time", "parameters": {}};', None, [("get_time", {})]),
    # Mistral v0.3 tokenizer: [TOOL_CALLS] then a JSON array
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     None, [("get_weather", {"city": "Paris", "days": 2})]),
    ("mistral", 'Checking both. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
     '"days": 1}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', "Checking both.",
     [("get_weather", {"city": "Oslo", "days": 1}), ("get_time", {"zone": "UTC"})]),
    ("mistral", '[{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}]', None,
     [("get_time", {"zone": "CET"})]),  # the marker dropped, the arguments as JSON text
    # Mistral tokenizer v11+: [TOOL_CALLS]name[ARGS]{...} per call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', None,
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 5}[TOOL_CALLS]get_time'
     '[ARGS]{"zone": "CET"}', "Sure.",
     [("get_weather", {"city": "Oslo", "days": 5}), ("get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "UTC"}', None,
     [("get_time", {"zone": "UTC"})]),
    # Llama 3.2 / Llama 4 pythonic
    ("pythonic", '[get_weather(city="Paris", days=2)]', None,
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("pythonic", "[get_weather(city='Oslo', days=3), get_time(zone=\"UTC\")]", None,
     [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {"zone": "UTC"})]),
    ("pythonic", '<|python_start|>[get_time(zone="CET")]<|python_end|>', None,
     [("get_time", {"zone": "CET"})]),
    ("pythonic", '[search(filters={"tags": ["a", "b"], "limit": 5, "exact": False, "after": None},'
     ' scores=(0.5, -1), query="x ] y ) z \\" w")]', None,
     [("search", {"filters": {"tags": ["a", "b"], "limit": 5, "exact": False, "after": None},
                  "scores": [0.5, -1], "query": 'x ] y ) z " w'})]),
    ("pythonic", '[write(text="""a "quoted" ] word\n""", path=\'\'\'x\'\'\')]', None,
     [("write", {"text": 'a "quoted" ] word\n', "path": "x"})]),
    ("llama3_json", '{"name": "write", "parameters": {"text": "a \\\\\\" } \\\\"}}', None,
     [("write", {"text": 'a \\" } \\'})]),
    ("pythonic", "I will check.\n[get_time()]\nOne moment.", "I will check.\n\nOne moment.",
     [("get_time", {})]),
]  # fmt: skip

# (parser, model output): not calls of the format, so the whole text is the content
CONTENT: list[tuple[str, str]] = [
    ("llama3_json", "The weather in Oslo is mild."),
    ("llama3_json", '{"name": "Oslo", "population": 709000}'),  # JSON, but not a call
    ("llama3_json", 'Call it as {"name": "get_time", "parameters": {}} mid-line.'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": }}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"'),  # cut short
    ("llama3_json", '{"name": "x", "parameters": {}, "arguments": {}}'),
    ("llama3_json", '<|python_tag|>brave_search.call(query="Oslo weather")'),  # a built-in tool
    ("mistral", "Paris is sunny. [docs](https://example.org)\n[1] a footnote"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": }'),
    ("mistral", "[TOOL_CALLS] [1, 2]"),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": 3}]'),
    ("mistral", "[TOOL_CALLS] sorry"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[get_weather(city)]"),  # a name, not a literal
    ("pythonic", '[get_weather("Paris")]'),  # positional
    ("pythonic", "[get_weather(**kwargs)]"),
    ("pythonic", '[os.system(cmd="ls")]'),
    ("pythonic", '[get_weather(city="Paris"), 2]'),
    ("pythonic", '[f(a=b"bytes")]'),
    ("pythonic", "[f(a=1e999)]"),
    ("pythonic", "[f(a={1, 2})]"),
    ("pythonic", "[f(a=lambda: 1)]"),
    ("pythonic", '[get_weather(city="Paris"'),  # cut short
    ("pythonic", "See [the docs](https://example.org) for more."),
]


def _shape(calls: list[ToolCall]) -> Expected:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "expected"), CALLS)
def test_template_outputs_become_calls_and_the_rest_content(
    parser: str, text: str, content: str | None, expected: Expected
) -> None:
    found, calls = parse(parser, text)
    assert found == content
    assert _shape(calls) == expected
    assert all(c.arguments == json.dumps(json.loads(c.arguments), separators=(",", ":"))
               for c in calls)  # fmt: skip
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize(("parser", "text"), CONTENT)
def test_what_is_not_a_call_of_the_format_stays_content(parser: str, text: str) -> None:
    assert parse(parser, text) == (text, [])


def test_ids_are_openai_style_except_mistral_whose_templates_need_9_alphanumerics() -> None:
    (llama,) = parse("llama3_json", WEATHER_OSLO)[1]
    (python,) = parse("pythonic", "[get_time()]")[1]
    assert llama.id.startswith("call_") and python.id.startswith("call_")
    (mistral,) = parse("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}')[1]
    assert len(mistral.id) == 9 and mistral.id.isalnum()
    (given,) = parse("mistral", "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}")[1]
    assert given.id == "a1B2c3D4e"


def test_pythonic_arguments_are_never_evaluated(tmp_path: Path) -> None:
    target = tmp_path / "made"
    text = f'[get_time(zone=__import__("os").mkdir("{target}"))]'
    assert pythonic_calls(text) is None and parse("pythonic", text) == (text, [])
    assert not target.exists()
    assert pythonic_calls("[" * 500 + "]" * 500) is None  # nesting the parser refuses: no crash


def _stream(parser: str, pieces: list[str]) -> tuple[str, list[ToolCall], str | None]:
    stream = ToolStream(ToolPlan("auto", [], parser=parser))
    content, calls = "", list[ToolCall]()
    for i, piece in enumerate(pieces):
        sent, found = stream.feed(piece, finished=i == len(pieces) - 1)
        content += sent
        calls += found
    return content, calls, stream.finish_reason("stop")


def _splits(text: str) -> list[list[str]]:
    """The text char by char, in random pieces (seeded), and whole."""
    out = [list(text), [text]]
    rng = random.Random(text)
    for _ in range(20):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[i : i + n])
            i += n
        out.append(pieces)
    return out


@pytest.mark.parametrize(
    ("parser", "text"), [(p, t) for p, t, _, _ in CALLS] + CONTENT
)  # fmt: skip
def test_the_stream_in_any_pieces_equals_the_whole_text(parser: str, text: str) -> None:
    content, calls = parse(parser, text)
    for pieces in _splits(text):
        streamed, found, reason = _stream(parser, pieces)
        assert streamed == (content or "")
        assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in calls]
        assert reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize(
    ("parser", "text", "shown"),
    [
        ("llama3_json", "It is sunny in Oslo today", "It is sunny in Oslo today"),
        ("llama3_json", "Checking <|python_ta", "Checking"),
        ("llama3_json", 'Checking.\n{"name": "get_ti', "Checking."),
        ("mistral", "Checking. [TOOL_CA", "Checking."),
        ("mistral", 'Checking. [TOOL_CALLS]get_time[ARGS]{"zo', "Checking."),
        ("pythonic", "Checking.\n[get_time(zone=", "Checking."),
        ("pythonic", "No call here, [see] it", "No call here, [see] it"),
    ],
)
def test_the_stream_holds_back_only_what_may_begin_a_call(
    parser: str, text: str, shown: str
) -> None:
    stream = ToolStream(ToolPlan("auto", [], parser=parser))
    sent = "".join(stream.feed(ch, finished=False)[0] for ch in text)
    assert sent == shown


def test_a_call_is_sent_as_soon_as_what_follows_cannot_change_it() -> None:
    stream = ToolStream(ToolPlan("auto", [], parser="mistral"))
    assert stream.feed('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"', False) == ("", [])
    content, calls = stream.feed("}", False)
    assert content == "" and [c.name for c in calls] == ["get_time"]
    llama = ToolStream(ToolPlan("auto", [], parser="llama3_json"))
    assert llama.feed(WEATHER_OSLO, False) == ("", [])  # a `;` and a second call may follow
    content, calls = llama.feed(" Done", False)
    assert content == "Done" and [c.name for c in calls] == ["get_weather"]


def test_every_parser_is_a_server_choice() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
