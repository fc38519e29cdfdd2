"""One simulated replica: the engine's step loop, at the level of whole steps.

Mirrors `Engine.step` and the scheduler (docs/dataplane.md, "Adapter memory"):
- housekeeping: the waiting queue is the prefetch list (its first `max_cpu_loras / 2` distinct
  adapters, oldest request first), loaded into host memory two at a time on loader threads
  that go on down the list; a step with seats free waits for those loads up to
  `min(1/2, held / running)` of a step (`Engine._wait_for_loads`);
- a step serves the running requests (a decode takes a token; a prompt the next chunk of what
  the token budget leaves), then admits waiting requests in order while seats and tokens last:
  a request whose adapter is not in host memory is skipped, one whose adapter would not fit
  beside the running ones (the pool's slots and the adapter memory) is deferred, and a request
  deferred for more than `max_deferral_steps` steps raises a barrier for its adapter;
- an adapter a step needs is placed in the device pool, evicting idle ones (those no waiting
  request needs, least recently used, first); host copies beyond `max_cpu_loras` are evicted
  least recently used first, never one on the device, running or wanted;
- a step with nothing to run waits for a load to end, at most 20 ms (`LOAD_WAIT_S`).

Simplifications: one tenant (admission in queue order, no turns between tenants); a request
reserves its KV blocks for prompt and output when admitted (no preemption); no prefix cache;
the device pool keeps idle adapters only within the adapter memory (with adapters inside the
KV cache the engine may keep more, in blocks no sequence holds).
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from loraplane.dataplane.config import EngineConfig
from loraplane.planner.cost import CostModel, StepShape
from loraplane.planner.memory import MemoryPlan

LOAD_WAIT_S = 0.02  # engine.LOAD_WAIT_S
MAX_LOAD_WAIT_FRACTION = 0.5  # engine.MAX_LOAD_WAIT_FRACTION


@dataclass(slots=True, eq=False)
class Request:
    """One request's life in the simulation (times in seconds)."""

    rid: int
    adapter: int
    prompt: int
    output: int
    arrival: float
    computed: int = 0  # prompt tokens computed
    first_token: float = -1.0
    finished: float = -1.0
    cold: bool = False  # its adapter was not in host memory when it arrived
    deferred_steps: int = 0
    blocks: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """What a replica's engine is configured with (see `memory.MemoryPlan`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    lora_slots: int
    lora_budget_bytes: int
    adapter_bytes: int  # host copy (what a load reads)
    adapter_device_bytes: int
    max_cpu_loras: int
    kv_blocks: int
    block_size: int
    max_deferral_steps: int = 32
    loads_in_flight: int = 2
    device_copies: bool = True  # placing an adapter copies it to the device (not on CPU)

    @property
    def prefetch_depth(self) -> int:
        """Adapters loaded ahead at most (LoRAManager.prefetch_depth)."""
        return max(1, self.max_cpu_loras // 2)

    @classmethod
    def from_plan(cls, plan: MemoryPlan, config: EngineConfig) -> ReplicaSettings:
        """The settings of a replica of `config` whose memory `plan` works out."""
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            lora_slots=plan.lora_slots,
            lora_budget_bytes=plan.lora_budget_bytes,
            adapter_bytes=plan.adapter_bytes,
            adapter_device_bytes=plan.adapter_device_bytes,
            max_cpu_loras=plan.max_cpu_loras,
            kv_blocks=plan.kv_blocks,
            block_size=config.block_size,
            max_deferral_steps=config.max_deferral_steps,
            device_copies=config.device == "cuda",
        )


@dataclass(slots=True)
class StepDone:
    """A step that ran from `start` to `end`: the requests that got their first token and
    those that finished (their times set), and the tokens it generated."""

    start: float
    end: float
    first: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    generated: int = 0


class Replica:
    """A replica's queues, adapter tiers and step loop; the fleet drives it in time."""

    def __init__(self, settings: ReplicaSettings, cost: CostModel, seed: int = 0) -> None:
        self.s = settings
        self.cost = cost
        self.jitter = cost.jitter
        # replayed from a seeded offset (each replica its own), so slow spells stay together
        self.jitter_at = random.Random(seed).randrange(len(self.jitter)) if self.jitter else 0  # noqa: S311
        self.load_s = cost.host_load_seconds(settings.adapter_bytes)
        self.waiting: deque[Request] = deque()
        self.wanted: Counter[int] = Counter()  # waiting requests per adapter
        self.prefilling: list[Request] = []
        self.n_dec = 0  # decoding requests
        self.dec_len = 0  # their lengths together
        self.finish_at: dict[int, list[Request]] = {}  # step -> decodes ending in it
        self.running: Counter[int] = Counter()  # running requests per adapter
        self.free_blocks = settings.kv_blocks
        self.host: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.device: OrderedDict[int, None] = OrderedDict()
        self.loading: list[tuple[float, int]] = []  # (end, adapter), at most loads_in_flight
        self.queue: list[int] = []  # the prefetch list
        self.queued: set[int] = set()
        self.step_index = 0
        self.step_ewma = 0.0
        self.busy_until = 0.0
        self.generated = 0
        self.loads = 0
        self.steps = 0
        self.deferred_total = 0

    # -- what the router sees ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests running (prefill or decode)."""
        return len(self.prefilling) + self.n_dec

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks held by requests."""
        return 1.0 - self.free_blocks / self.s.kv_blocks

    def add(self, req: Request) -> None:
        """A request arrives (it waits for the next step)."""
        req.cold = req.adapter not in self.host
        self.waiting.append(req)
        self.wanted[req.adapter] += 1

    # -- adapter loads ----------------------------------------------------------------------

    def _pending(self, adapter: int) -> bool:
        return adapter not in self.host and (
            adapter in self.queued or any(a == adapter for _, a in self.loading)
        )

    def _start_loads(self, now: float) -> None:
        busy = {a for _, a in self.loading}
        for adapter in self.queue:
            if len(self.loading) >= self.s.loads_in_flight:
                return
            if adapter not in self.host and adapter not in busy:
                self.loading.append((now + self.load_s, adapter))
                busy.add(adapter)
                self.loads += 1

    def advance_loads(self, now: float) -> None:
        """Finish the loads that end by `now`; each loader thread goes on down the list."""
        while self.loading:
            end, adapter = min(self.loading)
            if end > now:
                return
            self.loading.remove((end, adapter))
            self.host[adapter] = None
            self.host.move_to_end(adapter)
            self._start_loads(end)

    def next_load_end(self) -> float | None:
        """When the next load in flight ends (None: none is)."""
        return min(self.loading)[0] if self.loading else None

    def _prefetch(self, now: float) -> None:
        queue: list[int] = []
        seen: set[int] = set()
        for req in self.waiting:
            if req.adapter not in seen:
                seen.add(req.adapter)
                queue.append(req.adapter)
                if len(queue) >= self.s.prefetch_depth:
                    break
        self.queue, self.queued = queue, seen
        self._start_loads(now)

    def _wait_for_loads(self, now: float) -> float:
        seats = self.s.max_num_seqs - self.num_running
        if seats <= 0 or self.step_ewma <= 0:
            return now
        held = [r for r in self.waiting if self._pending(r.adapter)]
        if not held:
            return now
        share = min(len(held), seats) / max(1, self.num_running)
        deadline = now + min(MAX_LOAD_WAIT_FRACTION, share) * self.step_ewma
        keys = {r.adapter for r in held}
        while any(self._pending(a) for a in keys):
            end = self.next_load_end()
            if end is None or end > deadline:
                return deadline
            now = end
            self.advance_loads(now)
        return now

    # -- the device pool ------------------------------------------------------------------

    def _place(self, adapter: int, keep: set[int]) -> bool:
        """Make `adapter` resident, evicting idle ones (not wanted, least recently used,
        first); False when nothing can go."""
        if adapter in self.device:
            return True
        s = self.s
        most = min(s.lora_slots, s.lora_budget_bytes // s.adapter_device_bytes)
        while len(self.device) >= most:
            victim = self._victim(keep)
            if victim is None:
                return False
            del self.device[victim]
        self.device[adapter] = None
        return True

    def _victim(self, keep: set[int]) -> int | None:
        fallback = None
        for a in self.device:
            if a in keep or self.running[a]:
                continue
            if not self.wanted[a]:
                return a
            if fallback is None:
                fallback = a
        return fallback

    def _trim_host(self) -> None:
        excess = len(self.host) - self.s.max_cpu_loras
        if excess <= 0:
            return
        for a in list(self.host):
            if excess <= 0:
                return
            if a not in self.device and not self.running[a] and not self.wanted[a]:
                del self.host[a]
                excess -= 1

    def _touch(self, adapter: int) -> None:
        if adapter in self.host:
            self.host.move_to_end(adapter)
        if adapter in self.device:
            self.device.move_to_end(adapter)

    # -- a step ---------------------------------------------------------------------------

    def step(self, now: float) -> StepDone | float | None:
        """Run the next step from `now`: a `StepDone`, or when nothing can run, the time to
        try again (a load ends, at most 20 ms on) or None (idle until a request arrives)."""
        self.advance_loads(now)
        if self.waiting:
            self._prefetch(now)
            now = self._wait_for_loads(now)
        s = self.s
        budget = s.max_num_batched_tokens - self.n_dec
        tokens = self.n_dec
        rows: list[tuple[Request, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.prompt - req.computed, budget)
            rows.append((req, n))
            budget -= n
            tokens += n
        before = set(self.device)
        admitted = self._admit(budget, rows)
        tokens += sum(n for _, n in rows[len(rows) - len(admitted) :])
        if not rows and not self.n_dec:
            if not self.waiting:
                return None
            end = self.next_load_end()
            return now + LOAD_WAIT_S if end is None else min(end, now + LOAD_WAIT_S)
        adapters = [a for a, n in self.running.items() if n]
        placed = sum(1 for a in adapters if a not in before)
        context = self.dec_len + self.n_dec
        attention = context
        for req, n in rows:
            length = req.computed + n
            context += length
            attention += n * length
        shape = StepShape(
            tokens=tokens,
            seqs=self.n_dec + len(rows),
            context=context,
            attention=attention,
            adapters=len(adapters),
            adapter_bytes=len(adapters) * s.adapter_device_bytes,
            placed_bytes=placed * s.adapter_device_bytes if s.device_copies else 0,
        )
        seconds = self.cost.step_seconds(shape)
        if self.jitter:
            seconds *= self.jitter[self.jitter_at % len(self.jitter)]
            self.jitter_at += 1
        end = now + seconds
        self.step_ewma = (
            seconds if not self.steps else self.step_ewma + 0.2 * (seconds - self.step_ewma)
        )
        self.steps += 1
        self.busy_until = end
        return self._finish_step(now, end, rows)

    def _admit(self, budget: int, rows: list[tuple[Request, int]]) -> list[Request]:
        """Admit waiting requests into this step (appending their first chunks to `rows`)."""
        s = self.s
        keys = {a for a, n in self.running.items() if n}
        most = min(s.lora_slots, s.lora_budget_bytes // s.adapter_device_bytes)
        barrier = self._barrier()
        admitted: list[Request] = []
        held: set[int] = set()  # adapters deferred in this step
        for req in self.waiting:
            if budget <= 0 or self.num_running + len(admitted) >= s.max_num_seqs:
                break
            a = req.adapter
            if barrier is not None and a != barrier:
                continue
            if a not in keys:
                if a not in self.host:
                    continue  # still loading
                if len(keys) >= most or a in held or not self._place(a, keys):
                    held.add(a)
                    continue  # deferred
            need = -(-(req.prompt + req.output) // s.block_size)
            if need > self.free_blocks:
                break  # wait for blocks rather than let later requests pass
            n = min(req.prompt, budget)
            self.free_blocks -= need
            req.blocks = need
            budget -= n
            keys.add(a)
            self.running[a] += 1
            self._touch(a)
            admitted.append(req)
            rows.append((req, n))
        if admitted:
            done = set(admitted)
            self.waiting = deque(r for r in self.waiting if r not in done)
            for req in admitted:
                self.wanted[req.adapter] -= 1
                self.prefilling.append(req)
        full = len(keys) >= most
        for req in self.waiting:  # deferred: ready, not running, and does not fit now
            a = req.adapter
            if (
                a in held
                or (barrier is not None and a != barrier)
                or (full and a not in keys and a in self.host)
            ):
                req.deferred_steps += 1
                self.deferred_total += req.deferred_steps == 1
        self._trim_host()
        return admitted

    def _barrier(self) -> int | None:
        limit = self.s.max_deferral_steps
        starving = [r for r in self.waiting if r.deferred_steps > limit and r.adapter in self.host]
        return min(starving, key=lambda r: r.arrival).adapter if starving else None

    def _finish_step(self, start: float, end: float, rows: list[tuple[Request, int]]) -> StepDone:
        done = StepDone(start, end, generated=self.n_dec)
        self.step_index += 1
        k = self.step_index
        self.dec_len += self.n_dec
        for req, n in rows:
            req.computed += n
            if req.computed < req.prompt:
                continue
            self.prefilling.remove(req)
            req.first_token = end
            done.first.append(req)
            done.generated += 1
            if req.output <= 1:
                self._end(req, end, done)
            else:
                self.n_dec += 1
                self.dec_len += req.prompt + 1
                self.finish_at.setdefault(k + req.output - 1, []).append(req)
        for req in self.finish_at.pop(k, ()):
            self.n_dec -= 1
            self.dec_len -= req.prompt + req.output
            self._end(req, end, done)
        self.generated += done.generated
        return done

    def _end(self, req: Request, end: float, done: StepDone) -> None:
        req.finished = end
        self.free_blocks += req.blocks
        self.running[req.adapter] -= 1
        if not self.running[req.adapter]:
            del self.running[req.adapter]
            self._touch(req.adapter)  # the last use: its place in the LRU order
        done.finished.append(req)
