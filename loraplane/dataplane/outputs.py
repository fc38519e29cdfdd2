"""What the engine hands its callers per request and step: `RequestOutput` (emission.py forms
them), with no torch: the API server's process reads them from the engine's pipe
(engine_process.py) without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.dataplane.sequence import PromptLogprob

TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), best first
# RequestOutput.error_code of a request whose adapter was still not in host memory
# adapter_load_timeout_s after it arrived (isolation.py; the server answers 504 AdapterLoadTimeout)
ADAPTER_LOAD_TIMEOUT = "AdapterLoadTimeout"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: the new tokens and text since the last output
    (no text from an engine that does not detokenize: its API server's process adds it)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # set when the request failed (e.g. its adapter could not load)
    error_code: str | None = None  # what kind of failure, where callers tell kinds apart
    # per token, its best alternatives (token id, log-probability), when the request asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # with the first token, per prompt token after the first, when the request asked
    prompt_logprobs: list[PromptLogprob] | None = None
    # prompt tokens whose K/V came from the prefix cache (usage.prompt_tokens_details)
    num_cached_tokens: int = 0
    # the token is a stop token (EOS among them) that ended the output: its text is hidden
    # unless include_stop_str_in_output (what a detokenizer outside the engine needs to know)
    stop_token: bool = False

    @classmethod
    def failed(
        cls, request_id: str, error: str, num_prompt_tokens: int, num_output_tokens: int,
        code: str | None = None,
    ) -> RequestOutput:  # fmt: skip
        """The last output of a request that failed with `error`: no tokens, no text."""
        return cls(request_id=request_id, token_ids=[], text="", finished=True,
                   finish_reason="error", logprobs=None, num_prompt_tokens=num_prompt_tokens,
                   num_output_tokens=num_output_tokens, error=error, error_code=code)  # fmt: skip


def failure_message(error: BaseException) -> str:
    """A failed request's `error`, from what failed (the step, or forming its output)."""
    return f"the step serving this request failed: {type(error).__name__}: {error}"
