"""Per-request sampling parameters (the OpenAI / vLLM request fields the engine honours)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplane.dataplane.structured import CompiledGrammar

# temperatures this small are treated as 0 (dividing logits by them would overflow)
_GREEDY_BELOW = 1e-5


MAX_TOP_LOGPROBS = 20  # alternatives per token at most (as vLLM and OpenAI allow)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request at most (OpenAI's limit)
MAX_REPETITION_PENALTY = 10.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    `temperature=0` is greedy (argmax). `top_k=-1`, `top_p=1` and `min_p=0` switch those
    filters off. `seed` makes the request's samples reproducible whatever else shares its
    batches. `logprobs` (True, or an int >= 0) returns the log-probability of each chosen token
    and `top_logprobs` (0..MAX_TOP_LOGPROBS) that many best alternatives with theirs, all of the
    model's own distribution (the request's adapter applied, before any transform below);
    `prompt_logprobs` (0..MAX_TOP_LOGPROBS) does the same for every prompt token after the first
    (such a request does not use the prefix cache: every prompt position must be computed).
    `n` > 1 is the engine's business (one sequence per choice); the sampler sees rows.

    Transforms, in the order the sampler applies them (vLLM's meaning for each field):
    `logit_bias` adds its value to a token's logit; `min_tokens` forbids the stop tokens (EOS and
    `stop_token_ids`) until that many tokens are out (stop strings wait too);
    `repetition_penalty` divides a positive logit (multiplies a negative one) of every token in
    the prompt or the output so far; `frequency_penalty` subtracts itself times the token's count
    in the output, `presence_penalty` itself once for any token in the output; then
    temperature, `min_p` (drop tokens under min_p times the best token's probability), top-k,
    top-p. `include_stop_str_in_output` keeps a matched stop string in the text,
    `skip_special_tokens` drops special tokens from it, `truncate_prompt_tokens` keeps only the
    prompt's last k tokens. `grammar` (structured outputs) forbids, before everything else,
    every token its grammar does not allow next; the output ends once the grammar is complete.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool | int = False
    top_logprobs: int = 0
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    prompt_logprobs: int | None = None  # per prompt token its log-probability and N best
    grammar: CompiledGrammar | None = None  # structured output: what the text must match

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.logprobs, bool) and not (
            _is_int(self.logprobs) and self.logprobs >= 0
        ):
            raise ValueError(f"logprobs must be a bool or an integer >= 0, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}],"
                f" got {self.top_logprobs!r}"
            )
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {rp!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})],"
                f" got {self.min_tokens!r}"
            )
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        n = self.prompt_logprobs
        if n is not None and (not _is_int(n) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}"
            )
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or k < 1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {k!r}")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} entries")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax whatever the random state."""
        return self.temperature < _GREEDY_BELOW or self.top_k == 1

    @property
    def wants_logprobs(self) -> bool:
        """True when the chosen tokens' log-probabilities must be returned."""
        return self.logprobs is not False or self.top_logprobs > 0

    @property
    def penalised(self) -> bool:
        """True when the token history changes the logits (a penalty is set)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def transforms_logits(self, num_output_tokens: int) -> bool:
        """True when the sampler must change this row's logits before choosing (bias, a stop
        token still forbidden by min_tokens, penalties)."""
        return bool(self.logit_bias) or self.penalised or num_output_tokens < self.min_tokens
