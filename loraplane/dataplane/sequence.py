"""One request's tokens and its place in the engine (status, KV blocks, progress).

Progress is counted in tokens whose K/V are in the cache (`num_computed_tokens`). A step computes
some of the uncomputed tokens; the step that reaches the last token samples the next one. So a
prompt, a chunk of a prompt, a decode and the recompute of a preempted sequence are one case:
after a preemption every token so far (prompt and outputs) is recomputed as if it were a prompt.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane.dataplane.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from loraplane.dataplane.structured import Matcher

# Prefix-cache salt of base model requests, followed by the tenant (so tenants never share base
# model blocks either: one tenant's time to first token must not tell whether another tenant sent
# a prompt); adapter salts start with another tag, so they differ.
BASE_SALT = b"base\x00"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks of `block_size` tokens needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def _token_ids(ids: list[int]) -> bool:
    """Are all of `ids` ints >= 0? (Plain ints, the usual case, are checked at C speed: a
    simulated replica makes thousands of requests of hundreds of tokens.)"""
    if set(map(type, ids)) == {int}:
        return min(ids) >= 0
    return all(isinstance(t, int) and t >= 0 for t in ids)


@dataclass(frozen=True, slots=True)
class LoRARef:
    """Which adapter version a request runs with: the tenant's adapter name and its digest."""

    name: str
    tenant: str
    digest: str
    # `key`, built once: the scheduler asks it of every running request in every step
    _key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for field_name in ("name", "tenant", "digest"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"LoRARef.{field_name} must be a non-empty string, got {value!r}")
        # keep `key` unambiguous: tenant ends at the first '/', digest starts after the last '@'
        if "/" in self.tenant:
            raise ValueError(f"LoRARef.tenant must not contain '/', got {self.tenant!r}")
        if "@" in self.digest:
            raise ValueError(f"LoRARef.digest must not contain '@', got {self.digest!r}")
        object.__setattr__(self, "_key", f"{self.tenant}/{self.name}@{self.digest}")

    @property
    def key(self) -> str:
        """Identity of the adapter version: `tenant/name@digest` (a new version, a new key)."""
        return self._key

    @property
    def salt(self) -> bytes:
        """Prefix-cache salt: tenant and weights digest, so no KV is shared across them."""
        return b"lora\x00" + self.tenant.encode() + b"\x00" + self.digest.encode()


class SequenceStatus(enum.Enum):
    """Where a sequence is: waiting for admission, running, or finished (and why)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """True for the three finished states."""
        return self.value.startswith("finished")


class FinishReason(enum.StrEnum):
    """The OpenAI `finish_reason` of a finished sequence."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @property
    def status(self) -> SequenceStatus:
        """The finished status this reason leads to."""
        return _FINISHED[self]


_FINISHED = {
    FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
    FinishReason.ABORT: SequenceStatus.FINISHED_ABORTED,
}


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it, its rank (1: the most
    likely) and the best alternatives (token id, log-probability)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(eq=False, slots=True)
class Sequence:
    """A request being generated: its tokens, parameters, adapter, status and KV blocks.

    `tenant` groups requests for fair admission; it defaults to the adapter's tenant ("" for an
    anonymous base model request). The fields after `arrival_time` are state that the scheduler
    and the block manager keep (the engine reads them), except `generator`, which the engine
    sets for a request with a seed (`sampler.make_generator(params.seed, device)`).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    lora: LoRARef | None = None
    tenant: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)  # prompt followed by outputs
    output_logprobs: list[float] = field(init=False, default_factory=list)
    # per output token, its best alternatives (token id, log-probability) when asked for
    output_top_logprobs: list[list[tuple[int, float]]] = field(init=False, default_factory=list)
    # per prompt token after the first (params.prompt_logprobs): its log-probability, its rank
    # in the distribution and the best alternatives
    prompt_logprobs: list[PromptLogprob] = field(init=False, default_factory=list)
    status: SequenceStatus = field(init=False, default=SequenceStatus.WAITING)
    finish_reason: FinishReason | None = field(init=False, default=None)
    arrival_step: int = field(init=False, default=0)
    block_table: list[int] = field(init=False, default_factory=list)
    num_cached_tokens: int = field(init=False, default=0)  # prefix-cache hit at admission
    num_computed_tokens: int = field(init=False, default=0)  # tokens whose K/V are cached
    num_preemptions: int = field(init=False, default=0)
    # block manager state: hashes of the full blocks of token_ids, and how many are registered
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    num_registered_blocks: int = field(init=False, default=0)
    # the scheduler's: held back by the adapter rules after the last step, and in how many steps
    deferred: bool = field(init=False, default=False)
    deferred_steps: int = field(init=False, default=0)
    # the engine's: a per-request torch.Generator when the request has a seed, and the state
    # of its grammar when it asks for structured output
    generator: torch.Generator | None = field(init=False, default=None)
    matcher: Matcher | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token")
        if not _token_ids(self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be token ids >= 0")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        if self.lora is not None and not isinstance(self.lora, LoRARef):
            raise ValueError(f"lora must be a LoRARef or None, got {type(self.lora).__name__}")
        if not self.tenant and self.lora is not None:
            self.tenant = self.lora.tenant
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def last_token_id(self) -> int:
        """The newest token (the last prompt token before any output)."""
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not cached yet (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token is uncomputed (a prompt, or a recompute)."""
        # asked of every running sequence in every step: kept to one property call
        computed = self.num_computed_tokens
        return computed < len(self.prompt_token_ids) or len(self.token_ids) - computed > 1

    @property
    def lora_key(self) -> str | None:
        """The adapter version's key, or None for the base model."""
        lora = self.lora
        return None if lora is None else lora._key

    @property
    def cache_salt(self) -> bytes:
        """Salt of this sequence's prefix-cache hashes: the adapter identity (tenant and
        digest), or the base salt and the tenant. A request for prompt log-probabilities never
        takes nor registers cached blocks (`uses_prefix_cache`)."""
        return BASE_SALT + self.tenant.encode() if self.lora is None else self.lora.salt

    @property
    def uses_prefix_cache(self) -> bool:
        """False for a request for prompt log-probabilities: no cached prefix may skip the
        positions it needs, and its blocks, never hit by anyone, must not push other requests'
        cached prefixes out."""
        return self.params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        """True once stopped, cut at its length limit, or aborted."""
        return self.status.is_finished

    def num_blocks_needed(self, block_size: int) -> int:
        """KV blocks needed to hold every token so far."""
        return blocks_for(len(self.token_ids), block_size)

    def append_token(
        self,
        token_id: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        """Add a sampled token (and its log-probability, and the best alternatives', when the
        request asked for them)."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def stop_reason(
        self, token_id: int, eos_token_id: int | None, max_len: int | None
    ) -> FinishReason | None:
        """Why the sequence stops after sampling `token_id` (already appended), if it does.

        EOS (unless ignore_eos) and stop_token_ids stop it; max_tokens or `max_len` total tokens
        cut it. Stop strings are the detokenizer's business.
        """
        params = self.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and eos_token_id is not None and token_id == eos_token_id
        ):
            return FinishReason.STOP
        if len(self.token_ids) - len(self.prompt_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if max_len is not None and len(self.token_ids) >= max_len:
            return FinishReason.LENGTH
        return None
