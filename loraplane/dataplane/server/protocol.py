"""Request bodies of the server's routes (pydantic), and their translation to engine params.

OpenAI routes accept fields they do not know (clients send new ones all the time, and vLLM
accepts them too) but refuse known features the engine does not implement with a clear 400
rather than silently ignoring them. Admin routes forbid unknown fields.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplane.dataplane.sampling import MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, SamplingParams
from loraplane.dataplane.server.errors import InvalidRequest
from loraplane.dataplane.server.settings import MAX_N
from loraplane.dataplane.server.structured_fields import (
    from_response_format,
    from_structured_outputs,
)
from loraplane.dataplane.server.tools import Tool, ToolPlan, plan
from loraplane.dataplane.structured import CompiledGrammar, Constraint, GrammarError

MAX_STOP = 16  # stop strings per request at most

# Known request fields (OpenAI's and vLLM's) that this server does not implement: a request that
# sets one gets a 400 naming it, never a 200 that ignores it. A value that asks for nothing
# (null, false, an empty list, "none") passes. vLLM retired the guided_* fields for
# structured_outputs; they are named here so that old clients learn it instead of being ignored.
NOT_IMPLEMENTED: dict[str, str] = {
    "guided_json": "guided_json was retired by vLLM (use structured_outputs)",
    "guided_regex": "guided_regex was retired by vLLM (use structured_outputs)",
    "guided_choice": "guided_choice was retired by vLLM (use structured_outputs)",
    "guided_grammar": "guided_grammar was retired by vLLM (use structured_outputs)",
    "guided_json_object": "guided_json_object was retired by vLLM (use structured_outputs)",
    "guided_decoding_backend": "guided_decoding_backend was retired by vLLM",
    "guided_whitespace_pattern": "guided_whitespace_pattern was retired by vLLM",
    "functions": "functions (tools) are not supported by this server",
    "function_call": "function_call (tools) is not supported by this server",
    "use_beam_search": "use_beam_search: beam search is not supported by this server",
    "length_penalty": "length_penalty (beam search) is not supported by this server",
    "bad_words": "bad_words is not supported by this server",
    "allowed_token_ids": "allowed_token_ids is not supported by this server",
    "prompt_embeds": "prompt_embeds is not supported by this server",
    "logits_processors": "logits_processors is not supported by this server",
    "prediction": "prediction (predicted outputs) is not supported by this server",
    "audio": "audio output is not supported by this server",
    "reasoning_effort": "reasoning_effort is not supported by this server",
    "web_search_options": "web_search_options is not supported by this server",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported by this server",
    "spaces_between_special_tokens": (
        "spaces_between_special_tokens is not supported by this server"
    ),
}


def _asks_for_nothing(name: str, value: Any) -> bool:
    """True for a value of a NOT_IMPLEMENTED field that changes nothing."""
    if value is None or value is False or value == [] or value == {}:
        return True
    if name == "tool_choice":
        return bool(value == "none")
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "spaces_between_special_tokens":
        return value is True  # vLLM's default
    return False


class StreamOptions(BaseModel):
    """`stream_options`: include_usage and vLLM's continuous_usage_stats.

    As vLLM's: include_usage (a final usage chunk) is true unless set false or null once
    stream_options is given; continuous_usage_stats adds the usage so far to every chunk, and
    only together with include_usage."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class Generation(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=300)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def check_supported(self) -> None:
        """400 for requested features the engine does not have."""
        for name, value in (self.model_extra or {}).items():
            message = NOT_IMPLEMENTED.get(name)
            if message is not None and not _asks_for_nothing(name, value):
                raise InvalidRequest(message, param=name)
        if self.top_k == 0:
            raise InvalidRequest("top_k must be -1 (off) or >= 1", param="top_k")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed with stream", param="stream_options"
            )

    def stop_list(self) -> list[str]:
        """`stop` as a list of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise InvalidRequest(f"at most {MAX_STOP} stop sequences", param="stop")
        return [s for s in stops if s]

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's limit on generated tokens per choice, if any."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far (vLLM: only together with
        include_usage)."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)

    def constraint(self) -> Constraint | None:
        """The structured output asked for: OpenAI's `response_format` or vLLM's
        `structured_outputs` (not both); 400 with the reason when it is malformed."""
        extra = self.model_extra or {}
        found = None
        for name, parse in (
            ("response_format", from_response_format),
            ("structured_outputs", from_structured_outputs),
        ):
            if extra.get(name) is None:
                continue
            try:
                constraint = parse(extra[name])
            except GrammarError as e:
                raise InvalidRequest(str(e), param=name) from None
            if constraint is not None and found is not None:
                raise InvalidRequest(
                    "send response_format or structured_outputs, not both", param=name
                )
            found = found or constraint
        return found

    def bias(self) -> dict[int, float]:
        """`logit_bias` with token ids as ints (JSON keys are strings)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                out[int(key)] = value
            except ValueError:
                raise InvalidRequest(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
        return out

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> SamplingParams:
        """Engine sampling params for one choice (n is the server's business); `logprobs` is
        None (none wanted) or the number of alternatives per token, `prompt_logprobs` the same
        for the prompt's tokens."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0,
                seed=None if self.seed is None else self.seed % 2**63,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop_list(),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs is not None,
                top_logprobs=logprobs or 0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                logit_bias=self.bias(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                prompt_logprobs=prompt_logprobs,
                grammar=grammar,
            )
        except ValueError as e:
            raise InvalidRequest(str(e)) from None


class CompletionRequest(Generation):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def check_supported(self) -> None:
        """400 for requested features the engine does not have."""
        super().check_supported()
        extra = self.model_extra or {}
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if not _asks_for_nothing(name, extra.get(name)):
                raise InvalidRequest(f"{name} is for chat completions only", param=name)
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of other than n is not supported", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one text or token list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        if all(isinstance(x, str) for x in p):
            return [x for x in p if isinstance(x, str)]
        return [list(x) for x in p if isinstance(x, list)]


class ChatMessage(BaseModel):
    """One message of a chat; content is text or a list of text parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, earlier in the chat
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def to_template(self) -> dict[str, Any]:
        """The dict the chat template sees: role and content text."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        "only text content parts are supported", param="messages.content"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier tool call as chat templates expect it: arguments as an object when they are
    JSON text (OpenAI sends text; HF templates render `arguments | tojson`)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


class ChatCompletionRequest(Generation):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM's extension

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """How this request uses its tools (see tools.py); 400 for what cannot be served."""
        found = plan(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        if found is not None and found.constraint is not None and self.constraint() is not None:
            raise InvalidRequest(
                "a forced tool call and response_format / structured_outputs exclude each other",
                param="tool_choice",
            )
        if (
            found is not None
            and found.parser == "mistral"
            and "skip_special_tokens" not in self.model_fields_set
        ):
            # [TOOL_CALLS] is a special token: kept in the text for the parser, as vLLM's
            # mistral parser does (EOS's text is not output: the engine drops a stop token's)
            self.skip_special_tokens = False
        return found

    def check_supported(self) -> None:
        """400 for requested features the engine does not have."""
        super().check_supported()
        if (self.model_extra or {}).get("echo"):
            raise InvalidRequest("echo is not supported for chat completions", param="echo")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens


class LoadLoRARequest(BaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's shape); `lora_path` is refused, never used."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=300)
    lora_path: str | None = None


class PinLoRARequest(BaseModel):
    """`POST /v1/pin_lora_adapter` and `/v1/unpin_lora_adapter`: a --lora-modules name."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=300)


class UnloadLoRARequest(BaseModel):
    """`POST /v1/unload_lora_adapter` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=300)
    lora_int_id: int | None = None
