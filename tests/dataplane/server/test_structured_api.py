"""Structured outputs through the OpenAI API with the openai client: OpenAI's
`response_format` (json_schema, json_object) and vLLM's `structured_outputs` (choice, regex,
json, grammar), streaming and not, next to free requests; bad constraints are 400s."""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.dataplane.server.conftest import API_KEY, Running

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Is it raining?"}]


@pytest.fixture
def client(server: Running) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)


def test_json_schema_chat_holds_among_free_requests_on_other_adapters(client: OpenAI) -> None:
    def constrained(model: str) -> Any:
        return client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=60, temperature=1.0, seed=7,  # type: ignore[arg-type]
            response_format={"type": "json_schema",
                             "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}},
        )  # fmt: skip

    def free(model: str) -> Any:
        return client.completions.create(model=model, prompt="Hello", max_tokens=12,
                                         extra_body={"ignore_eos": True})  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(constrained, m) for m in ("ad01", "ad02", "tiny-llama")]
        others = [pool.submit(free, m) for m in ("ad03", "ad04", "ad05")]
        answers = [j.result() for j in jobs]
        assert all(o.result().usage.completion_tokens == 12 for o in others)
    for out in answers:
        data = json.loads(out.choices[0].message.content)
        assert data["answer"] in ("yes", "no") and 1 <= data["score"] <= 5
        assert out.choices[0].finish_reason == "stop"


def test_structured_outputs_choice_regex_and_grammar_stream_and_not(client: OpenAI) -> None:
    cases = [
        ({"choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ({"regex": "[A-Z][a-z]{2,5} [0-9]{2}"}, r"[A-Z][a-z]{2,5} [0-9]{2}"),
        ({"grammar": 'start: "ok" | "fail"'}, r"ok|fail"),
        ({"json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99,
          "minimum": 0}}, "required": ["n"], "additionalProperties": False}},
         r'\{"n":[0-9]{1,2}\}'),
    ]  # fmt: skip
    for spec, pattern in cases:
        args = {"model": "ad06", "prompt": "Pick:", "max_tokens": 40, "temperature": 1.0,
                "seed": 3, "extra_body": {"structured_outputs": spec}}  # fmt: skip
        whole = client.completions.create(**args).choices[0]  # type: ignore[call-overload]
        assert re.fullmatch(pattern, whole.text), (spec, whole.text)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(stream=True, **args)  # type: ignore[call-overload]
        )
        assert streamed == whole.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "([a-z"}}, "response_format"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_with_the_reason(
    server: Running, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "ad01", "messages": CHAT, "max_tokens": 4, **extra}
    r = httpx.post(server.v1 + "/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
