"""Per-tenant rate limits: requests per minute and tokens per minute, as token buckets.

Each tenant has two buckets (`loraplane.ratelimit.TokenBuckets`, shared with the control
plane) that refill continuously (limit / 60 per second) up to one minute's worth. A request
takes one request token and its prompt tokens up front (`admit`); the tokens it generates are
charged as they are produced (`charge`), which may drive the bucket below zero: then the
tenant's next request waits until it has refilled. A limit of 0 means unlimited.

A request is admitted before its prompt is tokenized (a refusal must cost no tokenizer time),
so it is admitted on an estimate of its prompt tokens (`estimate_tokens`) and `settle`d once
they are counted.

    limiter = RateLimiter()
    limiter.admit("acme", requests_per_minute=60, tokens_per_minute=10_000, prompt_tokens=7)
    limiter.settle("acme", tokens_per_minute=10_000, estimated=7, counted=42)
    ...
    limiter.charge("acme", tokens_per_minute=10_000, tokens=1)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from loraplane.dataplane.server.errors import RateLimited
from loraplane.ratelimit import TokenBuckets

# Characters per token of the admission estimate. Text averages about 4 characters per token
# in English and fewer in code and most other scripts, so 6 rarely over-counts (which would
# refuse a prompt the tenant could afford) while an 8 MiB prompt is still estimated at over a
# million tokens and refused at the door when the tenant cannot afford it. What the estimate
# misses is charged after tokenization, like generated tokens.
CHARS_PER_TOKEN = 6


def estimate_tokens(characters: int) -> int:
    """A prompt's tokens as estimated from its length in characters, before tokenizing."""
    return characters // CHARS_PER_TOKEN


class RateLimiter:
    """Requests and tokens per minute per tenant; raises RateLimited with a Retry-After."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._requests = TokenBuckets(clock)
        self._tokens = TokenBuckets(clock)

    def admit(
        self, tenant: str, *, requests_per_minute: int, tokens_per_minute: int, prompt_tokens: int
    ) -> None:
        """Let a request in (taking 1 request and its prompt tokens), or raise RateLimited."""
        waits = []
        if requests_per_minute > 0:
            waits.append(self._requests.wait_for(tenant, requests_per_minute, 1))
        if tokens_per_minute > 0:
            waits.append(self._tokens.wait_for(tenant, tokens_per_minute, prompt_tokens))
        wait = max(waits, default=0.0)
        if wait > 0:
            raise RateLimited(
                f"tenant {tenant!r} is over its rate limit "
                f"({requests_per_minute or 'unlimited'} requests, "
                f"{tokens_per_minute or 'unlimited'} tokens per minute); retry in {wait:.1f} s",
                retry_after=wait,
            )
        if requests_per_minute > 0:
            self._requests.take(tenant, requests_per_minute, 1)
        if tokens_per_minute > 0:
            self._tokens.take(tenant, tokens_per_minute, prompt_tokens)

    def settle(self, tenant: str, *, tokens_per_minute: int, estimated: int, counted: int) -> None:
        """Correct an admission on `estimated` prompt tokens to the `counted` ones (what was
        over-estimated is given back)."""
        if tokens_per_minute > 0 and counted != estimated:
            self._tokens.take(tenant, tokens_per_minute, counted - estimated)

    def charge(self, tenant: str, *, tokens_per_minute: int, tokens: int) -> None:
        """Count generated tokens against the tenant's tokens per minute."""
        if tokens_per_minute > 0 and tokens > 0:
            self._tokens.take(tenant, tokens_per_minute, tokens)
