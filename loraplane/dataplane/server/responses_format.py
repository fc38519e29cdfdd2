"""Bodies and stream events of the Responses API (`POST /v1/responses`), as plain dicts.

A finished chat-shaped Job (generation.py) becomes a `response` object: a `message` output item
with one `output_text` part, and/or `function_call` items (the calls read out of the text as
chat reads them, tools.py). `StreamedOutput` turns a streamed job's text and calls into the typed
events the openai client's `responses.stream()` accumulates: every item is opened
(`response.output_item.added`), filled (deltas) and closed (`.done`) in order, so the final
`response.completed` lists exactly the items the stream announced.
"""

from __future__ import annotations

import uuid
from typing import Any

from loraplane.dataplane.server.generation import Choice, Job
from loraplane.dataplane.server.tools import ToolCall, ToolPlan

Event = dict[str, Any]  # one stream event without its sequence_number


def item_id(kind: str) -> str:
    """A fresh output item id (`msg_...`, `fc_...`)."""
    return f"{kind}_{uuid.uuid4().hex}"


def usage(job: Job) -> dict[str, Any]:
    """The Responses `usage` object: prompt tokens (`cached_tokens`: those served from the
    prefix cache), output tokens (no reasoning tokens: no reasoning models here); explicit
    prompt-cache writes do not exist here, `cache_write_tokens` is 0."""
    prompt, output = job.prompt_tokens, job.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": job.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def response(
    rid: str,
    created: int,
    echo: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage_body: dict[str, Any] | None,
    *,
    error: dict[str, Any] | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """A `response` object; `echo`: the request's settings it repeats (ResponsesRequest.echo)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": incomplete,
        **echo,
        "output": output,
        "usage": usage_body,
    }


def text_part(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant `message` output item (no part while `text` is None: just opened)."""
    content = [] if text is None else [text_part(text)]
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def call_item(fid: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    """A `function_call` output item."""
    return {"id": fid, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": arguments, "status": status}  # fmt: skip


def _reads_calls(plan: ToolPlan | None) -> bool:
    return plan is not None and plan.mode != "none"


def output_items(job: Job) -> list[dict[str, Any]]:
    """A finished job's output items: the message (always without tools or with
    tool_choice "none"; with tools only when there is content), then its function calls."""
    choice: Choice = job.choices[0]
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    plan = job.tools
    content: str | None = choice.text
    calls: list[ToolCall] = []
    if plan is not None and plan.mode != "none":
        content, calls = plan.calls(choice.text)
    items = [] if content is None else [message_item(item_id("msg"), content, status)]
    items += [call_item(item_id("fc"), call, call.arguments, status) for call in calls]
    return items


def status_of(job: Job) -> str:
    """`completed`, or `incomplete` when the output hit max_output_tokens (or the context)."""
    return "incomplete" if job.choices[0].finish_reason == "length" else "completed"


class StreamedOutput:
    """The output items of one streamed response, as events: `text` and `call` return the
    events for new content and for a complete call, `close` those that end the open message;
    `items` holds every item as last sent (the final response's `output`)."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._text = ""
        # without tools (or tool_choice "none") the answer is one message, even an empty one:
        # it opens at once, as OpenAI's stream does
        self.plain = not _reads_calls(plan)

    def so_far(self) -> list[dict[str, Any]]:
        """The items as they stand (a failed response's output): an open message with the
        text sent so far, marked incomplete."""
        items = list(self.items)
        if self._message is not None:
            items[-1] = message_item(self._message["id"], self._text, "incomplete")
        return items

    def start(self) -> list[Event]:
        """The events that open the answer (a plain answer's message)."""
        return self._open() if self.plain else []

    def _open(self) -> list[Event]:
        mid = item_id("msg")
        self._message, self._text = message_item(mid, None, "in_progress"), ""
        index = len(self.items)
        self.items.append(self._message)
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": message_item(mid, None, "in_progress")},
            {"type": "response.content_part.added", "item_id": mid, "output_index": index,
             "content_index": 0, "part": text_part("")},
        ]  # fmt: skip

    def text(self, delta: str) -> list[Event]:
        """Events for new content (a message opens on the first)."""
        if not delta:
            return []
        events = [] if self._message is not None else self._open()
        assert self._message is not None
        self._text += delta
        events.append({"type": "response.output_text.delta", "item_id": self._message["id"],
                       "output_index": len(self.items) - 1, "content_index": 0,
                       "delta": delta, "logprobs": []})  # fmt: skip
        return events

    def close(self, status: str) -> list[Event]:
        """Events that end the open message, if any, with `status`."""
        message = self._message
        if message is None:
            return []
        self._message = None
        mid, index, text = message["id"], len(self.items) - 1, self._text
        done = message_item(mid, text, status)
        self.items[index] = done
        return [
            {"type": "response.output_text.done", "item_id": mid, "output_index": index,
             "content_index": 0, "text": text, "logprobs": []},
            {"type": "response.content_part.done", "item_id": mid, "output_index": index,
             "content_index": 0, "part": text_part(text)},
            {"type": "response.output_item.done", "output_index": index, "item": done},
        ]  # fmt: skip

    def call(self, call: ToolCall, status: str = "completed") -> list[Event]:
        """Events for one complete function call (after the message before it is closed):
        its item, its arguments in one delta, and its end."""
        events = self.close("completed")
        fid, index = item_id("fc"), len(self.items)
        done = call_item(fid, call, call.arguments, status)
        self.items.append(done)
        events += [
            {"type": "response.output_item.added", "output_index": index,
             "item": call_item(fid, call, "", "in_progress")},
            {"type": "response.function_call_arguments.delta", "item_id": fid,
             "output_index": index, "delta": call.arguments},
            {"type": "response.function_call_arguments.done", "item_id": fid,
             "output_index": index, "name": call.name, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": index, "item": done},
        ]  # fmt: skip
        return events
