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

from loraplane.dataplane.outputs import TopLogprobs
from loraplane.dataplane.server.generation import Choice, Job

TokenText = Callable[[int], str]


def sse(payload: dict[str, Any], *, sliced: bool = False) -> bytes:
    """One server-sent event carrying `payload` as JSON (`sliced`: see json_text)."""
    text = json_text(payload, SSE_JSON) if sliced else json.dumps(payload, **SSE_JSON)
    return b"data: " + text.encode() + b"\n\n"


SSE_JSON: dict[str, Any] = {"ensure_ascii": False}
# what starlette's JSONResponse writes
BODY_JSON: dict[str, Any] = {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")}
_SLICE = 256  # list items per json.dumps call
_FEW = 16  # a list this short is written item by item (its items may be long)


def json_text(value: Any, options: dict[str, Any]) -> str:
    """`json.dumps(value, **options)`, with long lists written `_SLICE` items per call.

    json.dumps holds the GIL for its whole call: a 4k-token answer with log-probabilities (a
    couple of MB) would stop the event loop for as long as it is written, even from a worker
    thread. Between slices the GIL is handed over. Dicts and short lists (the choices) are
    written part by part down to the long lists. Same text as one call.
    """
    item_sep, key_sep = options.get("separators") or (", ", ": ")
    parts: list[str] = []

    def write(v: Any) -> None:
        if isinstance(v, dict) and v and all(isinstance(k, str) for k in v):
            parts.append("{")
            for i, (k, item) in enumerate(v.items()):
                parts.append((item_sep if i else "") + json.dumps(k, **options) + key_sep)
                write(item)
            parts.append("}")
        elif isinstance(v, list) and 0 < len(v) <= _FEW:  # e.g. the choices: each one in turn
            parts.append("[")
            for i, item in enumerate(v):
                parts.append(item_sep if i else "")
                write(item)
            parts.append("]")
        elif isinstance(v, list) and len(v) > _SLICE:
            slices = (json.dumps(v[i : i + _SLICE], **options) for i in range(0, len(v), _SLICE))
            parts.append("[" + item_sep.join(piece[1:-1] for piece in slices) + "]")
        else:
            parts.append(json.dumps(v, **options))

    write(value)
    return "".join(parts)


DONE = b"data: [DONE]\n\n"


def usage(job: Job) -> dict[str, Any]:
    """The `usage` object; `prompt_tokens_details.cached_tokens`: the prompt tokens served
    from the prefix cache (always present, 0 included, as OpenAI answers)."""
    prompt, completion = job.prompt_tokens, job.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


def running_usage(choice: Choice, hide_output: bool = False, unshown: int = 0) -> dict[str, Any]:
    """vLLM's `continuous_usage_stats` on a stream chunk: the choice's prompt tokens and the
    tokens it generated so far (0 when none are shown), less `unshown` (its newest, not in the
    chunk yet)."""
    prompt = len(choice.tokens)
    completion = 0 if hide_output else max(len(choice.token_ids) - unshown, 0)
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
        for i, (token_id, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            alternatives = tops[i] if i < len(tops) else []
            best.append(_by_text([*alternatives, (token_id, lp)], text))
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": best,
        "text_offset": offsets,
    }


def _by_text(pairs: Sequence[tuple[int, float]], text: TokenText) -> dict[str, float]:
    """{token text: log-probability}; tokens of the same text (e.g. partial characters) share
    a key, which keeps the best of their values."""
    out: dict[str, float] = {}
    for token_id, value in pairs:
        key = text(token_id)
        if key not in out or value > out[key]:
            out[key] = value
    return out


def echo_logprobs(choice: Choice, top: int, text: TokenText) -> dict[str, Any]:
    """The echoed prompt's `logprobs` (completions): the first token has none, as in OpenAI's
    and vLLM's answers; the others their log-probability given the tokens before them."""
    scored = choice.prompt_logprobs or []
    tokens = [text(t) for t in choice.tokens]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    best: list[dict[str, float] | None] | None = None
    if top > 0:
        best = [None]
        for p in scored:
            best.append(_by_text([*p.top[:top], (p.token_id, p.logprob)], text))
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(p.logprob for p in scored)],
        "top_logprobs": best,
        "text_offset": offsets,
    }


def choice_logprobs(
    choice: Choice, top: int, text: TokenText, *, hide_output: bool = False
) -> dict[str, Any]:
    """A completion choice's `logprobs`: the echoed prompt's (with echo), then the output's."""
    out = completion_logprobs(
        [] if hide_output else choice.token_ids,
        [] if hide_output else choice.logprobs,
        [] if hide_output else choice.top_logprobs,
        top,
        text,
        len(choice.echo or ""),
    )
    if choice.echo is None:
        return out
    head = echo_logprobs(choice, top, text)
    return {
        key: None if head[key] is None and out[key] is None else [*head[key], *(out[key] or [])]
        for key in out
    }


def vllm_prompt_logprobs(choice: Choice, text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob,
    rank, decoded_token}} for the token itself and the best alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for p in choice.prompt_logprobs or []:
        entry = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": text(t)}
            for rank, (t, v) in enumerate(p.top, start=1)
        }
        entry[str(p.token_id)] = {
            "logprob": p.logprob,
            "rank": p.rank,
            "decoded_token": text(p.token_id),
        }
        out.append(entry)
    return out


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
        "choices": [completion_choice(c, job, logprobs, text) for c in job.choices],
        "usage": usage(job),
    }


def completion_choice(c: Choice, job: Job, logprobs: int | None, text: TokenText) -> dict[str, Any]:
    """One choice of a finished `text_completion` (echo and prompt_logprobs included)."""
    entry: dict[str, Any] = {
        "index": c.index,
        "text": (c.echo or "") + ("" if job.hide_output else c.text),
        "logprobs": None
        if logprobs is None
        else choice_logprobs(c, logprobs, text, hide_output=job.hide_output),
        "finish_reason": "length" if job.hide_output else c.finish_reason,
    }
    if c.params.prompt_logprobs is not None and c.prompt_logprobs is not None:
        entry["prompt_logprobs"] = vllm_prompt_logprobs(c, text)
    return entry


def chat_message(c: Choice, job: Job) -> dict[str, Any]:
    """A finished chat choice's `message` and `finish_reason`: with tools, the calls read out
    of the text (see tools.py) and the content around them."""
    plan = job.tools
    if plan is None or plan.mode == "none":
        return {
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
        }
    content, calls = plan.calls(c.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    reason = c.finish_reason
    if calls:
        message["tool_calls"] = [call.body() for call in calls]
        if reason != "length":
            reason = plan.finish_reason or "tool_calls"
    return {"message": message, "finish_reason": reason}


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
                **chat_message(c, job),
                "logprobs": None
                if logprobs is None
                else chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, logprobs, text),
            }
            for c in job.choices
        ],
        "usage": usage(job),
        **(
            {"prompt_logprobs": vllm_prompt_logprobs(job.choices[0], text)}
            if job.choices and job.choices[0].prompt_logprobs is not None
            else {}
        ),
    }


def chunk(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    *,
    chat: bool,
    include_usage: bool,
    usage_body: dict[str, Any] | None = None,
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


def stream_prompt(
    choice: Choice, top: int | None, text: TokenText, *, chat: bool
) -> dict[str, Any]:
    """The first stream entry of a choice that echoes its prompt (completions) or returns its
    prompt's log-probabilities (vLLM's `prompt_logprobs`)."""
    entry: dict[str, Any] = {"index": choice.index}
    if chat:
        entry["delta"] = {}
    else:
        entry["text"] = choice.echo or ""
    entry["logprobs"] = (
        echo_logprobs(choice, top, text)
        if choice.echo is not None and top is not None and choice.prompt_logprobs is not None
        else None
    )
    entry["finish_reason"] = None
    if choice.params.prompt_logprobs is not None and choice.prompt_logprobs is not None:
        entry["prompt_logprobs"] = vllm_prompt_logprobs(choice, text)
    return entry


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
