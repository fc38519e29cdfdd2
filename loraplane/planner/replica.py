"""One simulated replica: the engine's step loop around the engine's own scheduler.

Admission is not modelled here: each step asks the real `Scheduler` (with a real
`BlockManager`) for its batch, so seats, tokens, KV blocks, chunked prefill, preemption, the
adapter rules (deferral, the starvation barrier), tenant turns and whatever else the scheduler
does are in every plan. What this module adds is what the engine does around it, in simulated
time (`Engine.step`):
- housekeeping: the waiting requests' adapters are prefetched (`tiers.SimTiers`); a step with
  seats free waits for those loads up to `min(1/2, awaiting / running)` of a step, `awaiting`
  the waiting requests they hold up (`Engine.wait_for_loads`);
- the scheduler forms the batch against the simulated tiers (`SimTiers` is its `Adapters`);
  the cost model prices the batch (`StepShape`); the step's adapters become the most recently
  used and the host tier is trimmed; `postprocess` gets a fake token per sampled row, so a
  request ends after its `output` tokens (max_tokens, EOS ignored);
- a step with nothing to run waits for a load to end, at most 20 ms (`LOAD_WAIT_S`).

Requests are real `Sequence`s with fake token ids, so the prefix cache is off (they would all
share one prefix).

`Parts` switches the simulator's distinctive parts off, for the validation's negative controls
only (`validate.py`: a comparison that still passes without them could not detect them wrong):
the scheduler's starvation barrier, and the host tier's bound.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from loraplane.dataplane.block_manager import BlockManager
from loraplane.dataplane.config import EngineConfig, SchedulerConfig
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.scheduler import Scheduler, SchedulerOutput
from loraplane.dataplane.sequence import LoRARef, Sequence
from loraplane.planner.cost import CostModel, StepShape
from loraplane.planner.memory import MemoryPlan
from loraplane.planner.tiers import SimTiers

# The engine's (loraplane.dataplane.engine imports torch; tests/test_planner.py checks that
# these equal the engine's): the longest wait of a step that has nothing to run, and the
# largest fraction of a step a step waits for loads.
LOAD_WAIT_S = 0.02
MAX_LOAD_WAIT_FRACTION = 0.5
DEFAULT_TENANT = "sim"
FAKE_TOKEN = 0  # every prompt token and every sampled one


# a deferral limit no request reaches: the barrier never rises
NO_BARRIER_STEPS = 1 << 62


@dataclass(frozen=True, slots=True)
class Parts:
    """Which of the simulator's parts run (all, except in a negative control): `barrier`, the
    scheduler's starvation barrier (off: `max_deferral_steps` no request reaches);
    `host_limit`, the host tier's `max_cpu_loras` bound (off: no host copy is ever evicted;
    the prefetch list keeps its depth)."""

    barrier: bool = True
    host_limit: bool = True


ALL_PARTS = Parts()


@dataclass(slots=True, eq=False)
class Request:
    """One request's life in the simulation (times in seconds)."""

    rid: int
    adapter: int
    prompt: int
    output: int
    arrival: float
    tenant: str = DEFAULT_TENANT  # the adapter's owner (admission shares the replica by tenant)
    first_token: float = -1.0
    finished: float = -1.0
    cold: bool = False  # its adapter was not in host memory when it arrived


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
    # host copies `--max-cpu-lora-bytes` holds (`MemoryPlan.host_copies`); None: no byte limit
    host_copies: int | None = None
    max_deferral_steps: int = 32
    loads_in_flight: int = 2
    device_copies: bool = True  # placing an adapter copies it to the device (not on CPU)
    # the loader threads share the engine's one core (times in the process's CPU seconds, as
    # the validation measures): a load's seconds lengthen the step it ends in
    loads_share_core: bool = False
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None

    @classmethod
    def from_plan(cls, plan: MemoryPlan, config: EngineConfig) -> ReplicaSettings:
        """The settings of a replica of `config` whose memory `plan` works out. Pinned
        adapters' slots and bytes are taken off what the simulated traffic has (their own
        requests are simulated among the rest, so with pins the replicas found are an upper
        bound)."""
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            lora_slots=plan.lora_slots - plan.adapters_pinned,
            lora_budget_bytes=plan.lora_budget_bytes - plan.pinned_bytes,
            # a load reads the whole adapter (a tensor-parallel rank then keeps its slices)
            adapter_bytes=plan.adapter_full_bytes or plan.adapter_bytes,
            adapter_device_bytes=plan.adapter_device_bytes,
            max_cpu_loras=plan.max_cpu_loras,
            host_copies=None if plan.max_cpu_lora_bytes is None else plan.host_copies,
            kv_blocks=plan.kv_blocks,
            block_size=config.block_size,
            max_deferral_steps=config.max_deferral_steps,
            device_copies=config.device == "cuda",
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_model_len=config.max_model_len,
        )

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's scheduler config for these settings (`EngineConfig.scheduler_config`)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_loras=self.lora_slots,
            max_deferral_steps=self.max_deferral_steps,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=self.max_model_len,
        )

    def scheduler(self, parts: Parts = ALL_PARTS) -> Scheduler:
        """A real scheduler over a real block manager of `kv_blocks` (prefix cache off);
        without `parts.barrier`, one whose deferral limit is never reached."""
        blocks = BlockManager(self.kv_blocks, self.block_size, enable_prefix_caching=False)
        config = self.scheduler_config()
        if not parts.barrier:
            config = dataclasses.replace(config, max_deferral_steps=NO_BARRIER_STEPS)
        return Scheduler(config, blocks, eos_token_id=None)


def step_shape(out: SchedulerOutput, adapter_bytes: int, placed_bytes: int = 0) -> StepShape:
    """The cost model's view of a scheduled step (adapters of `adapter_bytes` each)."""
    context = attention = tokens = 0
    for _, start, n, _ in out.scheduled:
        length = start + n
        tokens += n
        context += length
        attention += n * length
    adapters = len(out.lora_keys)
    return StepShape(tokens, len(out.scheduled), context, attention, adapters,
                     adapters * adapter_bytes, placed_bytes, out.num_deferred)  # fmt: skip


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
    """A replica's scheduler, adapter tiers and step loop; the fleet drives it in time."""

    def __init__(self, settings: ReplicaSettings, cost: CostModel, seed: int = 0,
                 parts: Parts = ALL_PARTS) -> None:  # fmt: skip
        self.s = settings
        self.cost = cost
        self.parts = parts
        self.jitter = cost.jitter
        # replayed from a seeded offset (each replica its own), so slow spells stay together
        self.jitter_at = random.Random(seed).randrange(len(self.jitter)) if self.jitter else 0  # noqa: S311
        self.scheduler = settings.scheduler(parts)
        self.tiers = SimTiers(settings.lora_slots, settings.lora_budget_bytes,
                              settings.adapter_device_bytes, settings.max_cpu_loras,
                              cost.host_load_seconds(settings.adapter_bytes),
                              settings.loads_in_flight, settings.host_copies)  # fmt: skip
        self.requests: dict[Sequence, Request] = {}  # waiting or running
        self._refs: dict[tuple[str, int], LoRARef] = {}
        self._adapter_of: dict[str, int] = {}  # LoRARef.key -> adapter index
        self._params: dict[int, SamplingParams] = {}  # by output tokens
        self.step_ewma = 0.0
        self.busy_until = 0.0
        self.generated = 0
        self.steps = 0

    # -- what the router sees ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests running (prefill or decode)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission."""
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks held by requests."""
        return self.scheduler.block_manager.usage

    def active_adapters(self) -> frozenset[int]:
        """Adapters with running requests."""
        return frozenset(self._adapter_of[k] for k in self.scheduler.running_lora_keys)

    def waiting_adapters(self) -> frozenset[int]:
        """Adapters that waiting requests need."""
        return frozenset(self._adapter_of[k] for k in self.scheduler.waiting_lora_keys)

    @property
    def loads(self) -> int:
        """Adapter loads into host memory so far."""
        return self.tiers.loads

    @property
    def deferred_total(self) -> int:
        """Requests the adapter rules held back at least once (the scheduler's count)."""
        return self.scheduler.deferred_total

    @property
    def preemptions_total(self) -> int:
        """Preemptions so far (the scheduler's count)."""
        return self.scheduler.preemptions_total

    def ref(self, adapter: int, tenant: str = DEFAULT_TENANT) -> LoRARef:
        """The adapter version the scheduler sees for `tenant`'s adapter `adapter`."""
        ref = self._refs.get((tenant, adapter))
        if ref is None:
            ref = self._refs[tenant, adapter] = LoRARef(f"a{adapter}", tenant, "sim")
            self._adapter_of[ref.key] = adapter
        return ref

    def add(self, req: Request) -> None:
        """A request arrives (it waits for the next step)."""
        ref = self.ref(req.adapter, req.tenant)
        params = self._params.get(req.output)
        if params is None:
            params = self._params[req.output] = SamplingParams(
                temperature=0, max_tokens=req.output, ignore_eos=True
            )
        seq = Sequence(f"r{req.rid}", [FAKE_TOKEN] * req.prompt, params, ref, req.tenant)
        req.cold = not self.tiers.ready(ref)
        self.scheduler.add(seq)
        self.requests[seq] = req

    # -- a step ---------------------------------------------------------------------------

    def step(self, now: float) -> StepDone | float | None:
        """Run the next step from `now`: a `StepDone`, or when nothing can run, the time to
        try again (a load ends, at most 20 ms on) or None (idle until a request arrives)."""
        sched, tiers = self.scheduler, self.tiers
        tiers.advance(now)
        if not sched.has_unfinished:
            return None
        if sched.waiting:
            tiers.prefetch(sched.waiting_loras(), now)
            now = self._wait_for_loads(now)
        tiers.placed = 0
        out = sched.schedule(tiers)
        if not out.scheduled:
            end = tiers.next_load_end()
            return now + LOAD_WAIT_S if end is None else min(end, now + LOAD_WAIT_S)
        s = self.s
        placed = tiers.placed * s.adapter_device_bytes if s.device_copies else 0
        seconds = self.cost.step_seconds(step_shape(out, s.adapter_device_bytes, placed))
        if self.jitter:
            seconds *= self.jitter[self.jitter_at % len(self.jitter)]
            self.jitter_at += 1
        if s.loads_share_core:
            ending = sum(1 for at, _ in tiers.loading if at <= now + seconds)
            seconds += ending * tiers.load_s
        end = now + seconds
        self.step_ewma = (
            seconds if not self.steps else self.step_ewma + 0.2 * (seconds - self.step_ewma)
        )
        self.steps += 1
        self.busy_until = end
        # the model runner's make_resident: the step's adapters are the most recently used;
        # host copies beyond max_cpu_loras (and the byte limit) go, never a running one nor
        # one a waiting request needs
        tiers.touch(out.lora_keys)
        if self.parts.host_limit and len(tiers.host) > tiers.host_limit:
            tiers.trim_host(set(out.lora_keys) | sched.running_lora_keys | sched.waiting_lora_keys)
        return self._finish_step(out, now, end)

    def _wait_for_loads(self, now: float) -> float:
        """`Engine.wait_for_loads` in simulated time: the time the step starts, `now` or a
        later one at which the loads it waited for ended (or its wait ran out)."""
        sched, tiers = self.scheduler, self.tiers
        seats = self.s.max_num_seqs - len(sched.running)
        if seats <= 0 or self.step_ewma <= 0:
            return now
        loading = tiers.pending()
        if not loading:
            return now
        # waiting requests those loads hold up, counted up to the free seats (all that
        # matters); every adapter loading or queued is a waiting request's (the prefetch list)
        awaiting = 0
        for q in sched.waiting:
            if q.lora is not None and q.lora.key in loading:
                awaiting += 1
                if awaiting >= seats:
                    break
        if not awaiting:
            return now
        share = awaiting / max(1, len(sched.running))
        deadline = now + min(MAX_LOAD_WAIT_FRACTION, share) * self.step_ewma
        while loading & tiers.pending():
            end = tiers.next_load_end()
            if end is None or end > deadline:
                return deadline
            now = end
            tiers.advance(now)
        return now

    def _finish_step(self, out: SchedulerOutput, start: float, end: float) -> StepDone:
        done = StepDone(start, end)
        sampled = out.sampled
        requests = self.requests
        for row in sampled:
            seq = row.seq
            if len(seq.token_ids) == len(seq.prompt_token_ids):  # not a recompute (preempted)
                req = requests[seq]
                req.first_token = end
                done.first.append(req)
        for seq in self.scheduler.postprocess(out, [FAKE_TOKEN] * len(sampled)):
            req = requests.pop(seq)
            req.finished = end
            done.finished.append(req)
        done.generated = len(sampled)
        self.generated += done.generated
        return done
