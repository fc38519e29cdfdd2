"""Per-request sampling parameters (the OpenAI / vLLM request fields the engine honours)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# temperatures this small are treated as 0 (dividing logits by them would overflow)
_GREEDY_BELOW = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    `temperature=0` is greedy (argmax). `top_k=-1` and `top_p=1` switch those filters off.
    `seed` makes the request's samples reproducible whatever else shares its batches.
    `logprobs`: True or an int >= 1 returns the log-probability (of the model's unprocessed
    distribution) of each chosen token; only the chosen token's is returned, never alternatives.
    `n` > 1 is the engine's business (one sequence per choice); the sampler sees rows.
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
    n: int = 1

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
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax whatever the random state."""
        return self.temperature < _GREEDY_BELOW or self.top_k == 1

    @property
    def wants_logprobs(self) -> bool:
        """True when the chosen tokens' log-probabilities must be returned."""
        return bool(self.logprobs)
