"""Echo and log-probabilities through the OpenAI API, with the openai client: what an
evaluation client (lm-evaluation-harness's `local-completions`) asks to score a text under an
adapter, checked against HF+PEFT per adapter while several adapters share the engine's batches.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI

from tests.dataplane.conftest import hf_logits
from tests.dataplane.server.conftest import API_KEY, Running


@pytest.fixture
def client(server: Running) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0)


def peft_name(server: Running, peft_adapters: dict[str, Path], model: str) -> str | None:
    by_path = {path: name for name, path in peft_adapters.items()}
    return by_path[server.adapters[model]] if model in server.adapters else None


PROMPTS = {
    "ad01": [12, 40, 7, 99, 3, 250, 18, 61],
    "ad02": [5, 6, 7, 8, 9, 10, 11],
    "ad05": [300, 2, 77, 77, 140, 9, 31, 8, 200],
    "tiny-llama": [45, 46, 47, 48, 49, 50],
}


def test_echo_scores_the_prompt_under_each_adapter_like_peft(
    client: OpenAI,
    server: Running,
    peft_adapters: dict[str, Path],
    hf_reference: Callable[[str], torch.nn.Module],
) -> None:
    """max_tokens 0 with echo and logprobs, four adapters at once: the prompt's text comes
    back with one log-probability per token (the first null), nothing generated or billed."""

    def score(model: str) -> Any:
        return client.completions.create(
            model=model, prompt=PROMPTS[model], max_tokens=0, echo=True, logprobs=2,
            temperature=0,
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = dict(zip(PROMPTS, pool.map(score, PROMPTS), strict=True))
    reference = hf_reference("llama")
    tokenizer = server.runtime.require_engine().tokenizer
    for model, out in answers.items():
        ids = PROMPTS[model]
        choice = out.choices[0]
        assert choice.text == tokenizer.decode(ids)
        assert choice.finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == 0
        assert out.usage.prompt_tokens == len(ids)
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        logp = torch.log_softmax(hf_logits(reference, ids, peft_name(server, peft_adapters,
                                                                      model)), dim=-1)  # fmt: skip
        for pos in range(1, len(ids)):
            assert lp.token_logprobs[pos] == pytest.approx(float(logp[pos - 1, ids[pos]]), abs=1e-4)
            best = lp.top_logprobs[pos]
            assert best is not None and max(best.values()) == pytest.approx(
                float(logp[pos - 1].max()), abs=1e-4
            )


def test_echo_with_generation_puts_the_prompt_first(client: OpenAI) -> None:
    args = {"model": "ad02", "prompt": "Once upon", "max_tokens": 4, "temperature": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.completions.create(**args).choices[0]  # type: ignore[call-overload]
    echoed = client.completions.create(echo=True, logprobs=0, **args).choices[0]  # type: ignore[call-overload]
    assert echoed.text == "Once upon" + plain.text
    lp = echoed.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.text_offset is not None
    prompt_len = len(lp.token_logprobs) - 4
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(echo=True, stream=True, **args)  # type: ignore[call-overload]
    )
    assert streamed == echoed.text and prompt_len > 0


def test_vllm_prompt_logprobs_hold_rank_and_alternatives(
    server: Running,
    peft_adapters: dict[str, Path],
    hf_reference: Callable[[str], torch.nn.Module],
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = PROMPTS["ad05"]
    body = {"model": "ad05", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 3}
    out = httpx.post(server.v1 + "/completions", json=body, headers=headers).json()
    got = out["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    logp = torch.log_softmax(
        hf_logits(hf_reference("llama"), ids, peft_name(server, peft_adapters, "ad05")), dim=-1
    )
    for pos in range(1, len(ids)):
        row, token = logp[pos - 1], ids[pos]
        entry = got[pos]
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        for rank, t in enumerate(row.topk(3).indices.tolist(), start=1):
            if t != token:
                assert entry[str(t)]["rank"] == rank
    chat = httpx.post(server.v1 + "/chat/completions", headers=headers, json={
        "model": "ad05", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0})  # fmt: skip
    assert chat.status_code == 200
    assert chat.json()["prompt_logprobs"][0] is None and len(chat.json()["prompt_logprobs"]) > 1


def test_max_tokens_zero_needs_echo(server: Running) -> None:
    r = httpx.post(server.v1 + "/completions", json={"model": "ad01", "prompt": "x",
                   "max_tokens": 0}, headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_batch_of_prompts_scored_as_an_evaluation_client_asks(
    server: Running,
    peft_adapters: dict[str, Path],
    hf_reference: Callable[[str], torch.nn.Module],
) -> None:
    """lm-evaluation-harness's `local-completions` log-likelihood request: several token-id
    prompts in one body, echo, logprobs 1, max_tokens 1, greedy; per choice (in prompt order)
    the prompt's log-probabilities, then one generated token."""
    prompts = [PROMPTS["ad01"], PROMPTS["ad02"], PROMPTS["ad05"]]
    body = {"model": "ad04", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234}  # fmt: skip
    r = httpx.post(server.v1 + "/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    reference = hf_reference("llama")
    name = peft_name(server, peft_adapters, "ad04")
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        logp = torch.log_softmax(hf_logits(reference, ids, name), dim=-1)
        for pos in range(1, len(ids)):
            assert lp["token_logprobs"][pos] == pytest.approx(
                float(logp[pos - 1, ids[pos]]), abs=1e-4
            )
            # the harness's greedy check: is the actual token the best one?
            best = max(lp["top_logprobs"][pos], key=lp["top_logprobs"][pos].get)
            greedy = int(logp[pos - 1].argmax()) == ids[pos]
            assert (best == lp["tokens"][pos]) == greedy or not greedy
