"""The OpenAI-compatible API through the `openai` client against a real server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from tests.dataplane.server.conftest import API_KEY, Running

GREEDY = {"temperature": 0.0}


@pytest.fixture
def client(server: Running) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)


def test_models_lists_the_base_model_and_adapters_with_parent_and_no_path(
    client: OpenAI, server: Running
) -> None:
    models = client.models.list().data
    ids = [m.id for m in models]
    assert ids[0] == "tiny-llama"
    assert set(ids[1:]) == set(server.adapters)
    for m in models[1:]:
        assert m.model_extra is not None and m.model_extra["parent"] == "tiny-llama"
    text = json.dumps([m.model_dump() for m in models])
    assert all(str(p) not in text for p in server.adapters.values())
    assert "/" not in text.replace("\\/", "")


def test_completion_returns_text_usage_and_finish_reason(client: OpenAI) -> None:
    out = client.completions.create(model="ad00", prompt="The quick brown", max_tokens=7, **GREEDY)
    assert out.object == "text_completion" and out.model == "ad00"
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens <= 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    details = out.usage.prompt_tokens_details  # prompt tokens from the prefix cache
    assert details is not None and 0 <= (details.cached_tokens or 0) <= out.usage.prompt_tokens


def test_adapters_change_the_output(client: OpenAI) -> None:
    texts = {
        client.completions.create(
            model=m, prompt="Many tenants share", max_tokens=12, extra_body={"ignore_eos": True},
            **GREEDY,
        ).choices[0].text
        for m in ("tiny-llama", "ad00", "ad05")
    }  # fmt: skip
    assert len(texts) == 3


def test_name_at_version_pins_the_adapter(client: OpenAI, server: Running) -> None:
    digest = server.runtime.static.get("ad01").digest  # type: ignore[union-attr]
    base = client.completions.create(model="ad01", prompt="LoRA adds", max_tokens=6, **GREEDY)
    for pin in ("1", digest[:12]):
        out = client.completions.create(
            model=f"ad01@{pin}", prompt="LoRA adds", max_tokens=6, **GREEDY
        )
        assert out.choices[0].text == base.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad01@2", prompt="x", max_tokens=1)


def test_n_choices_and_seeded_sampling_repeat(client: OpenAI) -> None:
    args = {"model": "ad02", "prompt": "Serving", "max_tokens": 8, "n": 3, "seed": 7}
    first = client.completions.create(temperature=1.0, **args)
    again = client.completions.create(temperature=1.0, **args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # seed + i per choice
    assert first.usage is not None and 3 <= first.usage.completion_tokens <= 24


def test_n_above_the_cap_is_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="ad02", prompt="x", max_tokens=1, n=9)
    assert e.value.status_code == 400


def test_completion_logprobs_hold_the_chosen_token(client: OpenAI) -> None:
    out = client.completions.create(
        model="ad03", prompt="Hello", max_tokens=5, logprobs=1, extra_body={"ignore_eos": True},
        **GREEDY,
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert lp.top_logprobs is not None
    assert all(list(top) == [tok] for top, tok in zip(lp.top_logprobs, lp.tokens, strict=True))
    assert all(x <= 0 for x in lp.token_logprobs)


def test_completion_top_logprobs_stream_and_not_agree(client: OpenAI, server: Running) -> None:
    args = {"model": "ad05", "prompt": "Hello there", "max_tokens": 6, "logprobs": 3,
            "extra_body": {"ignore_eos": True}, **GREEDY}  # fmt: skip
    whole = client.completions.create(**args).choices[0].logprobs  # type: ignore[call-overload]
    assert whole is not None and whole.top_logprobs is not None and whole.tokens is not None
    assert whole.token_logprobs is not None
    for top, token, lp in zip(whole.top_logprobs, whole.tokens, whole.token_logprobs, strict=True):
        # the 3 best and the chosen one (tokens of the same text, e.g. partial characters,
        # share one key, as in OpenAI's answers)
        assert 1 <= len(top) <= 4 and token in top
        assert max(top.values()) == pytest.approx(lp)  # greedy: the chosen one is the best
    streamed: list[dict[str, float]] = []
    for chunk in client.completions.create(stream=True, **args):  # type: ignore[call-overload]
        lp = chunk.choices[0].logprobs
        if lp is not None and lp.top_logprobs:
            streamed += lp.top_logprobs
    assert len(streamed) == len(whole.top_logprobs)
    for a, b in zip(streamed, whole.top_logprobs, strict=True):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()))


def test_chat_top_logprobs_are_sorted_alternatives(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model="ad02", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True,
        top_logprobs=4, extra_body={"ignore_eos": True}, **GREEDY,
    )  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])
        assert entry.top_logprobs[0].token == entry.token


def test_the_sampling_set_reaches_the_sampler(client: OpenAI) -> None:
    args = {"model": "ad01", "prompt": "The quick", "max_tokens": 8, **GREEDY}
    plain = client.completions.create(extra_body={"ignore_eos": True}, **args)  # type: ignore[call-overload]
    forced = client.completions.create(
        logit_bias={"42": 100}, extra_body={"ignore_eos": True}, **args
    )  # type: ignore[call-overload]
    assert forced.usage.completion_tokens == 8
    penalised = client.completions.create(
        frequency_penalty=2.0, presence_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 3.0, "min_p": 0.1},
        **args,
    )  # type: ignore[call-overload]  # fmt: skip
    assert plain.choices[0].text != penalised.choices[0].text
    again = client.completions.create(
        logit_bias={"42": 100}, extra_body={"ignore_eos": True, "include_stop_str_in_output":
                                            True}, **args)  # type: ignore[call-overload]  # fmt: skip
    assert forced.choices[0].text == again.choices[0].text
    # every token is token 42 (its text repeated): the bias reached the sampler
    one = client.completions.create(logit_bias={"42": 100}, extra_body={"ignore_eos": True},
                                    **{**args, "max_tokens": 1})  # type: ignore[call-overload]  # fmt: skip
    assert forced.choices[0].text == one.choices[0].text * 8


def test_chat_completion_uses_the_chat_template(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model="ad04", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        logprobs=True, top_logprobs=1, **GREEDY,
    )  # fmt: skip
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.logprobs is not None and choice.logprobs.content
    entry = choice.logprobs.content[0]
    assert [t.token for t in entry.top_logprobs] == [entry.token]
    # '<|user|>hi</s><|assistant|>' is more than the two words' tokens
    assert out.usage is not None and out.usage.prompt_tokens > 3


def test_chat_stream_has_role_then_content_then_finish_then_usage(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="ad05", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="ad05", messages=[{"role": "user", "content": "hi"}], max_tokens=6, **GREEDY
    )
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None


def test_completion_stream_ends_with_done(server: Running) -> None:
    body = {"model": "ad06", "prompt": "fox", "max_tokens": 4, "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.v1 + "/completions", json=body, headers=headers, timeout=30)
    events = [e for e in r.text.split("\n\n") if e]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "text_completion" and "usage" not in first


def test_stop_strings_end_the_text(client: OpenAI) -> None:
    args = {"model": "ad07", "prompt": "The quick", "max_tokens": 20, **GREEDY}
    full = client.completions.create(extra_body={"ignore_eos": True}, **args).choices[0].text
    if len(full) < 4:
        pytest.skip("greedy text too short to cut")
    stop = full[2:4]
    cut = client.completions.create(stop=[stop], **args).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
        (
            {"model": "tiny-llama", "prompt": "x", "max_tokens": 10_000},
            400,
            "context_length_exceeded",
        ),
        ({"model": "tiny-llama", "prompt": "x " * 400}, 400, "context_length_exceeded"),
        ({"model": "tiny-llama", "prompt": "x", "temperature": -1}, 400, None),
        ({"model": "tiny-llama", "prompt": "x", "frequency_penalty": 2.5}, 400, None),
        ({"model": "tiny-llama", "prompt": "x", "logit_bias": {"abc": 1}}, 400, None),
        ({"model": "tiny-llama", "prompt": "x", "logit_bias": {"99999": 1}}, 400, None),
        ({"model": "tiny-llama", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, None),
        ({"model": "tiny-llama", "prompt": "x", "logprobs": 21}, 400, None),
        ({"model": "tiny-llama", "prompt": [99999]}, 400, None),
        ({"prompt": "x"}, 400, None),
    ],
)
def test_errors_are_openai_shaped(
    server: Running, body: dict[str, object], status: int, code: str | None
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.v1 + "/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["code"] == code


def test_malformed_json_is_a_400(server: Running) -> None:
    r = httpx.post(
        server.v1 + "/completions",
        content=b'{"model": ',
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_a_wrong_or_missing_api_key_is_a_401(server: Running) -> None:
    bad = OpenAI(base_url=server.v1, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.v1 + "/completions", json={"model": "tiny-llama", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_health_and_ready(server: Running) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").json() == {"ready": True}


def test_tokenize_and_detokenize_answer_what_the_engine_runs(
    client: OpenAI, server: Running
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = "The quick brown fox"
    r = httpx.post(server.url + "/tokenize", headers=headers,
                   json={"model": "ad01", "prompt": text, "return_token_strs": True})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    assert body["max_model_len"] > 0
    # the same ids as the completion's usage counts
    done = client.completions.create(model="ad01", prompt=text, max_tokens=1)
    assert done.usage is not None and done.usage.prompt_tokens == body["count"]
    back = httpx.post(server.url + "/detokenize", headers=headers,
                      json={"model": "ad01", "tokens": body["tokens"]})  # fmt: skip
    assert back.status_code == 200 and text in back.json()["prompt"]
    chat = httpx.post(server.url + "/tokenize", headers=headers, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    served = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert served.usage is not None and chat.json()["count"] == served.usage.prompt_tokens
    info = httpx.get(server.url + "/tokenizer_info", headers=headers).json()
    assert info["eos_token"] and info["vocab_size"] > 0 and "chat_template" in info


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/tokenize", {"model": "ad01", "prompt": "x"}, 401),
        ("POST", "/detokenize", {"model": "ad01", "tokens": [1]}, 401),
        ("GET", "/tokenizer_info", None, 401),
    ],
)
def test_tokenizer_routes_need_the_key(
    server: Running, method: str, path: str, body: object, status: int
) -> None:
    r = httpx.request(method, server.url + path, json=body,
                      headers={"Authorization": "Bearer wrong"})  # fmt: skip
    assert r.status_code == status


@pytest.mark.parametrize(
    "body",
    [
        {"model": "nope", "prompt": "x"},
        {"model": "ad01"},
        {"model": "ad01", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
    ],
)
def test_tokenize_refuses_unknown_models_and_ambiguous_bodies(
    server: Running, body: object
) -> None:
    r = httpx.post(server.url + "/tokenize", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code in (400, 404) and r.json()["error"]["message"]


def test_detokenize_refuses_ids_outside_the_vocabulary(server: Running) -> None:
    r = httpx.post(server.url + "/detokenize", json={"model": "ad01", "tokens": [10**9]},
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_json", {"type": "object"}),
        ("guided_regex", "[a-z]+"),
        ("guided_choice", ["yes", "no"]),
        ("tool_choice", "required"),
        ("use_beam_search", True),
        ("bad_words", ["x"]),
    ],
)
def test_known_fields_the_server_lacks_are_refused_by_name(
    server: Running, field: str, value: object
) -> None:
    """A request for JSON output must never get free text with a 200."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in (
        ("/completions", {"model": "ad01", "prompt": "x", "max_tokens": 2}),
        ("/chat/completions",
         {"model": "ad01", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ):  # fmt: skip
        r = httpx.post(server.v1 + path, json={**body, field: value}, headers=headers)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_fields_that_ask_for_nothing_and_unknown_fields_are_accepted(server: Running) -> None:
    body = {"model": "ad01", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "response_format": {"type": "text"}, "tool_choice": "none", "guided_json": None,
            "some_future_field": {"x": 1}}  # fmt: skip
    r = httpx.post(server.v1 + "/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code == 200, r.text
