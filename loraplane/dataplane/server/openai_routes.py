"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models(/{id}).

Each completion request, cheapest refusal first: check the key, resolve `model` through the
catalog, take its places in the queue and lease the adapter (queue caps), pass the tenant's
rate limits (on an estimate of its prompt tokens, settled once counted), then, on workers that
tenants share fairly (intake.py), tokenize (the chat template for chat), fit max_tokens to the
context (vLLM's rule: 400 when prompt + max_tokens exceeds it) and compile the grammar; then run
`n` engine requests per prompt and answer a JSON body or an SSE stream ending with
`data: [DONE]`. Answers with a part per token (log-probabilities, an echo) are built on a
tokenizing worker from a table of token texts, not on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from loraplane.dataplane.outputs import RequestOutput
from loraplane.dataplane.server import openai_format as fmt
from loraplane.dataplane.server.catalog import ModelEntry, Resolved
from loraplane.dataplane.server.deps import CallerKeyDep, CatalogDep, RolloutKeyDep, RuntimeDep
from loraplane.dataplane.server.errors import APIError, InvalidRequest, ModelNotFound
from loraplane.dataplane.server.generation import (
    Choice,
    Job,
    collect,
    fit_max_tokens,
    make_choices,
    run_job,
)
from loraplane.dataplane.server.limits import estimate_tokens
from loraplane.dataplane.server.protocol import ChatCompletionRequest, CompletionRequest, Generation
from loraplane.dataplane.server.request_metrics import stream_failed
from loraplane.dataplane.server.rollout import sticky_key
from loraplane.dataplane.server.runtime import Lease, Runtime
from loraplane.dataplane.server.streaming import ClientGone, EventStream, unless_disconnected
from loraplane.dataplane.server.tools import ToolPlan, ToolStream
from loraplane.dataplane.structured import CompiledGrammar, Constraint, GrammarError

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])
COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions and vLLM


@router.get("/models")
async def list_models(runtime: RuntimeDep, catalog: CatalogDep, key: CallerKeyDep) -> Any:
    """The base model and the caller's adapters (each with `parent` = the base model)."""
    created = int(time.time())
    rows = await catalog.list_models(key)
    return {"object": "list", "data": [_model_entry(runtime, row, created) for row in rows]}


@router.get("/models/{model:path}")
async def retrieve_model(
    model: str, runtime: RuntimeDep, catalog: CatalogDep, key: CallerKeyDep
) -> Any:
    """One entry of the caller's list; another tenant's adapter is as unknown (404)."""
    for row in await catalog.list_models(key):
        if row.id == model:
            return _model_entry(runtime, row, int(time.time()))
    raise ModelNotFound(model)


def _model_entry(runtime: Runtime, row: ModelEntry, created: int) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "model",
        "created": created,
        "owned_by": "loraplane",
        "root": row.id,
        "parent": row.parent,
        "max_model_len": runtime.max_model_len,
    }


@router.post("/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    runtime: RuntimeDep,
    catalog: CatalogDep,
    key: CallerKeyDep,
    rollout_key: RolloutKeyDep = None,
) -> Response:
    """Text completion of one or more prompts."""
    body.check_supported()
    resolved = await catalog.resolve(
        key, body.model, rollout_key=sticky_key(rollout_key, body.user)
    )
    engine = runtime.require_engine()
    tokenizer, vocab = engine.tokenizer, engine.vocab_size
    texts = body.prompts()
    cap = runtime.settings.max_prompts_per_request
    if len(texts) > cap:
        runtime.metrics.refused.labels(reason="too_many_prompts").inc()
        raise InvalidRequest(f"{len(texts)} prompts in one request; at most {cap}", param="prompt")

    def tokenize() -> Tokenized:
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in texts]
        prompts = _checked(prompts, body.truncate_prompt_tokens, vocab)
        if not body.echo:
            return prompts, None
        # the echo is the prompt as given, or the text of its token ids
        return prompts, [p if isinstance(p, str) else tokenizer.decode(p) for p in texts]

    estimate = sum(estimate_tokens(len(p)) if isinstance(p, str) else len(p) for p in texts)
    return await _serve(
        request, runtime, resolved, body, Intake(len(texts), estimate, tokenize),
        COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs, chat=False,
    )  # fmt: skip


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    runtime: RuntimeDep,
    catalog: CatalogDep,
    key: CallerKeyDep,
    rollout_key: RolloutKeyDep = None,
) -> Response:
    """Chat completion, the prompt rendered with the base model's chat template."""
    body.check_supported()
    tools = body.tool_plan(runtime.settings.tool_call_parser)
    resolved = await catalog.resolve(
        key, body.model, rollout_key=sticky_key(rollout_key, body.user)
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    return await _serve(
        request, runtime, resolved, body, chat_intake(runtime, body, tools), None, top, chat=True,
        tools=tools,
    )  # fmt: skip


def chat_intake(runtime: Runtime, body: ChatCompletionRequest, tools: ToolPlan | None) -> Intake:
    """A chat's Intake: its messages (and tools) rendered with the chat template and tokenized
    (on a tokenizing worker), "messages" named in a template's error."""
    engine = runtime.require_engine()
    tokenizer, vocab = engine.tokenizer, engine.vocab_size
    messages = [m.to_template() for m in body.messages]
    listed = tools.template_tools if tools is not None else None

    def tokenize() -> Tokenized:
        try:
            prompt = tokenizer.encode_chat(messages, body.add_generation_prompt, tools=listed)
        except (jinja2.TemplateError, ValueError) as e:
            raise InvalidRequest(f"cannot apply the chat template: {e}", param="messages") from None
        return _checked([prompt], body.truncate_prompt_tokens, vocab), None

    return Intake(1, estimate_tokens(sum(len(m["content"]) for m in messages)), tokenize)


Tokenized = tuple[list[list[int]], list[str] | None]  # the prompts' ids, the echoed texts


@dataclass(frozen=True, slots=True)
class Intake:
    """A request's prompts before tokenization: how many, their estimated tokens (for the
    rate limit), and the work that tokenizes them (on a tokenizing worker)."""

    prompts: int
    estimated_tokens: int
    tokenize: Callable[[], Tokenized]


def _checked(prompts: list[list[int]], truncate: int | None, vocab: int) -> list[list[int]]:
    """The prompts truncated (before the context check, as vLLM does), their ids checked to be
    in the vocabulary (min and max: no Python loop over the tokens)."""
    if truncate is not None:
        prompts = [p[-truncate:] for p in prompts]
    for tokens in prompts:
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="prompt")
    return prompts


async def _serve(
    request: Request,
    runtime: Runtime,
    resolved: Resolved,
    body: Generation,
    intake: Intake,
    default_max: int | None,
    top: int | None,
    *,
    chat: bool,
    tools: ToolPlan | None = None,
) -> Response:
    """Admit, then take in, then run (see `admit`)."""
    admitted = await admit(
        request, runtime, resolved, body, intake, default_max, top, tools=tools,
        prefix="chatcmpl-" if chat else "cmpl-",
    )  # fmt: skip
    if admitted is None:
        return Response(status_code=499)
    job, lease = admitted
    created, model = int(time.time()), body.model
    if body.stream:
        usage, continuous = body.include_usage, body.continuous_usage
        events = _events(runtime, job, created, model, top, chat=chat, usage=usage,
                         continuous=continuous,
                         on_error=functools.partial(stream_failed, request))  # fmt: skip
        return EventStream(events, on_close=lease.release)
    return await _answer(request, runtime, job, lease, created, model, top, chat)


async def admit(
    request: Request,
    runtime: Runtime,
    resolved: Resolved,
    body: Generation,
    intake: Intake,
    default_max: int | None,
    top: int | None,
    *,
    tools: ToolPlan | None,
    prefix: str,
) -> tuple[Job, Lease] | None:
    """Admit, then take in: the request's Job (id `prefix` + hex) and its adapter lease, which
    the caller releases once the answer is over; None when the client went away meanwhile.
    The cheap refusals come first (queue caps, rate limit): a refused request costs no
    tokenizer or compiler time; from the lease on, every failure gives the lease back."""
    request.state.tenant = resolved.tenant  # for loraplane_requests_total{tenant,code}
    if resolved.adapter is not None and resolved.version is not None:  # per-version counts
        request.state.adapter_version = (resolved.adapter, resolved.version)
    forced = tools.constraint if tools is not None else None
    constraint = forced or body.constraint()  # parsed (a malformed one is a 400), not compiled
    # the sampling parameters checked now (a bad one is a 400 before any work), set after intake
    body.sampling_params(max(runtime.max_model_len, 1), top, body.prompt_logprobs)
    lease = await runtime.lease(resolved, body.model, intake.prompts * body.n)
    try:
        tokens_per_minute = runtime.share(resolved.tokens_per_minute)  # this replica's share
        runtime.limiter.admit(
            resolved.tenant,
            requests_per_minute=runtime.share(resolved.requests_per_minute),
            tokens_per_minute=tokens_per_minute,
            prompt_tokens=intake.estimated_tokens,
        )
        work = _take_in(runtime, resolved, body, intake, constraint, default_max, top)
        choices, hide_output = await unless_disconnected(request, asyncio.create_task(work))
    except ClientGone:
        lease.release()
        return None
    except BaseException:
        lease.release()
        raise
    job = Job(
        f"{prefix}{uuid.uuid4().hex}", resolved.tenant, resolved.adapter, lease.ref, choices,
        tokens_per_minute=tokens_per_minute, hide_output=hide_output, tools=tools,
    )  # fmt: skip
    return job, lease


async def _take_in(
    runtime: Runtime,
    resolved: Resolved,
    body: Generation,
    intake: Intake,
    constraint: Constraint | None,
    default_max: int | None,
    top: int | None,
) -> tuple[list[Choice], bool]:
    """Tokenize, settle the rate limit on the counted tokens, fit max_tokens, compile the
    grammar: a request's choices and whether its output is hidden (echo only)."""
    tenant = resolved.tenant
    prompts, echo = await runtime.tokenize(tenant, intake.tokenize)
    runtime.limiter.settle(
        tenant, tokens_per_minute=runtime.share(resolved.tokens_per_minute),
        estimated=intake.estimated_tokens, counted=sum(len(p) for p in prompts),
    )  # fmt: skip
    limit = runtime.max_model_len
    wanted = body.requested_max_tokens
    hide_output = wanted == 0  # echo only: the engine samples one token, never shown
    if hide_output:
        wanted = 1
    limits = [fit_max_tokens(len(p), wanted, default_max, limit) for p in prompts]
    prompt_logprobs = body.prompt_logprobs
    if echo is not None and top is not None:  # the echoed prompt carries log-probabilities
        prompt_logprobs = max(prompt_logprobs or 0, top)
    grammar = await _grammar(runtime, tenant, constraint)
    params = body.sampling_params(max(limits), top, prompt_logprobs, grammar)
    choices = make_choices(prompts, params, body.n, limits)
    if echo is not None:
        for c in choices:
            c.echo = echo[c.index // body.n]
    return choices, hide_output


async def _answer(
    request: Request,
    runtime: Runtime,
    job: Job,
    lease: Lease,
    created: int,
    model: str,
    top: int | None,
    chat: bool,
) -> Response:
    try:
        await unless_disconnected(request, asyncio.create_task(collect(runtime, job)))
    except ClientGone:
        return Response(status_code=499)
    finally:
        lease.release()
    build = fmt.chat_body if chat else fmt.completion_body
    if not _per_token(job, top):
        return JSONResponse(build(job, job.request_id, created, model, top, _token_text(runtime)))
    # log-probabilities, an echo: per-token work, done (and serialised) on a worker
    text = _token_text(runtime, await runtime.token_texts(job.tenant))

    def render() -> bytes:
        body = build(job, job.request_id, created, model, top, text)
        return fmt.json_text(body, fmt.BODY_JSON).encode()

    return Response(await runtime.tokenize(job.tenant, render), media_type="application/json")


def _per_token(job: Job, top: int | None) -> bool:
    """Whether the answer has a part per token (log-probabilities, an echo's, the prompt's)."""
    return top is not None or any(
        c.echo is not None or c.prompt_logprobs is not None for c in job.choices
    )


def _tool_deltas(stream: ToolStream, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
    """A chat-with-tools choice's stream entries for one output: content as it may be shown,
    each tool call whole once complete, the finish reason at the end."""
    content, calls = stream.feed(out.text, out.finished)
    entries: list[dict[str, Any]] = []
    if content:
        entries.append({"index": choice.index, "delta": {"content": content}, "logprobs": None,
                        "finish_reason": None})  # fmt: skip
    first = stream.calls_sent - len(calls)
    if calls:
        deltas = [call.body(index=first + i) for i, call in enumerate(calls)]
        entries.append({"index": choice.index, "delta": {"tool_calls": deltas},
                        "logprobs": None, "finish_reason": None})  # fmt: skip
    if out.finished:
        entries.append({"index": choice.index, "delta": {}, "logprobs": None,
                        "finish_reason": stream.finish_reason(out.finish_reason)})  # fmt: skip
    return entries


async def _grammar(
    runtime: Runtime, tenant: str, constraint: Constraint | None
) -> CompiledGrammar | None:
    """Compile a structured-output constraint on a compiling worker (never on the event loop
    or the engine thread); 400 with the reason when it cannot be compiled."""
    if constraint is None:
        return None
    engine = runtime.require_engine()
    try:
        return await runtime.compile_grammar(tenant, lambda: engine.grammars().compile(constraint))
    except GrammarError as e:
        raise InvalidRequest(str(e), param="response_format") from None


def _token_text(runtime: Runtime, texts: Sequence[str] = ()) -> fmt.TokenText:
    """Each token's text from the table `texts` (Runtime.token_texts); ids past it (no table,
    or the model's padding past the tokenizer's ids) are decoded."""
    tokenizer = runtime.require_engine().tokenizer

    def text(token_id: int) -> str:
        if 0 <= token_id < len(texts):
            return texts[token_id]
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text


async def _events(
    runtime: Runtime,
    job: Job,
    created: int,
    model: str,
    top: int | None,
    *,
    chat: bool,
    usage: bool,
    continuous: bool = False,
    on_error: Callable[[int], None] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE stream of a job. With `usage`, every chunk has `usage` (null, or with
    `continuous` the usage of its choice so far, as vLLM's continuous_usage_stats) and a last
    chunk without choices carries the request's usage. A failure once started is an error
    event, its status told to `on_error` (the version's error count)."""
    rid = job.request_id

    def so_far(choice: Choice, unshown: int = 0) -> dict[str, Any] | None:
        return fmt.running_usage(choice, job.hide_output, unshown) if continuous else None

    def chunk(entries: list[dict[str, Any]], choice: Choice) -> bytes:
        return fmt.sse(fmt.chunk(rid, created, model, entries, chat=chat, include_usage=usage,
                                 usage_body=so_far(choice)))  # fmt: skip

    def prompt_chunk(choice: Choice, text: fmt.TokenText, unshown: int) -> bytes:
        entry = fmt.stream_prompt(choice, top, text, chat=chat)
        return fmt.sse(fmt.chunk(rid, created, model, [entry], chat=chat, include_usage=usage,
                                 usage_body=so_far(choice, unshown)), sliced=True)  # fmt: skip

    try:
        texts = await runtime.token_texts(job.tenant) if _per_token(job, top) else ()
        text = _token_text(runtime, texts)
        if chat:
            for c in job.choices:
                role = {"role": "assistant", "content": ""}
                yield chunk([{"index": c.index, "delta": role, "logprobs": None,
                              "finish_reason": None}], c)  # fmt: skip
        started: set[int] = set()
        streams = {c.index: ToolStream(job.tools) for c in job.choices} if job.tools else {}
        async with contextlib.aclosing(run_job(runtime, job)) as outputs:
            async for choice, out in outputs:
                first = choice.index not in started
                started.add(choice.index)
                if choice.index in streams and streams[choice.index].plan.mode != "none":
                    for entry in _tool_deltas(streams[choice.index], choice, out):
                        yield chunk([entry], choice)
                    continue
                if first and (choice.echo is not None or choice.prompt_logprobs is not None):
                    # a whole prompt's entries: built (and serialised) on a worker
                    yield await runtime.tokenize(
                        job.tenant,
                        functools.partial(prompt_chunk, choice, text, len(out.token_ids)),
                    )
                if job.hide_output:  # echo only: the sampled token is not shown
                    if out.finished:
                        yield chunk([fmt.stream_choice(choice, [], "", None, None, "length",
                                                       chat=chat, top=top, text=text)],
                                    choice)  # fmt: skip
                    continue
                if not (out.text or out.finished or (top is not None and out.logprobs)):
                    continue  # nothing to show yet (a partial character or a possible stop)
                reason = out.finish_reason if out.finished else None
                entry = fmt.stream_choice(
                    choice, out.token_ids, out.text, out.logprobs, out.top_logprobs, reason,
                    chat=chat, top=top, text=text,
                )  # fmt: skip
                yield chunk([entry], choice)
        if usage:
            yield fmt.sse(
                fmt.chunk(rid, created, model, [], chat=chat, include_usage=True,
                          usage_body=fmt.usage(job))
            )  # fmt: skip
    except APIError as e:
        if on_error is not None:
            on_error(e.status)
        yield fmt.sse(e.body())
    except Exception:
        log.exception("stream %s failed", rid)
        if on_error is not None:
            on_error(500)
        yield fmt.sse(APIError("internal server error").body())
    yield fmt.DONE
