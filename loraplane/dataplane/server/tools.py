"""Tool calling for chat completions: `tools` and `tool_choice` in OpenAI's shapes.

How each `tool_choice` is served (the tools are always given to the chat template):
- `none`: plain text, no tool call.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is forced
  (structured outputs) to be that function's arguments, a JSON object of its `parameters`
  schema; the answer holds one tool call, finish_reason "stop" (as OpenAI answers a forced call).
- `required`: the output is forced to a JSON array of `{"name", "parameters"}` objects, one of
  the tools each: one element at most with `parallel_tool_calls: false`, MAX_REQUIRED_CALLS
  (8) at most otherwise, so the grammar closes the array (a model may else list calls until
  max_tokens); finish_reason "tool_calls". An output cut at max_tokens inside the array still
  answers the calls completed before the cut, with finish_reason "length" (as OpenAI reports
  any answer cut short; the last, incomplete call is dropped).
- `auto` (the default when tools are given): the model writes freely and a tool-call parser,
  chosen with `--tool-call-parser` (`hermes`, `llama3_json`, `mistral`, `pythonic`: see
  tool_parsers.py), finds its calls in the text; the text around them is the message's content
  (stripped). Without a parser, `auto` is a 400 (it could only be ignored).

Streaming: content is sent as it comes, except text that may begin a tool call (and blanks at
its ends, so the streamed content is the answer's content); each tool call is sent whole (id,
name and all its arguments in one delta) once its text is complete (with `required`, each
element of the array as soon as it is closed; a named call once the output ends).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplane.dataplane.server.errors import InvalidRequest
from loraplane.dataplane.server.tool_parsers import PARSERS, CallStream, parse
from loraplane.dataplane.server.tool_scan import ToolCall, call_id, compact
from loraplane.dataplane.structured import Constraint

__all__ = ["PARSERS", "HermesStream", "Tool", "ToolCall", "ToolPlan", "ToolStream", "plan"]
ToolChoiceMode = Literal["none", "auto", "required"]
_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# the most calls one `required` answer holds with parallel_tool_calls (the array's maxItems)
MAX_REQUIRED_CALLS = 8


class FunctionSpec(BaseModel):
    """A function the model may call: its name, what it does and its parameters' schema."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of `tools` (only functions exist)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionSpec


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools: the mode, the forced function if any, the
    constraint that forces the output, and the parser that reads calls out of free text."""

    mode: ToolChoiceMode | Literal["named"]
    tools: list[Tool]
    named: str | None = None
    constraint: Constraint | None = None
    parser: str | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template sees them."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's content and tool calls, read from the generated text."""
        if self.mode == "named":
            return None, [ToolCall(self.named or "", compact(text), call_id())]
        if self.mode == "required":
            return None, [
                ToolCall(str(c.get("name")), compact(c.get("parameters", {})), call_id())
                for c in _json_list(text)
            ]
        if self.mode == "auto" and self.parser is not None:
            return parse(self.parser, text)
        return text, []

    @property
    def finish_reason(self) -> str | None:
        """The finish_reason of an answer that called tools (None: the engine's reason)."""
        return {"named": "stop", "required": "tool_calls"}.get(self.mode)


def plan(
    tools: list[Tool] | None,
    choice: Any,
    parallel: bool,
    parser: str | None,
) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); 400 for a choice it cannot serve."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if parser is None:
            raise InvalidRequest(
                'tool_choice "auto" needs a tool-call parser: start the server with '
                '--tool-call-parser (e.g. hermes), or use "required" or a named function',
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        items = {"anyOf": [_call_schema(t) for t in tools]}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        schema["maxItems"] = MAX_REQUIRED_CALLS if parallel else 1
        return ToolPlan("required", tools, constraint=Constraint("json", json.dumps(schema)))
    name = _named(choice)
    found = next((t for t in tools if t.function.name == name), None)
    if found is None:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    constraint = Constraint("json", json.dumps(found.function.parameters))
    return ToolPlan("named", tools, named=name, constraint=constraint)


def _named(choice: Any) -> str:
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        return str(choice["function"]["name"])
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"enum": [tool.function.name]},
            "parameters": tool.function.parameters,
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _json_list(text: str) -> list[dict[str, Any]]:
    """The objects of a JSON array, or of the complete elements of an array cut short (at
    max_tokens): an element counts once its closing brace is there."""
    decoder, found = json.JSONDecoder(), []
    text = text.lstrip()
    if not text.startswith("["):
        return []
    pos = 1
    while True:
        pos = _skip_blanks(text, pos)
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break  # the end of the array, or an element cut short
        if isinstance(value, dict):
            found.append(value)
        pos = _skip_blanks(text, pos)
        if not text.startswith(",", pos):
            break
        pos += 1
    return found


def _skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def hermes_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; a
    block that is not such JSON stays in the content."""
    return parse("hermes", text)


class HermesStream(CallStream):
    """Hermes calls in a stream: content is released as it comes, except a tail that may begin
    `<tool_call>`."""

    def __init__(self) -> None:
        super().__init__("hermes")


class ToolStream:
    """One streamed choice of a chat with tools: `feed` each output's text, get the content
    to send now and the tool calls completed so far."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls_sent = 0
        self._text = ""
        auto = plan.mode == "auto" and plan.parser is not None
        self._calls = CallStream(plan.parser or "") if auto else None
        self._started, self._blanks = False, ""

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """Content to send now, and the calls completed by `text`."""
        if self.plan.mode == "none":
            return text, []
        if self._calls is not None:
            content, calls = self._calls.feed(text, final=finished)
            content = self._trimmed(content, finished)
        elif self.plan.mode == "required":  # each element of the array once it is closed
            self._text += text
            closed = finished or "}" in text
            content, calls = "", (self.plan.calls(self._text)[1] if closed else [])
            calls = calls[self.calls_sent :]
        else:  # a named call: its JSON is read once whole
            self._text += text
            content, calls = "", (self.plan.calls(self._text)[1] if finished else [])
        self.calls_sent += len(calls)
        return content, calls

    def _trimmed(self, content: str, finished: bool) -> str:
        """The content without the blanks at the ends of the whole, as the answer's content
        is stripped: leading ones dropped, trailing ones held until more content follows."""
        content = self._blanks + content
        if not self._started:
            content = content.lstrip()
            self._started = bool(content)
        body = content.rstrip()
        self._blanks = "" if finished else content[len(body) :]
        return body

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish_reason once it ended with `reason`."""
        if self.calls_sent and reason != "length":
            return self.plan.finish_reason or "tool_calls"
        return reason
