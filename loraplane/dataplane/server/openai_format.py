"""OpenAI response bodies and stream chunks, built as plain dicts (no per-token validation).

Log-probabilities are of the model's own distribution with the request's adapter. Completions
(`logprobs: N`): per token its text, log-probability and offset, and with N >= 1 `top_logprobs`
{text: logprob} for the N best tokens and the chosen one (as vLLM answers). Chat (`logprobs:
true`, `top_logprobs: N`): per token `{"token", "logprob", "bytes", "top_logprobs"}` with the N
best alternatives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from loraplane.dataplane.sampler import TopLogprobs
from loraplane.dataplane.server.generation import Choice, Job

TokenText = Callable[[int], str]


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage(job: Job) -> dict[str, int]:
    """The `usage` object."""
    prompt, completion = job.prompt_tokens, job.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
    top: int,
    text: TokenText,
    offset: int,
) -> dict[str, Any]:
    """A completion choice's `logprobs` for these tokens; `offset` where their text starts."""
    tokens = [text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    best: list[dict[str, float]] | None = None
    if top > 0:
        best = []
        for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            alternatives = {text(t): v for t, v in tops[i]} if i < len(tops) else {}
            best.append({**alternatives, token: lp})
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": best,
        "text_offset": offsets,
    }


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
    top: int,
    text: TokenText,
) -> dict[str, Any]:
    """A chat choice's `logprobs` for these tokens."""
    content = []
    for i, (token_id, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        alternatives = tops[i] if top > 0 and i < len(tops) else []
        content.append(
            {
                **_chat_entry(text(token_id), lp),
                "top_logprobs": [_chat_entry(text(t), v) for t, v in alternatives],
            }
        )
    return {"content": content}


def completion_body(
    job: Job, rid: str, created: int, model: str, logprobs: int | None, text: TokenText
) -> dict[str, Any]:
    """A finished `text_completion`."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None
                if logprobs is None
                else completion_logprobs(
                    c.token_ids, c.logprobs, c.top_logprobs, logprobs, text, 0
                ),
                "finish_reason": c.finish_reason,
            }
            for c in job.choices
        ],
        "usage": usage(job),
    }


def chat_body(
    job: Job, rid: str, created: int, model: str, logprobs: int | None, text: TokenText
) -> dict[str, Any]:
    """A finished `chat.completion`."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None
                if logprobs is None
                else chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, logprobs, text),
                "finish_reason": c.finish_reason,
            }
            for c in job.choices
        ],
        "usage": usage(job),
    }


def chunk(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    *,
    chat: bool,
    include_usage: bool,
    usage_body: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A stream chunk (`text_completion` or `chat.completion.chunk`)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage_body
    return body


def stream_choice(
    choice: Choice,
    token_ids: list[int],
    delta_text: str,
    logprobs: list[float] | None,
    tops: list[TopLogprobs] | None,
    finish_reason: str | None,
    *,
    chat: bool,
    top: int | None,
    text: TokenText,
) -> dict[str, Any]:
    """One choice's entry in a stream chunk."""
    lp: dict[str, Any] | None = None
    if top is not None and logprobs:
        if chat:
            lp = chat_logprobs(token_ids, logprobs, tops or [], top, text)
        else:
            offset = len(choice.text) - len(delta_text)
            lp = completion_logprobs(token_ids, logprobs, tops or [], top, text, offset)
    entry: dict[str, Any] = {"index": choice.index}
    if chat:
        entry["delta"] = {"content": delta_text} if delta_text else {}
    else:
        entry["text"] = delta_text
    entry["logprobs"] = lp
    entry["finish_reason"] = finish_reason
    return entry
