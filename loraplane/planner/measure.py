"""The real engine under load, for calibration and for checking the simulator against it.

`build_bench` writes a small Llama model and stores adapters of a profile in a local object
store (the catalog's path: ingest, then `register_stored` and loads from the disk tier, as
`benchmarks/tiers.py` does); `closed_loop` runs requests through `Engine.step()` with a fixed
number in flight and records what each step computed (the engine's step records,
step_observer.py) and how long it took.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplane.planner.cost import StepShape
from loraplane.planner.replica import ReplicaSettings, step_shape

Clock = Callable[[], float]

if TYPE_CHECKING:
    from loraplane.adapters.ingest import AdapterVersion
    from loraplane.adapters.store import LocalStore
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sequence import LoRARef
    from loraplane.dataplane.step_observer import StepRecord

# A model that steps in tens of milliseconds on two cores (fp32).
SMALL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 704,
    "vocab_size": 4096,
    "max_position_embeddings": 1024,
}


@dataclass(slots=True)
class Bench:
    """A model folder and stored adapter versions of it, under `root`."""

    root: Path
    model: Path
    store: LocalStore
    versions: list[AdapterVersion]


def build_bench(
    root: Path,
    adapters: int,
    rank: int = 16,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    shape: dict[str, Any] | None = None,
    model: Path | None = None,
) -> Bench:
    """Write (or use) a model and store `adapters` seeded random adapters of it under `root`."""
    from loraplane.adapters.base_model import BaseModelSpec
    from loraplane.adapters.ingest import ingest
    from loraplane.adapters.limits import AdapterLimits
    from loraplane.adapters.store import LocalStore
    from loraplane.demo.build import build_adapter, build_llama

    if model is None:
        model = build_llama(root / "model", **(shape or SMALL_SHAPE))
    spec = BaseModelSpec.from_dir(model)
    store = LocalStore(root / "store")
    versions = []
    limits = AdapterLimits(max_rank=max(64, rank))
    for i in range(adapters):
        src = build_adapter(model, root / "src" / str(i), r=rank, lora_alpha=2 * rank,
                            target_modules=list(modules), seed=i)  # fmt: skip
        versions.append(ingest(src, "bench", f"a{i}", spec, limits, store))
        for f in src.iterdir():
            f.unlink()
        src.rmdir()
    return Bench(root, model, store, versions)


def make_engine(bench: Bench, **overrides: Any) -> tuple[Engine, list[LoRARef]]:
    """An engine on the CPU over `bench`'s model with its adapters registered (not loaded).

    Engines made before it are collected first: an engine is freed by the cycle collector,
    and a collection that frees one's weights and KV cache inside a timed step of the next
    costs that step tens of milliseconds (40 ms measured on the small model)."""
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sequence import LoRARef
    from loraplane.dataplane.tiers.disk import DiskTier

    gc.collect()
    settings: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 64,
        "num_kv_blocks": 64 * 8,
        "enable_prefix_caching": False,
    }
    settings.update(overrides)
    disk = DiskTier(bench.store, root=bench.root / "disk")  # a local store is read in place
    engine = Engine(EngineConfig(model=str(bench.model), **settings), disk=disk)
    refs = [
        engine.loras.register_stored(LoRARef(v.name, v.tenant, v.digest), v.path)
        for v in bench.versions
    ]
    return engine, refs


def replica_settings(engine: Engine, adapter_bytes: int,
                     loads_share_core: bool = False) -> ReplicaSettings:  # fmt: skip
    """The simulator's settings for a replica that is `engine` (its config, KV blocks and
    resolved adapter memory), with adapters of `adapter_bytes` each; `loads_share_core` for
    times read in the process's CPU time (`ReplicaSettings.loads_share_core`)."""
    config = engine.config
    return ReplicaSettings(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        lora_slots=config.lora_slots,
        lora_budget_bytes=engine.runner.lora_budget_bytes,
        adapter_bytes=adapter_bytes,
        adapter_device_bytes=adapter_bytes,
        max_cpu_loras=config.max_cpu_loras or config.lora_slots,
        kv_blocks=engine.runner.num_blocks,
        block_size=config.block_size,
        max_deferral_steps=config.max_deferral_steps,
        loads_in_flight=engine.loras.max_loads_in_flight,
        device_copies=engine.runner.device.type == "cuda",
        enable_chunked_prefill=config.enable_chunked_prefill,
        max_model_len=config.max_model_len,
        loads_share_core=loads_share_core,
    )


@dataclass(slots=True)
class LoadRun:
    """A closed-loop run: throughput, every request's time to first token, every step."""

    tokens_per_s: float
    ttft: list[float]  # in request order
    steps: list[tuple[StepShape, float]] = field(default_factory=list)
    loads: int = 0  # loads into host memory that ended in the run (the step records')
    load_seconds: list[float] = field(default_factory=list)  # each load's, as the engine saw it
    cold: list[bool] = field(default_factory=list)  # per request: adapter not in host memory
    deferred: int = 0  # requests the adapter rules held back at least once (step records)


def closed_loop(engine: Engine, refs: list[LoRARef], trace: list[tuple[int, int, int]],
                in_flight: int, seed: int = 0, adapter_bytes: int = 0,
                clock: Clock = time.perf_counter,
                engine_only: bool = False) -> LoadRun:  # fmt: skip
    """Run the requests of `trace` ((adapter index, prompt tokens, output tokens) each, as
    `fleet.draw_requests` gives them), `in_flight` at a time; a finished request sends the
    next at once. Tokens/s counts generated tokens from the first step to the last request's
    end, as `benchmarks/tiers.py` does. `clock` reads every time: wall time by default;
    `time.thread_time` (this thread's CPU time) leaves out the engine's waits for its loader
    threads and their work; `time.process_time` counts both, as if on one core (what
    `validate.py` reads, unmoved by other processes on a shared host). `engine_only`: time
    passes only inside `Engine.step()` (arrivals, first tokens and the span read that time):
    the loop's own work, making the next request and reading the outputs, is the client's (a
    server's API), not the replica's."""
    from loraplane.dataplane.sampling import SamplingParams

    rng = random.Random(seed)  # noqa: S311 - a seeded workload, not secrets
    vocab = min(engine.runner.vocab_size, 32000)
    arrived: list[float] = []
    cold: list[bool] = []
    load_seconds: list[float] = []
    first: dict[int, float] = {}
    records: list[StepRecord] = []

    deferred = 0
    inside = 0.0  # time spent in Engine.step() so far

    def now() -> float:
        return inside if engine_only else clock()

    def observe(record: StepRecord) -> None:
        nonlocal deferred
        records.append(record)
        load_seconds.extend(record.load_seconds("cpu"))
        if record.batch is not None:
            deferred += record.batch.num_newly_deferred

    def send() -> None:
        i = len(arrived)
        adapter, prompt_tokens, output_tokens = trace[i]
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
        cold.append(not engine.loras.ready(refs[adapter]))
        arrived.append(now())
        engine.add_request(f"p{i}", prompt, params, refs[adapter])

    engine.observers.flush_loads()  # loads that ended before this run are not its own
    engine.observers.append(observe)
    try:
        for _ in range(min(in_flight, len(trace))):
            send()
        steps: list[tuple[StepShape, float]] = []
        tokens = done = 0
        start = now()
        while done < len(trace):
            records.clear()
            began = clock()
            results = engine.step()
            took = clock() - began
            inside += took
            batch = records[-1].batch if records else None
            if batch is not None and batch.scheduled:
                steps.append((step_shape(batch, adapter_bytes), took))
            for r in results:
                i = int(r.request_id[1:])
                if i not in first and r.token_ids:
                    first[i] = now() - arrived[i]
                tokens += len(r.token_ids)
                if r.finished:
                    done += 1
                    if len(arrived) < len(trace):
                        send()
        elapsed = now() - start
        engine.observers.flush_loads()  # loads that ended after the last step are the run's
    finally:
        engine.observers.remove(observe)
    ttft = [first.get(i, 0.0) for i in range(len(trace))]
    return LoadRun(tokens / elapsed, ttft, steps, len(load_seconds), load_seconds, cold, deferred)
