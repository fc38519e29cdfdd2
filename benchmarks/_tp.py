"""`engine_cpu.py --tp N`: the decode step of the benchmark model split over N processes (gloo,
the cores shared out) against the same model in one process, in the same run.

Both engines hold 64 sequences over 8 rank-16 adapters and take decode steps in turn (the
one-process engine with every core, each rank of the split one with its share). A split step's
time is divided into communication (all-reduce and all-gather, waits for the slowest rank
included), the step message (rank 0's broadcast of the plan) and the rest (compute and host
work), from rank 0's counters. No goal: on a 2-core CPU the split only shows its overheads;
the figures that matter (NVLink all-reduce against a GPU step) need a multi-GPU machine.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.cpus import engine_threads
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import LoRARef
from loraplane.demo.build import build_adapter, build_llama


def _engine(
    model: Path, adapters: list[Path], tp: int, num_seqs: int
) -> tuple[Engine, list[LoRARef]]:
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", max_loras=8,
                          max_num_seqs=num_seqs, num_kv_blocks=num_seqs * 16,
                          enable_prefix_caching=False, tensor_parallel_size=tp)  # fmt: skip
    engine = Engine(config)
    refs = [engine.register_lora(f"a{i}", p, "bench") for i, p in enumerate(adapters)]
    return engine, refs


def run_tp(
    size: int, shape: dict[str, int], prompts: list[list[int]], steps: int
) -> dict[str, float]:
    """Figures of the split decode step against the unsplit one (see the module docstring)."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        root = Path(tmp)
        print(f"building the benchmark model and 8 adapters; tensor parallel size {size} ...",
              flush=True)  # fmt: skip
        model = build_llama(root / "model", **shape)
        adapters = [build_adapter(model, root / f"a{i}", r=16, lora_alpha=32, seed=i)
                    for i in range(8)]  # fmt: skip
        one, refs_one = _engine(model, adapters, 1, len(prompts))
        split, refs_split = _engine(model, adapters, size, len(prompts))
        comm = split.runner.workers.comm  # type: ignore[union-attr]
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        per_rank = engine_threads(size)
        for engine, refs, n in ((one, refs_one, threads), (split, refs_split, per_rank)):
            torch.set_num_threads(n)
            for i, p in enumerate(prompts):
                engine.add_request(f"p{i}", p, params, refs[i % 8])
            while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()
        whole, parts, comms, messages = [], [], [], []
        for _ in range(steps):  # in turn, each engine with its threads
            torch.set_num_threads(threads)
            start = time.perf_counter()
            one.step()
            whole.append(time.perf_counter() - start)
            torch.set_num_threads(per_rank)
            c0, m0 = comm.comm_seconds, comm.message_seconds
            start = time.perf_counter()
            split.step()
            parts.append(time.perf_counter() - start)
            comms.append(comm.comm_seconds - c0)
            messages.append(comm.message_seconds - m0)
        split.close()
        torch.set_num_threads(threads)
    step = statistics.median(parts)
    return {
        "decode_step_ms_tp1": statistics.median(whole) * 1e3,
        f"decode_step_ms_tp{size}": step * 1e3,
        f"tp{size}_over_tp1": statistics.median(p / w for p, w in zip(parts, whole, strict=True)),
        f"tp{size}_communication_ms": statistics.median(comms) * 1e3,
        f"tp{size}_step_message_ms": statistics.median(messages) * 1e3,
        f"tp{size}_compute_and_host_ms": statistics.median(
            p - c - m for p, c, m in zip(parts, comms, messages, strict=True)
        )
        * 1e3,
        f"tp{size}_communication_share": statistics.median(
            c / p for p, c in zip(parts, comms, strict=True)
        ),
    }
