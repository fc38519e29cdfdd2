"""The Responses API (`POST /v1/responses`) with the openai client's `responses` methods against
a real server: text and message input, instructions, max_output_tokens, greedy answers equal to
chat's, streaming (raw events and the client's accumulating `responses.stream`), structured
outputs (`responses.parse`), function calls and their round trip, the 400s for what is not
served, nothing stored, tenant-scoped adapters, and a disconnect aborting the request."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from loraplane.dataplane.server import responses
from loraplane.dataplane.server.errors import Unavailable
from loraplane.dataplane.server.generation import run_job
from loraplane.dataplane.server.responses import messages
from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import SERVICE
from tests.dataplane.server.conftest import API_KEY, Running, server_settings, start_server
from tests.dataplane.server.test_load import scrape, total
from tests.test_e2e_catalog import BASE_NAME, POOL, controlplane, pool_and_tenants

GREEDY: Any = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}  # fmt: skip
TIME: Any = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False},
}  # fmt: skip


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false
    answer: Literal["yes", "no"]
    score: int = Field(ge=1, le=5)


@pytest.fixture
def client(server: Running) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)


def _as_chat(tool: dict[str, Any]) -> Any:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_text_input_is_chats_greedy_answer_in_a_response_object(client: OpenAI) -> None:
    out = client.responses.create(model="ad01", input="Many tenants share", max_output_tokens=9,
                                  store=False, metadata={"run": "1"}, **GREEDY)  # fmt: skip
    chat = client.chat.completions.create(
        model="ad01", messages=[{"role": "user", "content": "Many tenants share"}],
        max_completion_tokens=9, **GREEDY,
    )  # fmt: skip
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "ad01"
    assert out.output_text == chat.choices[0].message.content and out.output_text
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    # ignore_eos: it ran into max_output_tokens
    assert out.status == "incomplete" and item.status == "incomplete"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    usage, chat_usage = out.usage, chat.usage
    assert usage is not None and chat_usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (chat_usage.prompt_tokens, 9)
    assert usage.total_tokens == usage.input_tokens + 9
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0
    body = out.to_dict()
    assert body["store"] is False and body["metadata"] == {"run": "1"}
    assert body["temperature"] == 0 and body["max_output_tokens"] == 9
    assert body["tools"] == [] and body["tool_choice"] == "auto"
    assert body["text"] == {"format": {"type": "text"}}


def test_a_response_that_ends_on_its_own_is_completed(client: OpenAI) -> None:
    out = client.responses.create(
        model="ad02", input="Is it raining?", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "verdict", "strict": True,
                         "schema": Verdict.model_json_schema()}}, temperature=0,
    )  # fmt: skip
    assert out.status == "completed" and out.incomplete_details is None
    assert out.output[0].status == "completed"  # type: ignore[union-attr]
    Verdict.model_validate_json(out.output_text)


def test_messages_and_instructions_are_the_chat_template_of_the_same_conversation(
    client: OpenAI,
) -> None:
    given: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "How are you?"},
    ]  # fmt: skip
    out = client.responses.create(model="ad03", input=given, instructions="Be kind.",
                                  max_output_tokens=8, **GREEDY)  # fmt: skip
    chat = client.chat.completions.create(
        model="ad03", max_completion_tokens=8, **GREEDY,
        messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"},
                  {"role": "developer", "content": "Answer briefly."},
                  {"role": "user", "content": "How are you?"}],
    )  # fmt: skip
    assert out.output_text == chat.choices[0].message.content
    assert out.usage is not None and chat.usage is not None
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.instructions == "Be kind."
    # a different conversation is a different prompt (the negative control)
    other = client.responses.create(model="ad03", input=given[:1], instructions="Be kind.",
                                    max_output_tokens=8, **GREEDY)  # fmt: skip
    assert other.usage is not None and other.usage.input_tokens < out.usage.input_tokens


def test_a_stream_sends_typed_events_in_order_and_the_same_text(client: OpenAI) -> None:
    args: Any = {"model": "ad04", "input": "Streams of tokens", "max_output_tokens": 12, **GREEDY}
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text and len(deltas) > 1
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    last = events[-1].response
    assert last.output_text == text and last.id == events[0].response.id
    assert last.usage is not None and whole.usage is not None
    assert last.usage.output_tokens == whole.usage.output_tokens == 12
    # the client's accumulating helper
    with client.responses.stream(**args) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
    assert snapshots[-1] == text


def test_the_stream_helper_gives_the_final_response(client: OpenAI) -> None:
    """(It needs a response that ends on its own: a schema makes a random model stop.)"""
    verdict = {"type": "json_schema", "name": "v", "schema": Verdict.model_json_schema()}
    args: Any = {"model": "ad05", "input": "Final answers", "max_output_tokens": 40,
                 "temperature": 0, "text": {"format": verdict}}  # fmt: skip
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text == "".join(deltas)
    assert final.status == whole.status


def test_parse_with_a_pydantic_model_gives_a_valid_object_streaming_and_not(
    client: OpenAI,
) -> None:
    out = client.responses.parse(
        model="ad06",
        input="Is it raining?",
        text_format=Verdict,
        max_output_tokens=60,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert isinstance(out.output_parsed, Verdict)
    assert out.output_parsed == Verdict.model_validate_json(out.output_text)
    text: Any = out.to_dict()["text"]
    sent = text["format"]
    assert sent["type"] == "json_schema" and sent["name"] == "Verdict" and sent["strict"]
    with client.responses.stream(model="ad06", input="Is it raining?", text_format=Verdict,
                                 max_output_tokens=60, temperature=0) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Verdict)


def test_a_named_tool_choice_makes_a_function_call_and_the_round_trip_works(
    client: OpenAI,
) -> None:
    args: Any = {"model": "ad07", "input": "Weather in Paris?", "tools": [WEATHER, TIME],
                 "tool_choice": {"type": "function", "name": "get_weather"},
                 "max_output_tokens": 60, "temperature": 0}  # fmt: skip
    out = client.responses.create(**args)
    assert out.status == "completed"
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    parsed = json.loads(call.arguments)
    assert parsed["city"] in ("Paris", "Oslo") and 1 <= parsed["days"] <= 7
    assert out.output_text == ""
    body = out.to_dict()
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert [t["name"] for t in body["tools"]] == ["get_weather", "get_time"]
    # streamed: the call's item, its arguments, its end
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    assert events[4].arguments == call.arguments
    # the round trip: the call and its output sent back (as the Agents SDK does)
    follow: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.to_dict() for item in out.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    answer = client.responses.create(model="ad07", input=follow, tools=[WEATHER, TIME],
                                     tool_choice="none", max_output_tokens=8, **GREEDY)  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text
    turns: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model="ad07", max_completion_tokens=8, tools=[_as_chat(WEATHER), _as_chat(TIME)],
        tool_choice="none", messages=turns, **GREEDY,
    )  # fmt: skip
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_required_calls_listed_tools_only(client: OpenAI) -> None:
    out = client.responses.create(
        model="ad08", input="Weather in Paris?", tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, temperature=0,
    )  # fmt: skip
    assert out.status == "completed"
    (call,) = out.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.arguments), dict)


def test_input_items_map_to_chat_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    got = messages("sys", [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look"},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "a"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "b"}]},
    ])  # fmt: skip
    tool_call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert got == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look",
         "tool_calls": [{"id": "c1", **tool_call}, {"id": "c2", **tool_call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a"},
        {"role": "tool", "tool_call_id": "c2", "content": "b"},
    ]  # fmt: skip
    assert messages(None, [call])[0] == {"role": "assistant", "content": None,
                                         "tool_calls": [{"id": "c1", **tool_call}]}  # fmt: skip


PICTURE = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}
IMAGE: Any = [
    {"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, PICTURE]}
]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"store": True}, "store", "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id", "previous_response_id"),
        ({"extra_body": {"conversation": "conv_1"}}, "conversation", "conversation"),
        ({"background": True}, "background", "background"),
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
         "web_search_preview"),
        ({"input": IMAGE}, "input", "input_image"),
        ({"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]}, "input",
         "call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format", "text.format"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"tools": [WEATHER]}, "tool_choice", "tool-call parser"),  # auto without a parser
        ({"max_output_tokens": 100000}, "max_output_tokens", "context length"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_it(
    client: OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    args: Any = {"model": "ad01", "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**args)
    assert info.value.param == param
    assert words in info.value.message


def test_responses_are_not_stored(client: OpenAI, server: Running) -> None:
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as info:
            call("resp_abc")
        assert "does not store responses" in info.value.message
    r = httpx.get(server.v1 + "/responses/resp_abc")  # no key: the key is checked first
    assert r.status_code == 401


def test_responses_are_metered_as_chat_is(client: OpenAI, server: Running) -> None:
    before = scrape(server)
    out = client.responses.create(model="ad09", input="Metered", max_output_tokens=7, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="ad09", input="Metered", store=True)
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert out.usage is not None
    assert grew("loraplane_requests_total", tenant="default", code="200") == 1
    assert grew("loraplane_requests_total", code="400") == 1
    assert grew("loraplane_tokens_total", tenant="default", kind="completion") == 7
    assert grew("loraplane_tokens_total", tenant="default", kind="prompt") == (
        out.usage.input_tokens
    )


def test_an_unknown_model_is_chats_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="nope", input="hi")
    assert info.value.code == "model_not_found"


@pytest.fixture(scope="module")
def hermes_server(tiny_llama_dir: Path, adapter_names: dict[str, Path]) -> Iterator[str]:
    settings = server_settings(tiny_llama_dir, adapter_names, tool_call_parser="hermes")
    with start_server(settings) as (url, _):
        yield url


def test_auto_reads_calls_out_of_the_text_after_a_message(hermes_server: str) -> None:
    """A regex constraint stands in for a model trained to call tools: the text before the
    hermes block is a message item, the block a function_call item, streamed the same way."""
    client = OpenAI(base_url=hermes_server + "/v1", api_key=API_KEY, max_retries=0)
    block = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
    pattern = "Let me check\\. " + block.replace("{", "\\{").replace("}", "\\}") + "</tool_call>"
    args: Any = {"model": "ad02", "input": "Time?", "tools": [WEATHER, TIME],
                 "max_output_tokens": 200,
                 "extra_body": {"structured_outputs": {"regex": pattern}}}  # fmt: skip
    out = client.responses.create(**args)
    message, call = out.output
    assert message.type == "message" and out.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_time"
    assert json.loads(call.arguments) == {"zone": "CET"}
    with client.responses.stream(**args) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me check."
    assert kinds.index("response.output_item.done") < kinds.index(
        "response.function_call_arguments.delta"
    )  # the message ends before the call begins
    assert final.output[1].arguments == call.arguments  # type: ignore[union-attr]


def test_a_client_disconnecting_mid_stream_aborts_the_response(server: Running) -> None:
    tokens = total(scrape(server), "loraplane_tokens_total", kind="completion")
    body = {"model": "ad03", "input": "Many tenants", "max_output_tokens": 230, "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.v1 + "/responses", json=body, headers=headers) as r:
        lines = r.iter_lines()
        assert any("response.output_text.delta" in line for line in lines)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = scrape(server)
        if total(now, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert total(now, "vllm:num_requests_running") == 0
    generated = total(now, "loraplane_tokens_total", kind="completion") - tokens
    assert 0 < generated < 230  # aborted, not finished


async def enumerate_async(items: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    n = 0
    async for item in items:
        yield n, item
        n += 1


def test_a_failure_mid_stream_is_a_response_failed_event_with_the_output_so_far(
    client: OpenAI, server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's stream fails after its first output (as when a dependency goes away): the
    client gets `response.failed` with the error and the text sent so far, and the request
    leaves nothing running."""
    real = run_job

    async def failing(runtime: Any, job: Any) -> AsyncGenerator[Any, None]:
        async with contextlib.aclosing(real(runtime, job)) as outputs:
            async for n, item in enumerate_async(outputs):
                yield item
                if n == 3:
                    raise Unavailable("request failed: the store went away", retry_after=5)

    monkeypatch.setattr(responses, "run_job", failing)
    events = list(client.responses.create(model="ad04", input="Fail", max_output_tokens=20,
                                          stream=True, **GREEDY))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "unavailable" and "went away" in failed.error.message
    sent = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (message,) = failed.output
    assert message.type == "message" and message.status == "incomplete"
    assert message.content[0].text == sent
    assert failed.usage is not None and failed.usage.output_tokens >= 1
    assert sent and failed.id == events[0].response.id
    deadline = time.monotonic() + 10
    while total(scrape(server), "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert total(scrape(server), "vllm:num_requests_running") == 0


def test_adapters_are_tenant_scoped_as_in_chat(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    with controlplane(tmp_path) as cp:
        keys = pool_and_tenants(cp, tiny_llama_dir)
        files = [
            ("files", (p.name, p.read_bytes())) for p in sorted(peft_adapters["r16"].iterdir())
        ]
        form = {"name": "support", "base_model": BASE_NAME}
        acme_h = {"Authorization": f"Bearer {keys['acme']}"}
        r = httpx.post(cp + "/v1/adapters", data=form, files=files, headers=acme_h)
        assert r.status_code == 201, r.text
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL, num_kv_blocks=128,
        )  # fmt: skip
        with start_server(settings) as (url, _):
            acme, globex = (OpenAI(base_url=url + "/v1", api_key=keys[t], max_retries=0)
                            for t in ("acme", "globex"))  # fmt: skip
            args: Any = {"input": "Support me", "max_output_tokens": 6, **GREEDY}
            out = acme.responses.create(model="support", **args)
            base = acme.responses.create(model=BASE_NAME, **args)
            chat = acme.chat.completions.create(
                model="support", messages=[{"role": "user", "content": "Support me"}],
                max_completion_tokens=6, **GREEDY,
            )  # fmt: skip
            assert out.output_text == chat.choices[0].message.content
            assert out.output_text != base.output_text  # the adapter is applied
            with pytest.raises(openai.NotFoundError) as info:
                globex.responses.create(model="support", **args)
            assert info.value.code == "model_not_found"
            assert globex.responses.create(model=BASE_NAME, **args).output_text == base.output_text
