"""The Responses API: `POST /v1/responses`, which the openai client's `responses` methods and the
OpenAI Agents SDK speak.

A request is translated into a chat completion request and served by chat's own pipeline
(openai_routes.admit): the caller's key, `model` resolved through the catalog (an adapter of the
caller's tenant, or the base model), queue caps, rate limits, the chat template, max tokens
against the context, structured outputs and tools, usage metering. Only the answer's shape is
the Responses API's (responses_format.py).

Translation:
- `instructions` is a system message first; `input` a string (one user message) or a list of
  items: messages (roles user, system, developer, assistant; content a string or
  `input_text` / `output_text` / `refusal` parts), `function_call` items (an assistant turn's
  `tool_calls`, merged into the assistant message before them) and `function_call_output`
  items (`tool` messages answering a call_id given earlier in the input).
- `max_output_tokens` is max_completion_tokens; `text.format` (`json_schema`, `json_object`)
  is response_format; `tools` (flat function tools) and `tool_choice` (`{"type": "function",
  "name"}` named) are chat's; vLLM's sampling extensions (`seed`, `top_k`, `stop`,
  `structured_outputs`, ...) pass through as in chat.

Nothing is stored: `store: true`, `previous_response_id`, `conversation` and `background` are
400s naming the parameter, and `GET`/`DELETE /v1/responses/{id}` answer 404. Content that is not
text (images, files, audio), tools other than functions and other known features this server
does not have are 400s naming them, never silently ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplane.dataplane.server import responses_format as rfmt
from loraplane.dataplane.server.deps import CallerKeyDep, CatalogDep, RolloutKeyDep, RuntimeDep
from loraplane.dataplane.server.errors import APIError, InvalidRequest, NotFound
from loraplane.dataplane.server.generation import Job, collect, run_job
from loraplane.dataplane.server.openai_routes import admit, chat_intake
from loraplane.dataplane.server.protocol import NOT_IMPLEMENTED, ChatCompletionRequest
from loraplane.dataplane.server.request_metrics import stream_failed
from loraplane.dataplane.server.rollout import sticky_key
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.streaming import ClientGone, EventStream, unless_disconnected
from loraplane.dataplane.server.tools import ToolCall, ToolStream

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])

# chat request fields a Responses request may carry as they are (vLLM's extensions, seed),
# and the known fields chat refuses (so that they are refused here too)
PASSED_TO_CHAT = frozenset({
    "seed", "stop", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "logit_bias",
    "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
    "structured_outputs", *NOT_IMPLEMENTED,
})  # fmt: skip
NOT_STORED = (
    "this server does not store responses: send the whole conversation in `input` "
    "(with `store: false` or no `store`)"
)
# Responses fields this server does not implement: a value other than the ones that ask for
# nothing is a 400 naming the field
REFUSED: dict[str, str] = {
    "previous_response_id": f"previous_response_id is not supported: {NOT_STORED}",
    "conversation": f"conversation is not supported: {NOT_STORED}",
    "background": "background responses are not supported by this server (they are stored)",
    "prompt": "prompt (stored prompt templates) is not supported by this server",
    "max_tool_calls": "max_tool_calls is not supported by this server",
    "context_management": "context_management is not supported by this server",
    "top_logprobs": "top_logprobs is not supported by the Responses API of this server "
    "(chat completions return log-probabilities)",
}
INCLUDABLE = frozenset({"reasoning.encrypted_content"})  # there is no reasoning: nothing to add
# chat's parameter names in errors, as a Responses client knows them
PARAMS = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens",
          "max_completion_tokens": "max_output_tokens"}  # fmt: skip


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` (unknown fields are accepted, as in chat)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=300)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    service_tier: str | None = None

    def check_supported(self) -> None:
        """400 for what a server that stores nothing and has no reasoning cannot serve."""
        if self.store:
            raise InvalidRequest(f"store: true is not supported: {NOT_STORED}", param="store")
        extra = self.model_extra or {}
        for name, message in REFUSED.items():
            value = extra.get(name)
            if not (value is None or value is False or value in ([], {}, "", 0)):
                raise InvalidRequest(message, param=name)
        if self.truncation == "auto":
            raise InvalidRequest(
                'truncation "auto" is not supported: a prompt over the context is a 400',
                param="truncation",
            )
        reasoning = {k: v for k, v in (self.reasoning or {}).items() if v is not None}
        if reasoning.get("effort") in (None, "none"):
            reasoning.pop("effort", None)
        if reasoning:
            raise InvalidRequest(
                "reasoning is not supported by this server (the model does not reason)",
                param="reasoning",
            )
        for value in self.include or []:
            if value not in INCLUDABLE:
                raise InvalidRequest(f"include {value!r} is not supported", param="include")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed with stream", param="stream_options"
            )

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion request that serves this one; 400 for what it cannot hold."""
        self.check_supported()
        extra = self.model_extra or {}
        chat: dict[str, Any] = {k: v for k, v in extra.items() if k in PASSED_TO_CHAT}
        chat.update(
            model=self.model,
            messages=messages(self.instructions, self.input),
            stream=self.stream,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=chat_tools(self.tools),
            tool_choice=chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
        )
        if self.user is not None:
            chat["user"] = self.user
        response_format = self.response_format()
        if response_format is not None:
            chat["response_format"] = response_format
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            raise InvalidRequest(f"{param}: {first.get('msg')}", param=param) from None

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format (None for plain text)."""
        text = self.text or {}
        verbosity = text.get("verbosity")
        if verbosity not in (None, "medium"):
            raise InvalidRequest("text.verbosity is not supported", param="text.verbosity")
        spec = text.get("format")
        if spec is None:
            return None
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind != "json_schema":
            raise InvalidRequest(
                "text.format.type must be 'text', 'json_object' or 'json_schema'",
                param="text.format",
            )
        assert isinstance(spec, dict)
        if not isinstance(spec.get("name", ""), str):
            raise InvalidRequest("text.format.name must be a string", param="text.format.name")
        if not isinstance(spec.get("schema"), dict):
            raise InvalidRequest(
                "text.format.schema must be a JSON Schema object", param="text.format.schema"
            )
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise InvalidRequest("text.format.strict must be a boolean", param="text.format.strict")
        fields = {k: spec[k] for k in ("name", "schema", "strict") if spec.get(k) is not None}
        return {"type": "json_schema", "json_schema": fields}

    def echo(self) -> dict[str, Any]:
        """The settings a `response` object repeats back."""
        text: dict[str, Any] = {"format": (self.text or {}).get("format") or {"type": "text"}}
        if (self.text or {}).get("verbosity") is not None:
            text["verbosity"] = (self.text or {})["verbosity"]
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "model": self.model,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tool_choice": "auto" if self.tool_choice is None else self.tool_choice,
            "tools": [_echoed_tool(t) for t in self.tools or []],
            "text": text,
            "truncation": "disabled",
            "store": False,
            "background": False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": self.service_tier or "default",
            "top_logprobs": 0,
            "max_tool_calls": None,
            "user": self.user,
        }


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "description": None, "parameters": None, "strict": True, **tool}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat's (nested under "function"); 400 for any other
    kind of tool (web_search, file_search, mcp, ...)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequest(
                f"tools[{i}]: tool type {kind!r} is not supported (only function tools)",
                param="tools",
            )
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' tool_choice as chat's: "none" / "auto" / "required" as they are, a named
    function `{"type": "function", "name"}` nested; 400 for hosted tools and allowed_tools."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequest(
            f'tool_choice type {choice.get("type")!r} is not supported: use "none", '
            '"auto", "required" or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    raise InvalidRequest("tool_choice must be a string or an object", param="tool_choice")


def messages(instructions: str | None, given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input` (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
        return out
    if not given:
        raise InvalidRequest("input must not be empty", param="input")
    calls: set[str] = set()
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}: role {role!r} is not supported", param="input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _call(item, where)
            calls.add(call["id"])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise InvalidRequest(
                    f"{where}: no function_call with call_id {call_id!r} before this "
                    "function_call_output in input",
                    param="input",
                )
            output = _text(item.get("output"), where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise InvalidRequest(
                f"{where}: input item type {kind!r} is not supported (messages, "
                "function_call and function_call_output are)",
                param="input",
            )
    return out


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call input item as a chat tool call."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise InvalidRequest(
            f"{where}: a function_call needs call_id, name and arguments (JSON text)",
            param="input",
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _text(content: Any, where: str) -> str:
    """A message's (or a call output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "refusal") or not isinstance(
            part.get(key), str
        ):
            raise InvalidRequest(
                f"{where}.content[{j}]: content of type {kind!r} is not supported "
                "(text only: input_text, output_text)",
                param="input",
            )
        texts.append(part[key])
    return "".join(texts)


def _renamed(error: APIError) -> APIError:
    """`error` with chat's parameter names as the Responses API calls them."""
    if error.param in PARAMS:
        error.param = PARAMS[error.param]
        error.message = error.message.replace("response_format.json_schema", "text.format")
    return error


@router.post("/responses")
async def create_response(
    body: ResponsesRequest,
    request: Request,
    runtime: RuntimeDep,
    catalog: CatalogDep,
    key: CallerKeyDep,
    rollout_key: RolloutKeyDep = None,
) -> Response:
    """A model response to text or a conversation (with tools and structured outputs)."""
    try:
        chat = body.to_chat()
        chat.check_supported()
        tools = chat.tool_plan(runtime.settings.tool_call_parser)
        resolved = await catalog.resolve(
            key, body.model, rollout_key=sticky_key(rollout_key, body.user)
        )
        intake = chat_intake(runtime, chat, tools)
        admitted = await admit(
            request, runtime, resolved, chat, intake, None, None, tools=tools, prefix="resp_"
        )
    except APIError as e:
        raise _renamed(e) from None
    if admitted is None:
        return Response(status_code=499)
    job, lease = admitted
    created, echo = int(time.time()), body.echo()
    if body.stream:
        events = _events(runtime, job, created, echo, functools.partial(stream_failed, request))
        return EventStream(events, on_close=lease.release)
    try:
        await unless_disconnected(request, asyncio.create_task(collect(runtime, job)))
    except ClientGone:
        return Response(status_code=499)
    finally:
        lease.release()
    return JSONResponse(_final(job, created, echo, rfmt.output_items(job)))


def _final(job: Job, created: int, echo: dict[str, Any], output: list[dict[str, Any]]) -> Any:
    status = rfmt.status_of(job)
    return rfmt.response(
        job.request_id, created, echo, status, output, rfmt.usage(job),
        completed_at=int(time.time()) if status == "completed" else None,
    )  # fmt: skip


def _sse(event: dict[str, Any]) -> bytes:
    """One typed event (`event:` names its type, as OpenAI sends them)."""
    data = json.dumps(event, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _events(
    runtime: Runtime,
    job: Job,
    created: int,
    echo: dict[str, Any],
    on_error: Callable[[int], None] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The stream: created, in_progress, each item's events as the text comes, then completed
    (or incomplete) with the whole response and its usage; a failure once started is a
    `response.failed` event with the error and the output so far, its status told to
    `on_error` (the version's error count)."""
    numbers = iter(range(1 << 62))

    def emit(*events: rfmt.Event) -> bytes:
        return b"".join(_sse({**event, "sequence_number": next(numbers)}) for event in events)

    rid = job.request_id
    plan = job.tools
    output = rfmt.StreamedOutput(plan)
    opening = rfmt.response(rid, created, echo, "in_progress", [], None)
    yield emit({"type": "response.created", "response": opening},
               {"type": "response.in_progress", "response": opening}, *output.start())  # fmt: skip
    try:
        calls = ToolStream(plan) if plan is not None and plan.mode != "none" else None
        async with contextlib.aclosing(run_job(runtime, job)) as outputs:
            async for _, out in outputs:
                found: list[ToolCall] = []
                if calls is None:
                    content = out.text
                else:
                    content, found = calls.feed(out.text, out.finished)
                events = output.text(content)
                ended = out.finished and out.finish_reason == "length"
                for call in found:
                    events += output.call(call, "incomplete" if ended else "completed")
                if events:
                    yield emit(*events)
        status = rfmt.status_of(job)
        final = _final(job, created, echo, output.items)
        yield emit(*output.close(status), {"type": f"response.{status}", "response": final})
    except Exception as e:
        if isinstance(e, APIError):
            log.info("response stream %s failed: %s", rid, e.message)
            error = {"code": e.code or e.type, "message": e.message}
        else:
            log.exception("response stream %s failed", rid)
            error = {"code": "server_error", "message": "internal server error"}
        if on_error is not None:
            on_error(e.status if isinstance(e, APIError) else 500)
        failed = rfmt.response(rid, created, echo, "failed", output.so_far(), rfmt.usage(job),
                               error=error)  # fmt: skip
        yield emit({"type": "response.failed", "response": failed})


NOT_STORED_404: dict[int | str, dict[str, Any]] = {404: {"description": "responses are not stored"}}


def _not_stored(response_id: str) -> NotFound:
    error = NotFound(f"No response with id {response_id!r}: {NOT_STORED}", param="response_id")
    return error


@router.get("/responses/{response_id}", responses=NOT_STORED_404)
async def get_response(response_id: str, _: CallerKeyDep) -> Response:
    """404: responses are not stored."""
    raise _not_stored(response_id)


@router.delete("/responses/{response_id}", responses=NOT_STORED_404)
async def delete_response(response_id: str, _: CallerKeyDep) -> Response:
    """404: responses are not stored."""
    raise _not_stored(response_id)


@router.get("/responses/{response_id}/input_items", responses=NOT_STORED_404)
async def list_input_items(response_id: str, _: CallerKeyDep) -> Response:
    """404: responses are not stored."""
    raise _not_stored(response_id)


@router.post("/responses/{response_id}/cancel", responses=NOT_STORED_404)
async def cancel_response(response_id: str, _: CallerKeyDep) -> Response:
    """404: responses are not stored (and none runs in the background)."""
    raise _not_stored(response_id)
