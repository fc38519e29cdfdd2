"""One HTTP request's engine work: its choices, run as engine requests, merged into one stream.

A request with `p` prompts and `n` choices becomes `p * n` engine requests with derived ids
(`<id>-<choice index>`); choice `i` of a seeded request gets seed `seed + i`, so choices differ
but repeat. Each engine request is timed (time to first token, inter-token latency) and its
tokens are counted for metrics, usage reports and the tenant's tokens-per-minute limit.
Closing the merged stream (a client went away) closes every engine stream, which aborts the
engine requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import cast

from loraplane.adapters.errors import ReasonCode
from loraplane.dataplane.outputs import ADAPTER_LOAD_TIMEOUT, RequestOutput, TopLogprobs
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef, PromptLogprob
from loraplane.dataplane.server.errors import (
    AdapterLoadTimeout,
    AdapterRefused,
    ContextTooLong,
    InvalidRequest,
    Unavailable,
)
from loraplane.dataplane.server.runtime import Runtime
from loraplane.dataplane.server.tools import ToolPlan

# RequestOutput.error_code values that refuse the adapter for good (isolation.py): a client
# error (AdapterRefused), never a retry
REFUSALS = frozenset(code.value for code in ReasonCode)


@dataclass(slots=True)
class Choice:
    """One engine request of an HTTP request, and what it produced so far."""

    index: int
    tokens: list[int]  # the prompt
    params: SamplingParams
    counts_prompt: bool  # the first choice of its prompt: its prompt tokens go into usage
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # per prompt token after the first
    finish_reason: str | None = None
    echo: str | None = None  # completions with echo: the prompt's text, shown first
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class Job:
    """Everything the engine runs for one HTTP request."""

    request_id: str
    tenant: str
    adapter: str | None
    lora: LoRARef | None
    choices: list[Choice]
    tokens_per_minute: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    # max_tokens 0 with echo: the engine runs one token (it always samples one), not shown
    hide_output: bool = False
    tools: ToolPlan | None = None  # chat with tools: how calls are read out of the text

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request (each prompt once, whatever n is)."""
        return sum(len(c.tokens) for c in self.choices if c.counts_prompt)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt once (the choice that
        counts it in prompt_tokens), as vLLM reports a request's prompt once whatever n is."""
        return sum(c.cached_tokens for c in self.choices if c.counts_prompt)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far over all choices (0 when none are shown)."""
        return 0 if self.hide_output else sum(len(c.token_ids) for c in self.choices)


def fit_max_tokens(prompt_len: int, requested: int | None, default: int | None, limit: int) -> int:
    """vLLM's rule: max_tokens defaults to `default` or what is left of the context; a prompt
    plus max_tokens over the context is refused with 400 (never silently shortened)."""
    if prompt_len >= limit:
        raise ContextTooLong(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{prompt_len} tokens. Please reduce the length of the prompt.",
            param="prompt",
        )
    wanted = requested if requested is not None else default
    if wanted is None:
        return limit - prompt_len
    if prompt_len + wanted > limit:
        raise ContextTooLong(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} in the "
            "completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
        )
    return wanted


def make_choices(
    prompts: list[list[int]], params: SamplingParams, n: int, max_tokens: list[int]
) -> list[Choice]:
    """`n` choices per prompt, in response order; seeded choices get seed + i."""
    choices = []
    for p, tokens in enumerate(prompts):
        if not tokens:
            raise InvalidRequest("a prompt must have at least one token", param="prompt")
        for i in range(n):
            index = p * n + i
            seed = None if params.seed is None else (params.seed + index) % 2**63
            try:
                choice_params = dataclasses.replace(params, seed=seed, max_tokens=max_tokens[p])
            except ValueError as e:  # e.g. min_tokens over what this prompt leaves
                raise InvalidRequest(str(e)) from None
            choices.append(Choice(index, tokens, choice_params, counts_prompt=i == 0))
    return choices


async def _run_choice(
    runtime: Runtime, job: Job, choice: Choice
) -> AsyncGenerator[RequestOutput, None]:
    engine = runtime.require_engine()
    metrics, last, produced = runtime.metrics, job.arrival, 0
    # AsyncEngine.generate is an async generator (annotated as an iterator): it can be closed
    stream = cast(
        AsyncGenerator[RequestOutput, None],
        engine.generate(
            f"{job.request_id}-{choice.index}", choice.tokens, choice.params, job.lora, job.tenant
        ),
    )
    try:
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                if out.error_code == ADAPTER_LOAD_TIMEOUT:  # names the adapter, not a path
                    raise AdapterLoadTimeout(f"{out.error}; try again later", retry_after=5)
                if out.error_code in REFUSALS:  # the adapter can never run here: no retry
                    raise AdapterRefused(out.error or "", param="model", code=out.error_code)
                if out.error is not None:  # e.g. its adapter could not be loaded from the store
                    raise Unavailable(f"request failed: {out.error}", retry_after=5)
                now = time.perf_counter()
                (metrics.itl if produced else metrics.ttft).observe(now - last)
                last, produced = now, produced + len(out.token_ids)
                runtime.limiter.charge(
                    job.tenant, tokens_per_minute=job.tokens_per_minute, tokens=len(out.token_ids)
                )
                yield out
    except ValueError as e:  # the engine refused the request
        raise InvalidRequest(str(e)) from None
    finally:
        prompt = len(choice.tokens) if produced and choice.counts_prompt else 0
        metrics.count_tokens(job.tenant, prompt, produced)
        runtime.usage.add(
            job.tenant, job.adapter, requests=int(choice.index == 0), prompt=prompt,
            completion=produced,
        )  # fmt: skip


def _record(choice: Choice, out: RequestOutput) -> None:
    choice.text += out.text
    choice.token_ids.extend(out.token_ids)
    choice.logprobs.extend(out.logprobs or [])
    choice.top_logprobs.extend(out.top_logprobs or [])
    choice.cached_tokens = out.num_cached_tokens
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        choice.finish_reason = out.finish_reason


async def run_job(runtime: Runtime, job: Job) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
    """Every output of every choice, as it comes, recorded into its Choice."""
    if len(job.choices) == 1:
        choice = job.choices[0]
        async with contextlib.aclosing(_run_choice(runtime, job, choice)) as outputs:
            async for out in outputs:
                _record(choice, out)
                yield choice, out
        return
    queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async with contextlib.aclosing(_run_choice(runtime, job, choice)) as outputs:
                async for out in outputs:
                    queue.put_nowait((choice, out))
        except Exception as e:
            queue.put_nowait((choice, e))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in job.choices]
    try:
        remaining = len(tasks)
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                _record(choice, item)
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(runtime: Runtime, job: Job) -> Job:
    """Run a job to the end (a non-streaming request)."""
    async with contextlib.aclosing(run_job(runtime, job)) as outputs:
        async for _ in outputs:
            pass
    return job
