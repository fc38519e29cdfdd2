"""A discrete-event simulation of a fleet of replicas behind a router.

Requests arrive as a Poisson process at `rate` (open loop) or `concurrency` at a time (closed
loop: each finished request sends the next, as `benchmarks/tiers.py` does); each asks for an
adapter drawn from the popularity law (`zipf:S`: the k-th adapter with weight 1 / k^S, or
`uniform`). The router (`routing.py`) sends it to a replica (`replica.py`), whose steps take
what the cost model says. Seeded: the same inputs give the same result.

Figures: generated tokens per second and time to first token (p50, p99) of the requests that
arrive after the warm-up; a request still without its first token at the end counts with the
time it has waited (so an overloaded fleet shows in the p99 instead of hiding).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from loraplane.planner.cost import CostModel
from loraplane.planner.replica import (
    ALL_PARTS,
    Parts,
    Replica,
    ReplicaSettings,
    Request,
    StepDone,
)
from loraplane.planner.routing import SCRAPE_INTERVAL_S, Policy, Snapshot, make_policy


def popularity_weights(law: str, count: int) -> list[float]:
    """Weights of adapters 0..count-1 under `zipf:S` or `uniform`; ValueError otherwise."""
    if law == "uniform":
        return [1.0] * count
    kind, _, value = law.partition(":")
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if kind != "zipf" or not math.isfinite(s) or s < 0:
        raise ValueError(f"popularity must be zipf:S (S >= 0) or uniform, got {law!r}")
    return [1.0 / (k + 1) ** s for k in range(count)]


@dataclass(frozen=True, slots=True)
class Workload:
    """The load offered to the fleet."""

    adapters: int
    popularity: str = "zipf:1.0"
    prompt_tokens: int = 512
    output_tokens: int = 128
    rate: float | None = None  # requests/s (open loop)
    concurrency: int | None = None  # requests in flight (closed loop)
    duration_s: float = 60.0  # open loop: arrivals stop, the simulation ends
    warmup_s: float = 10.0  # open loop: requests arriving earlier are not counted
    requests: int = 0  # closed loop: requests to finish
    warmup_requests: int = 0  # closed loop: the first ones are not counted
    spread: float = 0.0  # lengths uniform in mean x [1 - spread, 1 + spread]
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give a rate (open loop) or a concurrency (closed loop), not both")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.concurrency is not None and (self.concurrency < 1 or self.requests < 1):
            raise ValueError("a closed loop needs concurrency >= 1 and requests >= 1")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt and output tokens must be at least 1")
        if not 0 <= self.spread < 1:
            raise ValueError(f"spread must be in [0, 1), got {self.spread}")
        popularity_weights(self.popularity, 1)


class Requests:
    """The workload's requests in order: (adapter, prompt tokens, output tokens) each, drawn
    from their own seeded generator (so request i is the same whatever the arrivals)."""

    def __init__(self, load: Workload) -> None:
        self.load = load
        self.rng = random.Random(load.seed)  # noqa: S311 - a seeded workload, not secrets
        self.cum = list(itertools.accumulate(popularity_weights(load.popularity, load.adapters)))

    def _length(self, mean: int) -> int:
        spread = self.load.spread
        if not spread:
            return mean
        low, high = round(mean * (1 - spread)), round(mean * (1 + spread))
        return max(1, self.rng.randint(low, high))

    def next(self) -> tuple[int, int, int]:
        """The next request's adapter, prompt and output tokens."""
        load = self.load
        adapter = bisect.bisect_left(self.cum, self.rng.random() * self.cum[-1])
        return (min(adapter, load.adapters - 1), self._length(load.prompt_tokens),
                self._length(load.output_tokens))  # fmt: skip


def draw_requests(load: Workload, n: int) -> list[tuple[int, int, int]]:
    """The first `n` requests the simulator sends for `load` (to run the same on the engine)."""
    draws = Requests(load)
    return [draws.next() for _ in range(n)]


@dataclass(frozen=True, slots=True)
class FleetResult:
    """What a simulation measured."""

    policy: str
    replicas: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests: int  # counted requests (after the warm-up)
    completed: int  # of which finished
    cold_loads: int  # adapter loads into host memory, all replicas
    offered_rate: float  # requests/s sent after the warm-up
    served_rate: float  # requests/s finished after the warm-up (whenever they arrived)
    ttft_s: tuple[float, ...] = field(default=(), repr=False, compare=False)  # counted ones
    deferred: int = 0  # requests the adapter rules held back at least once, all replicas
    # ended as soon as its p99 TTFT was certain to exceed `simulate`'s `stop_past_ttft_p99_s`:
    # a miss, whose other figures cover only the simulated time (its p99 is reported as inf)
    cut_short: bool = False

    @property
    def stable(self) -> bool:
        """Did the fleet keep up (served at least 95% of what was offered)?"""
        return self.served_rate >= 0.95 * self.offered_rate


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank below (as tiers.run_load computes)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def counted_arrivals(load: Workload) -> int:
    """How many requests an open-loop run counts (arrivals in [warm-up, duration)): the
    arrivals are drawn from their own seeded generator, as `_Sim.run` draws them."""
    rate = load.rate or 1.0
    rng = random.Random(load.seed + 1)  # noqa: S311 - the arrivals' seeded generator
    count, t = 0, rng.expovariate(rate)
    while t < load.duration_s:
        count += t >= load.warmup_s
        t += rng.expovariate(rate)
    return count


class _MissWatch:
    """Whether an open-loop run's p99 TTFT is already certain to exceed `target`, so that the
    rest of the run cannot change the verdict.

    p99 is the value at index int(0.99 n) of the n counted waits sorted, so it exceeds the
    target once n - int(0.99 n) of them do. A counted request's wait is known to exceed it when
    its first token came later than `target` after it arrived, or, at time `now` (within the
    run), when it still has none `target` after it arrived: its first token can only come
    later, and a request without one at the end counts with the time it waited until then.
    Requests whose first token is decided but not yet delivered are counted in neither, so
    the count never runs ahead of the truth."""

    def __init__(self, load: Workload, target: float) -> None:
        n = counted_arrivals(load)
        self.needed = max(1, n - min(n - 1, int(0.99 * n))) if n else 0
        self.target = target
        self.late = 0  # counted requests whose first token came later than target
        self.front = 0  # requests before it have a first token (or were not counted)

    def first_token(self, req: Request, warmup_s: float) -> None:
        """`req` got its first token (each request once)."""
        if req.arrival >= warmup_s and req.first_token - req.arrival > self.target:
            self.late += 1

    def missed(self, requests: list[Request], now: float, warmup_s: float) -> bool:
        """Is the p99 certain to exceed the target? (`now` within the run's duration.)"""
        if not self.needed:
            return False
        while self.front < len(requests) and (
            requests[self.front].first_token >= 0 or requests[self.front].arrival < warmup_s
        ):
            self.front += 1
        late, horizon = self.late, now - self.target
        for req in itertools.islice(requests, self.front, None):
            if req.arrival >= horizon:
                break
            late += req.first_token < 0
            if late >= self.needed:
                return True
        return late >= self.needed


class _Sim:
    def __init__(self, settings: ReplicaSettings, cost: CostModel, policy: Policy, replicas: int,
                 load: Workload, jitter_seed: int, parts: Parts,
                 stop_past: float | None = None) -> None:  # fmt: skip
        self.replicas = [
            Replica(settings, cost, seed=jitter_seed * 100_003 + i, parts=parts)
            for i in range(replicas)
        ]
        self.policy = policy
        self.load = load
        self.rng = random.Random(load.seed + 1)  # noqa: S311 - arrivals, seeded
        self.draws = Requests(load)
        self.events: list[tuple[float, int, int, int]] = []  # (time, order, kind, replica)
        self.order = itertools.count()
        self.pending = [False] * replicas  # a step end or wake-up is scheduled
        self.snaps = [self._snapshot(r) for r in self.replicas]
        self.requests: list[Request] = []
        # tokens count from the warm-up on (open loop), or from the start (closed loop)
        self.counted_from = load.warmup_s if load.rate is not None else 0.0
        self.tokens = 0
        self.end = 0.0
        self.done: list[StepDone | None] = [None] * replicas
        # open loop only: end the run once its p99 TTFT is certain to exceed `stop_past`
        self.watch = _MissWatch(load, stop_past) if stop_past is not None and load.rate else None
        self.cut_short = False

    def _snapshot(self, r: Replica) -> Snapshot:  # what the replica's /metrics would say
        return Snapshot(
            waiting=r.num_waiting,
            running=r.num_running,
            kv_usage=r.kv_usage,
            active=r.active_adapters(),
            waiting_adapters=r.waiting_adapters(),
            max_lora=_max_lora(r),
        )

    def push(self, t: float, kind: int, replica: int = -1) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, replica))

    def send(self, now: float) -> None:
        adapter, prompt, output = self.draws.next()
        req = Request(len(self.requests), adapter, prompt, output, now)
        self.requests.append(req)
        i = self.policy.pick(req.adapter, now, self.snaps)
        self.replicas[i].add(req)
        if not self.pending[i]:
            self.wake(i, now)

    def wake(self, i: int, now: float) -> None:
        r = self.replicas[i]
        outcome = r.step(now)
        if isinstance(outcome, StepDone):
            self.pending[i] = True
            self.push(outcome.end, STEP_END, i)
            self.done[i] = outcome
        elif outcome is not None:
            self.pending[i] = True
            self.push(outcome, WAKE, i)
        else:
            self.pending[i] = False

    def run(self) -> None:
        load = self.load
        self.push(0.0, SCRAPE)
        if load.rate is not None:
            self.push(self.rng.expovariate(load.rate), ARRIVAL)
        else:
            for _ in range(load.concurrency or 0):
                self.send(0.0)
        finished = 0
        while self.events:
            t, _, kind, i = heapq.heappop(self.events)
            if kind == ARRIVAL:
                if t >= load.duration_s:
                    break
                self.send(t)
                self.push(t + self.rng.expovariate(load.rate or 1.0), ARRIVAL)
            elif kind == SCRAPE:
                watch = self.watch
                if watch and t <= load.duration_s and watch.missed(self.requests, t, load.warmup_s):
                    self.end, self.cut_short = t, True
                    return
                self.snaps = [self._snapshot(r) for r in self.replicas]
                self.policy.scraped()
                if self.events:
                    self.push(t + SCRAPE_INTERVAL_S, SCRAPE)
            else:
                step = self.done[i] if kind == STEP_END else None
                self.done[i] = None
                if step is not None and self.watch:
                    for req in step.first:
                        self.watch.first_token(req, load.warmup_s)
                if step is not None and t >= self.counted_from:
                    self.tokens += step.generated
                if step is not None and load.concurrency is not None:
                    finished += len(step.finished)
                    for _ in step.finished:
                        if len(self.requests) < load.requests:
                            self.send(t)
                    if finished >= load.requests:
                        self.end = t
                        return
                self.wake(i, t)
        self.end = load.duration_s if load.rate is not None else t

    def result(self) -> FleetResult:
        load = self.load
        if load.rate is not None:
            counted = [r for r in self.requests if r.arrival >= load.warmup_s]
        else:
            counted = self.requests[load.warmup_requests :]
        span = max(self.end - self.counted_from, 1e-9)
        waits = [(r.first_token if r.first_token >= 0 else self.end) - r.arrival for r in counted]
        done = sum(1 for r in counted if r.finished >= 0)
        served = sum(1 for r in self.requests if r.finished >= self.counted_from)
        return FleetResult(
            policy=self.policy.name,
            replicas=len(self.replicas),
            tokens_per_s=self.tokens / span,
            ttft_p50_s=percentile(waits, 0.5),
            ttft_p99_s=math.inf if self.cut_short else percentile(waits, 0.99),
            requests=len(counted),
            completed=done,
            cold_loads=sum(r.loads for r in self.replicas),
            offered_rate=len(counted) / span,
            served_rate=served / span,
            ttft_s=tuple(waits),
            deferred=sum(r.deferred_total for r in self.replicas),
            cut_short=self.cut_short,
        )


ARRIVAL, STEP_END, WAKE, SCRAPE = range(4)


def simulate(
    settings: ReplicaSettings,
    cost: CostModel,
    policy: str | Policy,
    replicas: int,
    load: Workload,
    jitter_seed: int = 0,
    parts: Parts = ALL_PARTS,
    stop_past_ttft_p99_s: float | None = None,
) -> FleetResult:
    """Run the fleet of `replicas` under `policy` on `load`; deterministic for the load's
    seed (the requests and arrivals) and `jitter_seed` (where each replica starts replaying
    the cost model's jitter). `parts` switches parts of the simulator off, for negative
    controls only (`replica.Parts`). `stop_past_ttft_p99_s` (open loop): end the run as soon
    as its p99 time to first token is certain to exceed it (`cut_short`, p99 inf), for a
    search that only asks whether a point meets that target: the answer is the full run's,
    the overloaded points (whose queues make them the slowest to simulate) end early."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    chosen = (
        make_policy(policy, replicas, settings.max_num_seqs) if isinstance(policy, str) else policy
    )
    sim = _Sim(settings, cost, chosen, replicas, load, jitter_seed, parts, stop_past_ttft_p99_s)
    sim.run()
    return sim.result()


def _max_lora(r: Replica) -> int:
    """The protocol's max_lora as the engine reports it (`LoRAManager.capacity`): the slots, or
    what the adapter memory holds of adapters this size once one is resident."""
    return r.tiers.capacity if r.tiers.device else r.s.lora_slots
