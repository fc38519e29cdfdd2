"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step first serves running sequences in admission order: a decode takes 1 token; a prompt (or
a preempted sequence's recompute) the next chunk that fits the token budget, less 1 token per
decode further down the list, so chunks never starve decodes. A sequence samples only in the
step that reaches its last token. When a running sequence needs a KV block and none is free, the
newest running ones are preempted by recompute (blocks freed, back to the front of the queue).
Then, if nothing was preempted, waiting sequences are admitted while seats (`max_num_seqs`),
tokens (`max_num_batched_tokens`) and KV blocks last; the first that does not fit stops
admission, so a large request is not overtaken forever by small ones.

Adapter rules (docs/architecture.md, "Data plane engine"; memory-limited). The running adapter
versions must fit in the adapter memory budget (`Adapters.budget_bytes`, the sum of their
`device_bytes`) and be at most `max_loras` distinct ones (the pool's slots: by default as many
as `max_num_seqs`, so memory is the real limit); base model requests never count. A request is
admitted only once its adapter is `ready` (in host memory: the engine loads waiting requests'
adapters in the background meanwhile). A waiting request whose ready adapter is not running and
does not fit beside the running ones is *deferred*: it stays waiting, others may pass it, and it
is counted (`num_deferred` now, `deferred_total` once per request). Among admissible requests:
preempted ones first, then the tenant with the fewest running sequences (tenants take turns),
then age. No starvation: once a request has been deferred in more than `max_deferral_steps`
steps, the oldest such request whose adapter is ready raises a barrier: only its adapter's
requests (first) and base model requests are admitted, so running adapters drain and it takes
the first memory that frees up. Pinned versions (`Adapters.pins`) are placed every step and
count as running adapters, in the budget and in their tenants' adapter memory, and are never
given up. A request still waiting for its adapter's load never raises the
barrier (a slow store must not stop every other tenant). With room for one adapter and other
adapters' requests finishing within M steps of admission, a request waits at most
max_deferral_steps + M + 1 steps after its adapter is ready (see test_scheduler.py).

The engine's step:
    out = scheduler.schedule(adapters)     # may preempt; out.scheduled is the batch, in order
    # per row r: tokens r.seq.token_ids[r.start : r.start + r.num_new_tokens] at positions
    #   r.start.., K/V slots from r.seq.block_table, adapter r.seq.lora; run the model and keep
    #   the last token's logits of each row in out.sampled, in order
    res = sampler(logits, [r.seq.params for r in out.sampled], [r.seq.generator for ...])
    finished = scheduler.postprocess(out, res.token_ids, res.logprobs)
    # postprocess advanced num_computed_tokens, registered full blocks for the prefix cache,
    # appended the tokens and finished (freed) sequences at EOS, stop_token_ids, max_tokens or
    # max_model_len. Then per sampled row the engine feeds the request's detokenizer; on a stop
    # string it calls scheduler.finish(seq, FinishReason.STOP) (also on a sequence postprocess
    # just finished: only the reason changes). Between steps: scheduler.add / abort.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast

from loraplane.dataplane.block_manager import BlockManager
from loraplane.dataplane.config import SchedulerConfig
from loraplane.dataplane.fairness import Shares, TenantShare
from loraplane.dataplane.sequence import FinishReason, LoRARef, Sequence, SequenceStatus


class Adapters(Protocol):
    """What admission asks of the adapter tiers (the engine passes its LoRAManager)."""

    def ready(self, ref: LoRARef) -> bool:
        """May `ref` run in the next step (is it in host memory)?"""
        ...

    def device_bytes(self, ref: LoRARef) -> int:
        """Device bytes `ref` takes in the adapter pool (known once it is ready)."""
        ...

    @property
    def budget_bytes(self) -> int | None:
        """Device bytes all running adapters together may take (None: no limit)."""
        ...

    def place(self, ref: LoRARef, in_use: Iterable[str], wanted: Iterable[str]) -> bool:
        """Make `ref` resident now, evicting idle adapters (never those in `in_use`; those in
        `wanted`, of waiting requests, last); False when it cannot be placed yet (its
        memory is held by sequences' KV blocks)."""
        ...

    def pins(self) -> list[LoRARef]:
        """The pinned versions ready to run (in host memory): kept on the device every step,
        counted in the budget and in their tenants' adapter memory."""
        ...


class _AllReady:
    """No adapter tiers (tests of the scheduler alone): every adapter is ready and free."""

    budget_bytes = None

    def ready(self, ref: LoRARef) -> bool:
        return True

    def device_bytes(self, ref: LoRARef) -> int:
        return 0

    def place(self, ref: LoRARef, in_use: Iterable[str], wanted: Iterable[str]) -> bool:
        return True

    def pins(self) -> list[LoRARef]:
        return []


_ALL_READY = _AllReady()


class _Room:
    """The running adapters and what is left of the slots and the memory budget."""

    def __init__(self, running: list[Sequence], adapters: Adapters, max_loras: int) -> None:
        self.adapters, self.max_loras = adapters, max_loras
        self.in_use: set[str] = set()  # the running adapters (never evicted), pins included
        self.used = 0
        self.unplaced: set[str] = set()  # fit the budget, but no memory could be freed yet
        self.placed: set[str] = set()  # made resident for a request being admitted
        self.wanted: set[str] = set()  # adapters of waiting requests (evicted last)
        in_use = self.in_use
        size = adapters.device_bytes
        for seq in running:
            lora = seq.lora
            if lora is not None and lora.key not in in_use:
                in_use.add(lora.key)  # `add`, inlined (every running request, every step)
                self.used += size(lora)
        # pinned versions hold their memory and a slot whether or not a request runs them:
        # placed now (a no-op when resident), they count as running adapters
        self.pinned: dict[str, LoRARef] = {}
        for ref in adapters.pins():
            if ref.key in self.in_use:
                self.pinned[ref.key] = ref
            elif self.fits(ref) and adapters.place(ref, self.in_use, ()):
                self.pinned[ref.key] = ref
                self.add(ref)

    def fits(self, ref: LoRARef) -> bool:
        """Could `ref` (ready, not running) run beside the running adapters?"""
        budget = self.adapters.budget_bytes
        return len(self.in_use) < self.max_loras and (
            budget is None or self.used + self.adapters.device_bytes(ref) <= budget
        )

    def add(self, ref: LoRARef) -> None:
        self.in_use.add(ref.key)
        self.used += self.adapters.device_bytes(ref)

    def remove(self, ref: LoRARef) -> None:
        """`ref` stopped running in this step (its sequences gave way): idle, evictable."""
        self.in_use.discard(ref.key)
        self.used -= self.adapters.device_bytes(ref)


class ScheduledSeq(NamedTuple):
    """One row of a step: compute `num_new_tokens` tokens from position `start`; maybe sample.
    (A named tuple: one is made for every row of every step, and a tuple is made fastest.)"""

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """A step's batch and what happened while forming it."""

    step: int
    scheduled: list[ScheduledSeq]
    lora_keys: frozenset[str]  # distinct adapter versions in this step
    preempted: list[str]  # request ids sent back to waiting in this step
    num_deferred: int  # waiting requests held back by the adapter rules after this step
    num_newly_deferred: int  # of which deferred for the first time

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def sampled(self) -> list[ScheduledSeq]:
        """The rows that sample a token, in batch order (the order of sampled token ids)."""
        return [r for r in self.scheduled if r.sample]


class Scheduler:
    """Forms each step's batch under seat, token, KV block and adapter limits."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, eos_token_id: int | None = None
    ):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.step = 0
        self.num_deferred = self.deferred_total = self.preemptions_total = 0
        self.shares = Shares()  # per tenant: weight, served tokens, seats (fairness.py)
        self._logprob_budget = config.max_prompt_logprob_tokens_per_step  # left in this step
        self._blocked = False  # in this step, a starving adapter did not fit: others wait
        self._live: dict[str, Sequence] = {}
        self._room: _Room | None = None  # while admitting
        # a sequence stops at max_model_len, or when its newest token's K/V could not fit even
        # with the whole cache to itself
        capacity = block_manager.capacity_tokens + 1
        self._max_len = min(config.max_model_len or capacity, capacity)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError if it could never be scheduled."""
        cfg, n = self.config, seq.num_tokens
        if seq.request_id in self._live or seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"request {seq.request_id!r} is already queued, running or done")
        if cfg.max_model_len is not None and n >= cfg.max_model_len:
            raise ValueError(f"prompt of {n} tokens leaves no room in max_model_len")
        if n > self.block_manager.capacity_tokens:
            raise ValueError(f"prompt of {n} tokens exceeds the KV cache")
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            raise ValueError(f"prompt of {n} tokens exceeds max_num_batched_tokens (no chunking)")
        seq.arrival_step = self.step
        self.waiting.append(seq)
        self._live[seq.request_id] = seq
        self.shares.arrive(seq.tenant)

    def set_weight(self, tenant: str, weight: float) -> None:
        """Set a tenant's share weight (the catalog's quota; ValueError unless > 0)."""
        self.shares.set_weight(tenant, weight)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a queued or running request as aborted (freeing its blocks); None if unknown."""
        seq = self._live.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a sequence and free its blocks; on a finished one, only change the reason."""
        if not seq.is_finished:
            if self._live.get(seq.request_id) is seq:
                del self._live[seq.request_id]
                running = seq.status is SequenceStatus.RUNNING
                if running:
                    self.running.remove(seq)
                else:
                    self.waiting.remove(seq)
                self.shares.leave(seq.tenant, running)
            self.block_manager.free(seq)
        seq.status = reason.status
        seq.finish_reason = reason

    def schedule(self, adapters: Adapters | None = None) -> SchedulerOutput:
        """Form the next step's batch. A waiting request whose adapter is not `ready` (still
        loading: the engine prefetches it meanwhile) is skipped this step; one whose adapter
        does not fit in the adapter memory beside the running ones is deferred."""
        adapters = adapters or _ALL_READY
        self.step += 1
        self._room = None
        self._logprob_budget = self.config.max_prompt_logprob_tokens_per_step
        batch: list[ScheduledSeq] = []
        preempted: list[str] = []
        budget = self._schedule_running(batch, preempted)
        barrier = self._barrier_keys(adapters)
        room = self._room = _Room(self.running, adapters, self.config.max_loras)
        self._admit(batch, budget, barrier, room, preempted, kv_short=bool(preempted))
        self._room = None
        keys: set[str | None] = {r.seq.lora_key for r in batch}
        keys.discard(None)
        deferred = self._count_deferred(barrier, room)
        lora_keys = cast(frozenset[str], frozenset(keys))  # (None taken out)
        return SchedulerOutput(self.step, batch, lora_keys, preempted, *deferred)

    def _chunk(self, seq: Sequence, want: int, budget: int) -> int:
        """Tokens of `seq` to compute now out of `want`: a chunk, or all-or-nothing without
        chunking. A prompt-logprobs request's chunk also fits the step's budget of such
        tokens (scoring traffic must not stall other tenants' decodes)."""
        cfg = self.config
        if cfg.enable_chunked_prefill and seq.params.prompt_logprobs is not None:
            budget = min(budget, self._logprob_budget)
        if cfg.enable_chunked_prefill or want > cfg.max_num_batched_tokens:
            return min(want, budget)
        return want if want <= budget else 0

    def _schedule_running(self, batch: list[ScheduledSeq], preempted: list[str]) -> int:
        budget = self.config.max_num_batched_tokens
        seats = {t: s.seats for t, s in self.shares.tenants.items() if s.running}
        # the tenants with the fewest seats per weight first: their prefill chunks get the
        # budget first, and when KV blocks run out the rows further down give way (a stable
        # sort: by admission, which is the whole order while a single tenant runs)
        if len(seats) > 1:
            order = sorted(self.running, key=lambda s: seats[s.tenant])
        else:
            order = list(self.running)
        # `Sequence.is_prefill` of each (a row's own stays so until its turn), inlined
        prefill = [
            (c := s.num_computed_tokens) < len(s.prompt_token_ids) or len(s.token_ids) - c > 1
            for s in order
        ]
        decodes_left = len(order) - sum(prefill)
        gone: set[Sequence] = set()
        block_size = self.block_manager.block_size
        shares: dict[str, TenantShare] = {}  # the running tenants', for `Shares.serve` inlined
        for i, seq in enumerate(order):
            if budget <= 0:
                break
            if gone and seq in gone:
                continue
            if prefill[i]:
                n = self._chunk(seq, seq.num_uncomputed_tokens, budget - decodes_left)
            else:
                n, decodes_left = 1, decodes_left - 1
            if n <= 0:
                continue
            table = seq.block_table
            start = seq.num_computed_tokens
            # most rows' last block has room for them (`BlockManager._fits`, inlined: this runs
            # for every row of every step): `_run` without the allocation; the others look for
            # blocks, maybe preempting
            if table and start + n <= len(table) * block_size:
                batch.append(ScheduledSeq(seq, start, n, start + n == len(seq.token_ids)))
                share = shares.get(seq.tenant)
                if share is None:
                    share = shares[seq.tenant] = self.shares.get(seq.tenant)
                share.served_tokens += n  # `self.shares.serve(seq.tenant, n)`
                share.counter += n / share.weight
                if seq.params.prompt_logprobs is not None:
                    self._logprob_budget = max(0, self._logprob_budget - n)
                budget -= n
                continue
            while not self.block_manager.can_allocate(seq, n):
                victim = self._kv_victim([s for s in order[i:] if s not in gone])
                gone.add(victim)
                if victim is not seq and not victim.is_prefill:
                    decodes_left -= 1
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            if seq in gone:
                continue
            self._run(seq, n, batch)
            budget -= n
        return budget

    def _kv_victim(self, candidates: list[Sequence]) -> Sequence:
        """Who gives its KV blocks back: of the tenant with the most seats per weight among
        `candidates` (rows not scheduled yet), the least advanced sequence (the newest on a
        tie): the least work lost, never simply the newest request of the replica."""
        tenant = self.shares.most_seated(dict.fromkeys(s.tenant for s in candidates))
        mine = [
            (s.num_computed_tokens, -i, s) for i, s in enumerate(candidates) if s.tenant == tenant
        ]
        return min(mine, key=lambda m: (m[0], m[1]))[2]

    def _preempt(
        self, victim: Sequence, preempted: list[str], batch: list[ScheduledSeq] | None = None
    ) -> int:
        """Send a running sequence back to the front of the queue (to recompute later); if
        `batch` holds its row of this step, take the row back. Returns the row's tokens."""
        tokens = 0
        if batch is not None:
            for j in range(len(batch) - 1, -1, -1):
                if batch[j].seq is victim:
                    tokens = batch.pop(j).num_new_tokens
                    self.shares.serve(victim.tenant, -tokens)
                    break
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.preemptions_total += 1
        self.shares.preempt(victim.tenant)
        self.waiting.appendleft(victim)
        preempted.append(victim.request_id)
        return tokens

    def _run(self, seq: Sequence, n: int, batch: list[ScheduledSeq]) -> None:
        self.block_manager.allocate(seq, n)
        start = seq.num_computed_tokens
        batch.append(ScheduledSeq(seq, start, n, start + n == len(seq.token_ids)))
        self.shares.serve(seq.tenant, n)
        if seq.params.prompt_logprobs is not None:
            self._logprob_budget = max(0, self._logprob_budget - n)

    def _barrier_keys(self, adapters: Adapters) -> dict[str, int]:
        """Adapters of requests deferred too long whose adapter is ready, the oldest
        request's first (key -> order)."""
        limit = self.config.max_deferral_steps
        starving = [
            s
            for s in self.waiting
            if s.deferred and s.deferred_steps > limit and s.lora is not None
            and adapters.ready(s.lora)
        ]  # fmt: skip
        starving.sort(key=lambda s: s.arrival_step)
        keys: dict[str, int] = {}
        for s in starving:
            keys.setdefault(s.lora.key, len(keys))  # type: ignore[union-attr]
        return keys

    def _admit(
        self,
        batch: list[ScheduledSeq],
        budget: int,
        barrier: dict[str, int],
        room: _Room,
        preempted: list[str],
        kv_short: bool,
    ) -> None:
        """Admit waiting requests: starving adapters' first (every one that fits, the oldest
        first; while one does not, other adapters wait: the barrier), then the tenant furthest
        below its share of served tokens. A tenant below its share of seats that finds no seat,
        token budget or KV block takes one from the tenant with the most seats per weight
        (fairness.py). After running sequences were preempted for KV blocks (`kv_short`),
        only tenants below their share are admitted."""
        cfg, shares = self.config, self.shares
        self._blocked = False
        skip = set(preempted)  # sent back in this step: not admitted again in it
        # (rank, order, preempted first, queue position): lower is admitted first
        heap: list[tuple[int, float, int, int, Sequence]] = []
        counters: dict[str, float] = {}  # (no tenant is served while the heap is built)
        for pos, seq in enumerate(self.waiting):
            key = seq.lora_key
            if key is not None:
                room.wanted.add(key)
            if skip and seq.request_id in skip:
                continue
            if key is not None and key in barrier:
                heap.append((0, barrier[key], 0, pos, seq))
            else:
                tenant = seq.tenant
                counter = counters.get(tenant)
                if counter is None:
                    counter = counters[tenant] = shares.counter(tenant)
                heap.append((1, counter, 0 if seq.num_preemptions else 1, pos, seq))
        heapq.heapify(heap)
        # the tenants with a request in the heap: once every one is settled (or gave way) while
        # the seats are contended, no later entry can be admitted or change anything
        queued = {entry[4].tenant for entry in heap}
        victims: set[str] = set()  # tenants that gave way in this step
        taken = 0
        limit = max(1, cfg.max_num_seqs // 16)  # seats taken back per step at most
        admitted: set[Sequence] = set()
        swapped = False  # an adapter gave its memory up in this step
        settled: set[str] = set()  # tenants below no one's share, until seats change hands

        def gave_way(victim: Sequence) -> None:  # preempted for a tenant below its share
            victims.add(victim.tenant)
            if victim in admitted:  # admitted earlier in this step: still in self.waiting,
                admitted.discard(victim)  # where _preempt put it at the front a second time
                del self.waiting[self.waiting.index(victim, 1)]

        while heap:
            rank, order, sub, pos, seq = heapq.heappop(heap)
            tenant = seq.tenant
            if rank and order != shares.counter(tenant):  # served since it was ranked
                heapq.heappush(heap, (rank, shares.counter(tenant), sub, pos, seq))
                continue
            if tenant in victims:
                continue
            lora = seq.lora
            key = seq.lora_key
            if rank and self._blocked and key is not None and key not in barrier:
                continue  # the barrier: a starving adapter does not fit yet
            contended = kv_short or len(self.running) >= cfg.max_num_seqs
            if contended and (tenant in settled or not self._below_share(tenant)):
                settled.add(tenant)  # no seat to take: skip its other requests cheaply
                if len(settled) + len(victims) >= len(queued) and queued <= settled | victims:
                    break  # every entry left would be skipped so (an overloaded replica's)
                continue
            if lora is not None and lora.key not in room.in_use:
                if not room.adapters.ready(lora):
                    continue  # still loading
                if not room.fits(lora) and not swapped:  # one adapter changes hands a step
                    gave, tokens = self._adapter_room(
                        tenant, lora, room, preempted, batch, max(1, cfg.max_num_seqs // 4)
                    )
                    budget += tokens
                    for gone in gave:
                        gave_way(gone)
                    swapped = bool(gave)
                if (
                    not room.fits(lora)
                    or lora.key in room.unplaced
                    or not room.adapters.place(lora, room.in_use | room.placed, room.wanted)
                ):
                    if lora.key in barrier:
                        self._blocked = True
                    if room.fits(lora):
                        room.unplaced.add(lora.key)  # its memory is still KV cache in use
                    continue  # deferred
                room.placed.add(lora.key)  # kept while its request's KV blocks are found
            cached = self.block_manager.num_cached_prefix_tokens(seq)
            n = self._chunk(seq, seq.num_tokens - cached, budget)
            while taken < limit and (
                len(self.running) >= cfg.max_num_seqs
                or n <= 0
                or not self.block_manager.can_allocate(seq, n)
            ):
                victim = self._seat_victim(tenant)
                if victim is None:
                    break
                settled.clear()  # seats changed hands: every tenant's standing may have
                budget += self._preempt(victim, preempted, batch)
                gave_way(victim)
                taken += 1
                cached = self.block_manager.num_cached_prefix_tokens(seq)
                n = self._chunk(seq, seq.num_tokens - cached, budget)
            if len(self.running) >= cfg.max_num_seqs:
                break
            if n <= 0 and seq.params.prompt_logprobs is not None and budget > 0:
                continue  # the step's scoring budget is spent; others may still run
            if n <= 0 or not self.block_manager.can_allocate(seq, n):
                break  # wait for tokens or blocks rather than let later requests pass
            seq.status = SequenceStatus.RUNNING
            seq.deferred = False
            self.running.append(seq)
            shares.admit(tenant)
            settled.clear()
            self._run(seq, n, batch)
            budget -= n
            if lora is not None and lora.key not in room.in_use:
                room.add(lora)
            admitted.add(seq)
        if admitted:
            self.waiting = deque(s for s in self.waiting if s not in admitted)

    def _adapter_room(
        self,
        taker: str,
        lora: LoRARef,
        room: _Room,
        preempted: list[str],
        batch: list[ScheduledSeq],
        most: int,
    ) -> tuple[list[Sequence], int]:
        """Adapter memory for `taker`'s adapter `lora`, which does not fit: the tenant with the
        most adapter memory (slots, without a byte budget) per weight gives one of its running
        adapters up, if it keeps at least as much per weight as the taker then has (the seats'
        hysteresis, in bytes). That adapter's running sequences (the one with the fewest, and
        at most `most` of them) are preempted, so it turns idle and evictable. Returns them and
        the tokens their rows of this step had."""
        if not any(s.running for t, s in self.shares.tenants.items() if t != taker):
            return [], 0  # no other tenant runs an adapter that could be given up
        budget = room.adapters.budget_bytes
        size = room.adapters.device_bytes

        def cost(ref: LoRARef) -> float:
            return float(size(ref)) if budget is not None else 1.0

        users: dict[str, list[Sequence]] = {}
        refs: dict[str, LoRARef] = {}
        held: dict[str, float] = {}  # tenant -> its adapter memory (slots), as `cost` counts
        for pin in room.pinned.values():  # counted in its tenant's share, never given up
            held[pin.tenant] = held.get(pin.tenant, 0.0) + cost(pin)
        for seq in self.running:
            ref = seq.lora
            if ref is None:
                continue
            key = ref.key
            if key not in room.in_use or key in room.pinned:
                continue
            users.setdefault(key, []).append(seq)
            if key not in refs:
                refs[key] = ref
                held[seq.tenant] = held.get(seq.tenant, 0.0) + cost(ref)
        gave: list[Sequence] = []
        tokens = 0
        while not room.fits(lora):
            shares = self.shares
            mine = held.get(taker, 0.0) + cost(lora)
            best = None
            for key, ref in refs.items():
                owner = users[key][0].tenant
                if owner == taker or key in room.placed or len(users[key]) > most - len(gave):
                    continue
                left = (held[owner] - cost(ref)) / shares.get(owner).weight
                if left < mine / shares.get(taker).weight:
                    continue  # the owner would end below the taker: no swap (hysteresis)
                rank = (held[owner] / shares.get(owner).weight, -len(users[key]))
                if best is None or rank > best[0]:
                    best = (rank, key)
            if best is None:
                break
            key = best[1]
            ref = refs.pop(key)
            owner = users[key][0].tenant
            for victim in users.pop(key):
                tokens += self._preempt(victim, preempted, batch)
                gave.append(victim)
            held[owner] -= cost(ref)
            room.remove(ref)
        return gave, tokens

    def _below_share(self, tenant: str) -> bool:
        """Would some running tenant give a seat to `tenant` (fairness.py's rule)?"""
        return self.shares.giver({s.tenant for s in self.running}, tenant) is not None

    def _seat_victim(self, taker: str) -> Sequence | None:
        """The sequence that gives its seat to `taker`: the least advanced (the newest on a
        tie) of the most seated tenant per weight that gives way (fairness.py)."""
        tenant = self.shares.giver({s.tenant for s in self.running}, taker)
        if tenant is None:
            return None
        mine = [
            (s.num_computed_tokens, -i, s) for i, s in enumerate(self.running) if s.tenant == tenant
        ]
        return min(mine, key=lambda m: (m[0], m[1]))[2]

    def _count_deferred(self, barrier: dict[str, int], room: _Room) -> tuple[int, int]:
        count = newly = 0
        deferred: dict[str, bool] = {}  # adapter key -> held back by the adapter rules
        for seq in self.waiting:
            lora = seq.lora
            if lora is None:
                seq.deferred = False
                continue
            key = lora.key
            if key not in deferred:
                deferred[key] = (self._blocked and key not in barrier) or (
                    key not in room.in_use
                    and room.adapters.ready(lora)
                    and (not room.fits(lora) or key in room.unplaced)
                )
            seq.deferred = deferred[key]
            if seq.deferred:
                seq.deferred_steps += 1
                count, newly = count + 1, newly + (seq.deferred_steps == 1)
        self.num_deferred = count
        self.deferred_total += newly
        return count, newly

    def postprocess(
        self,
        output: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[float | None] | None = None,
        top_logprobs: list[list[tuple[int, float]] | None] | None = None,
    ) -> list[Sequence]:
        """Record a step's results (one token, and logprob and best alternatives, per row of
        `output.sampled`, in order); return the sequences it finished, their blocks already
        freed."""
        rows = output.sampled
        if len(sampled_token_ids) != len(rows) or len(logprobs or rows) != len(rows):
            raise ValueError(f"expected {len(rows)} sampled token ids (and logprobs, if any)")
        running = SequenceStatus.RUNNING
        # (registering is a no-op without the prefix cache: not called then, as every row of
        # every step comes here)
        blocks = self.block_manager
        register = blocks.register_full_blocks if blocks.enable_prefix_caching else None
        for seq, start, n, _ in output.scheduled:
            if seq.status is running:  # not aborted while the step ran
                seq.num_computed_tokens = start + n
                if register is not None:
                    register(seq)
        finished: list[Sequence] = []
        eos, max_len = self.eos_token_id, self._max_len
        for i, (r, token) in enumerate(zip(rows, sampled_token_ids, strict=True)):
            seq = r.seq
            if seq.status is not running:
                continue
            if logprobs or top_logprobs:
                wants = seq.params.wants_logprobs
                seq.append_token(
                    token,
                    logprobs[i] if logprobs and wants else None,
                    top_logprobs[i] if top_logprobs and wants else None,
                )
            else:
                seq.token_ids.append(token)  # `append_token` without log-probabilities
            reason = seq.stop_reason(token, eos, max_len)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    @property
    def running_lora_keys(self) -> set[str]:
        """Adapter versions of running sequences."""
        return {k for s in self.running if (k := s.lora_key) is not None}

    @property
    def in_use_lora_keys(self) -> set[str]:
        """Adapters that must stay resident now: the running ones and, while a step admits
        requests, those placed for them (KV reclaim must not evict them)."""
        in_use = self.running_lora_keys
        if self._room is not None:
            in_use |= self._room.placed
        return in_use

    @property
    def waiting_lora_keys(self) -> set[str]:
        """Adapter versions of waiting sequences."""
        return {k for s in self.waiting if (k := s.lora_key) is not None}

    def waiting_loras(self) -> list[LoRARef]:
        """Distinct adapter versions of waiting requests, the oldest request's first (the
        order the engine prefetches them in: preempted requests lead the queue)."""
        return list(dict.fromkeys(s.lora for s in self.waiting if s.lora is not None))

    def waiting_per_lora(self) -> Counter[LoRARef]:
        """Waiting requests per adapter version (loraplane_adapter_waiting_requests)."""
        return Counter(s.lora for s in self.waiting if s.lora is not None)

    @property
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)
