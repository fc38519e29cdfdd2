"""The engine: requests in, tokens and text out, many tenants' adapters in every step.

    engine = Engine(EngineConfig(model="path/to/hf-model", device="cpu", dtype="float32"))
    ref = engine.register_lora("support-bot", "path/to/peft-adapter", tenant="acme")
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=16), lora=ref)
    while engine.has_unfinished:
        for out in engine.step(): print(out.request_id, out.text, out.finished)

One `step()` is one forward pass over a mixed batch: prefill chunks and decode tokens of many
requests, each with its own adapter (or none), as many distinct adapters per step as the
adapter memory (`lora_memory`) holds.

Each step is recorded for `engine.observers` (step_observer.py): what ran, what it cost, what
loaded. What a step puts out per request (text deltas, log-probabilities, finish reasons) is
emission.py's; what happens when a step or an adapter fails is isolation.py's.

`Engine(config, detokenize=False)` outputs token ids with no text and never checks stop
strings: the engine process's mode (engine_process.py), where the API server's process turns
ids into text with the same `IncrementalDetokenizer.add_output` and aborts a sequence whose
stop string it finds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.dataplane import kv_quant
from loraplane.dataplane.block_manager import BlockManager
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.cuda_graphs import Capture
from loraplane.dataplane.emission import Emitter, record_prompt_logprobs
from loraplane.dataplane.isolation import Computed, FaultIsolation
from loraplane.dataplane.lora.arena import KVArena
from loraplane.dataplane.model_runner import ModelRunner
from loraplane.dataplane.outputs import ADAPTER_LOAD_TIMEOUT, RequestOutput, failure_message
from loraplane.dataplane.parallel.errors import WorkerLost
from loraplane.dataplane.sampler import Sampler, make_generator
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.scheduler import Scheduler, SchedulerOutput
from loraplane.dataplane.sequence import LoRARef, Sequence, SequenceStatus
from loraplane.dataplane.step_observer import StepObservers
from loraplane.dataplane.structured import GrammarCompiler, Matcher
from loraplane.dataplane.tiers.disk import DiskTier
from loraplane.dataplane.tokenizer import Tokenizer

# what the engine's callers import from here (RequestOutput, failure_message and
# ADAPTER_LOAD_TIMEOUT: outputs.py, which the API server's process imports without the engine)
__all__ = [
    "ADAPTER_LOAD_TIMEOUT",
    "LOAD_WAIT_S",
    "MAX_LOAD_WAIT_FRACTION",
    "Completion",
    "Engine",
    "EngineStats",
    "RequestOutput",
    "failure_message",
]

log = logging.getLogger(__name__)

# A step with nothing to run because every waiting request's adapter is loading waits this
# long at most for a load to end (a new request arriving meanwhile waits as long).
LOAD_WAIT_S = 0.02
# A step with seats free may wait for the loads of waiting requests' adapters: n requests
# admitted now instead of one step later add n tokens to a step of r running requests, which
# pays for a wait of up to n / r of a step's time. The engine waits at most that long (and at
# most half a step), and only while such loads run.
MAX_LOAD_WAIT_FRACTION = 0.5


@dataclass(slots=True)
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class EngineStats:
    """Counters the server turns into metrics."""

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0


class Engine:
    """One base model on one device, serving many adapters in mixed batches."""

    def __init__(
        self, config: EngineConfig, disk: DiskTier | None = None, *, detokenize: bool = True
    ) -> None:
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.runner = ModelRunner(config, disk)
        self.config = config = self.runner.config  # max_model_len, num_kv_blocks filled in
        assert config.num_kv_blocks is not None
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        if config.kv_lora_shared:  # adapters in KV blocks: idle ones make room for sequences
            # an FP8 cache's bytes viewed in the adapters' dtype
            kv_bytes = kv_quant.storage_view(self.runner.kv_cache, self.runner.dtype)
            arena = KVArena(kv_bytes, self.block_manager)
            self.runner.pool.attach_arena(arena)
            self.block_manager.reclaim = self._reclaim
        self.scheduler = Scheduler(
            config.scheduler_config(), self.block_manager, self.tokenizer.eos_token_id
        )
        if config.cuda_graphs:
            self.enable_cuda_graphs()
        # on the logits' device, sharing the runner's counted device->host copy
        self.sampler = Sampler(config.seed, self.runner.device, self.runner.host_copy)
        self.loras = self.runner.loras
        self.stats = EngineStats()
        self.observers = StepObservers()  # each step's record; the tiers report loads to it
        self.loras.host_stats.report = self.observers.load_ended
        self.loras.device_stats.report = self.observers.load_ended
        self.detokenize = detokenize  # text and stop strings here (else: ids only)
        self.emitter = Emitter(self.scheduler, self.tokenizer, detokenize)
        self.isolation = FaultIsolation(self.scheduler, self.loras, self.emitter)
        self._step_seconds = 0.0  # moving average of a step's time
        self._swept = time.monotonic()  # the last sweep of idle stored versions
        self.last_batch: list[str] = []  # request ids of the step being run (see step)
        # the last step's forward failed for the base model's rows, or for every adapter
        # alone: a fault of the engine or device (a poisoned CUDA context), not of one tenant
        self.broken = False
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    def enable_cuda_graphs(self, capture: Capture | None = None) -> bool:
        """Capture decode CUDA graphs (`cuda_graphs.py`; `capture`: how, CUDA's by default),
        reserving one KV block for their padding rows; False, logged, when they cannot be
        captured (no CUDA, a torch kernel path, a capture error): steps stay eager."""
        if self.runner.cuda_graphs is not None:
            return True
        pad_block = self.block_manager.reserve(1)
        if pad_block is None:
            log.warning("no free KV block for CUDA graph padding: decode steps run eagerly")
            return False
        if not self.runner.enable_cuda_graphs(pad_block, capture):
            self.block_manager.release(pad_block, 1)
            return False
        return True

    def close(self) -> None:
        """Stop the adapter loader threads and the tensor-parallel workers (if any); the
        engine cannot step afterwards."""
        self.loras.close()
        self.runner.close()

    # -- adapters ---------------------------------------------------------------------------

    def register_lora(self, name: str, path: Path | str, tenant: str = "default") -> LoRARef:
        """Validate and load an adapter (AdapterRejected if it is refused); return its ref."""
        return self.loras.register(name, path, tenant)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora: LoRARef | None = None,
        tenant: str | None = None,
    ) -> Sequence:
        """Queue a request. Raises ValueError when it can never run (too long, unknown adapter)."""
        params = params or SamplingParams()
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.truncate_prompt_tokens is not None:
            tokens = tokens[-params.truncate_prompt_tokens :]
        vocab = self.runner.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias holds token ids outside the vocabulary ({vocab})")
        if lora is not None and not self.loras.is_registered(lora):
            raise ValueError(f"adapter {lora.key} is not registered")
        if not params.ignore_eos:
            extra = sorted(self.tokenizer.eos_token_ids - set(params.stop_token_ids))
            if extra:
                params = dataclasses.replace(
                    params, stop_token_ids=[*params.stop_token_ids, *extra]
                )
        if params.grammar is not None and params.grammar.vocab_size != vocab:
            raise ValueError("the grammar was compiled for another vocabulary")
        seq = Sequence(request_id, tokens, params, lora, tenant or (lora.tenant if lora else ""))
        if params.seed is not None:
            seq.generator = make_generator(params.seed, self.runner.device)
        if params.grammar is not None:
            seq.matcher = Matcher(params.grammar)
        self.scheduler.add(seq)
        self.emitter.add(request_id, params)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if it is unknown or already done."""
        seq = self.scheduler.abort(request_id)
        self.emitter.forget(request_id)
        return seq is not None

    def request_ids(self) -> list[str]:
        """Every waiting and running request's id."""
        return [s.request_id for s in (*self.scheduler.waiting, *self.scheduler.running)]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return an output for every request that got a token (or
        failed: a request whose adapter cannot be loaded ends with `error` set).

        Failures stay with the requests that cause them: a forward pass or sampler that
        raises is run again one adapter at a time, a request whose output cannot be formed
        fails alone, and housekeeping (prefetch, forgetting idle adapters) never fails a step.
        Anything else raises, with `last_batch` naming the requests of the failed step."""
        self.last_batch = []
        self.broken = False
        failed = self.isolation.fail_unloadable(self.config.adapter_load_timeout_s)
        self._housekeeping()
        start = time.perf_counter()
        out = self.scheduler.schedule(self.loras)
        scheduled = time.perf_counter()
        if not out.scheduled:
            if self.scheduler.waiting:  # every waiting request waits for its adapter's load
                self.loras.wait_for_load(LOAD_WAIT_S)
            self.observers.record(out, scheduled - start, failed_requests=len(failed))
            return failed
        self.last_batch = [r.seq.request_id for r in out.scheduled]
        try:
            parts = [(out, self._compute(out))]
        except WorkerLost:  # the split model lost a rank: no request can step again
            raise
        except Exception as error:  # one tenant's failure must not end the others' requests
            if self.runner.workers is not None:  # a rank may have stopped mid-step: the
                # ranks' collectives are out of step, and rerunning parts would hang them
                raise WorkerLost(f"a step of the split model failed: {error!r}") from error
            isolated = self.isolation.compute_isolated(out, error, self._compute)
            parts, self.broken = isolated.parts, isolated.broken
            failed += isolated.failed
        computed_at = time.perf_counter()
        outputs = [o for part, computed in parts for o in self._record(part, computed)]
        end = time.perf_counter()
        elapsed = end - start
        self._step_seconds += 0.2 * (elapsed - self._step_seconds)
        self.stats.steps += 1
        self.stats.preemptions += len(out.preempted)
        self.observers.record(
            out, scheduled - start, computed_at - scheduled, end - computed_at, len(failed)
        )
        return failed + outputs

    def _housekeeping(self) -> None:
        """Forget idle adapters, prefetch the waiting requests' adapters (the waiting queue is
        the prefetch list: the next requests' adapters load first, in the background, a
        bounded number at a time) and wait for loads that pay for themselves. A failure here
        costs only the optimisation, never a request."""
        try:
            self._forget_idle()
            waiting = self.scheduler.waiting_loras()
            self.loras.prefetch(waiting)
            if waiting:
                self.wait_for_loads()
        except Exception:
            log.exception("adapter housekeeping failed (requests go on)")

    def _compute(self, out: SchedulerOutput) -> Computed:
        """Run the rows of `out` through the model and the sampler; records nothing."""
        # the step's adapters were placed when their requests were admitted: this only checks,
        # and trims the host tier, sparing the copies waiting requests need
        s = self.scheduler
        logits = self.runner.execute(out, s.running_lora_keys, s.waiting_lora_keys)
        rows = out.sampled
        seqs = [r.seq for r in rows]
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        matchers = [s.matcher for s in seqs] if any(s.matcher for s in seqs) else None
        sampled = self.sampler(logits.sampled, params, generators, seqs, matchers)
        return sampled, logits.prompt

    def _record(self, out: SchedulerOutput, computed: Computed) -> list[RequestOutput]:
        """Record a computed step's tokens and form each request's output (a request whose
        output cannot be formed, e.g. its text does not decode, fails alone)."""
        sampled, prompt = computed
        for row in out.scheduled if prompt else ():
            if row.seq.request_id in prompt:
                record_prompt_logprobs(row.seq, prompt[row.seq.request_id])
        live = [r.seq for r in out.sampled if r.seq.status is SequenceStatus.RUNNING]
        self.scheduler.postprocess(out, sampled.token_ids, sampled.logprobs, sampled.top_logprobs)
        self.stats.prompt_tokens += sum(
            r.num_new_tokens for r in out.scheduled if r.start < r.seq.num_prompt_tokens
        )
        self.stats.generation_tokens += len(live)
        return self.emitter.outputs(live)

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this model (made on first use; thread-safe:
        compile on a worker thread, never on the engine loop)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size)
            return self._grammars

    def _reclaim(self, short: int) -> None:
        """Sequences need `short` more KV blocks: idle adapters give theirs back."""
        s = self.scheduler
        self.loras.reclaim_blocks(short, s.in_use_lora_keys, s.waiting_lora_keys)

    def _forget_idle(self) -> None:
        """Once in a while, forget stored versions nobody has used for a while (catalog mode
        registers every version it serves; the registry must not grow without end)."""
        now = time.monotonic()
        if now - self._swept < min(60.0, self.config.forget_idle_adapters_s):
            return
        self._swept = now
        needed = self.scheduler.running_lora_keys | self.scheduler.waiting_lora_keys
        self.loras.forget_idle(self.config.forget_idle_adapters_s, needed)

    def wait_for_loads(self) -> None:
        """Block the calling (engine) thread while adapter loads run that would let waiting
        requests into the next step, as long as admitting them a step early pays for the wait
        (MAX_LOAD_WAIT_FRACTION): with `seats` free, `running` requests running and `awaiting`
        waiting requests whose adapters are loading, at most
        min(MAX_LOAD_WAIT_FRACTION, min(awaiting, seats) / running) of a step (the moving
        average of step times); not at all without a free seat, a timed step or such a load.
        A step's housekeeping calls it; the planner's replica (planner/replica.py) does the
        same in simulated time."""
        seats = self.config.max_num_seqs - len(self.scheduler.running)
        if seats <= 0 or self._step_seconds <= 0:
            return
        loading = self.loras.pending()
        if not loading:
            return
        awaiting = [
            s for s in self.scheduler.waiting if s.lora is not None and s.lora.key in loading
        ]
        if not awaiting:
            return
        share = min(len(awaiting), seats) / max(1, len(self.scheduler.running))
        refs = [s.lora for s in awaiting if s.lora is not None]
        self.loras.wait_for(refs, min(MAX_LOAD_WAIT_FRACTION, share) * self._step_seconds)

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        loras: Seq[LoRARef | None] | None = None,
    ) -> list[Completion]:
        """Run the prompts to completion together (one continuous batch); outputs in order."""
        n = len(prompts)
        plist = list(params) if isinstance(params, Seq) else [params or SamplingParams()] * n
        llist = list(loras) if loras is not None else [None] * n
        if len(plist) != n or len(llist) != n:
            raise ValueError("params and loras must have one entry per prompt")
        stamp = f"gen-{time.monotonic_ns()}"
        results: dict[str, Completion] = {}
        for i, (prompt, p, lora) in enumerate(zip(prompts, plist, llist, strict=True)):
            seq = self.add_request(f"{stamp}-{i}", prompt, p, lora)
            results[seq.request_id] = Completion(seq.request_id, seq.prompt_token_ids)
        pending = set(results)
        while pending:
            for out in self.step():
                if out.request_id not in results:
                    continue
                done = results[out.request_id]
                done.token_ids.extend(out.token_ids)
                done.text += out.text
                done.logprobs.extend(out.logprobs or [])
                if out.finished:
                    done.finish_reason, done.error = out.finish_reason, out.error
                    pending.discard(out.request_id)
        return [results[f"{stamp}-{i}"] for i in range(n)]
