"""Where an eager decode step's time goes on a GPU: torch.profiler over a few decode steps of
the 8B shape cut to --layers layers (the per-layer costs are what an eager step repeats 32
times), without adapters and over --adapters adapters, printing the top operators by host (CPU)
time and by device time, and the step's wall time per layer.

It answers what engine_gpu.py's figures cannot: on the first H200 run an eager decode step of 64
rows took 25 ms without adapters and 86 ms over 8 (graphs: 15 ms; roofline 3.5 ms).
Run: python benchmarks/_profile_gpu.py [--layers 4] [--rows 64] [--adapters 8] [--top 25]
(exits 0 with a message when there is no CUDA device; a diagnostic, not in `make bench`;
--check-on-cpu runs a tiny model on CPU to check the script)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _gpu_model import write_adapter, write_llama
from engine_cpu import decode_step_seconds
from engine_gpu import SHAPE, SMOKE_SHAPE, prompts

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="profiled decode steps per case")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--check-on-cpu", action="store_true",
                        help="a 64-wide model on CPU: checks this script, not speed")  # fmt: skip
    args = parser.parse_args()
    if args.check_on_cpu:
        return profile_steps(args, torch.device("cpu"), {**SMOKE_SHAPE, "num_hidden_layers": 2})
    if not torch.cuda.is_available():
        print("profile_gpu: no CUDA device: skipped")
        return 0
    return profile_steps(args, torch.device("cuda"), {**SHAPE, "num_hidden_layers": args.layers})


def profile_steps(args: argparse.Namespace, device: torch.device, shape: dict[str, Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with tempfile.TemporaryDirectory(prefix="profile_gpu-") as tmp:
        root = Path(tmp)
        config, _, _ = write_llama(root / "model", shape, 2 << 30, dtype, device)
        paths = [root / f"a{i}" for i in range(args.adapters)]
        for i, path in enumerate(paths):
            write_adapter(path, config, 16, seed=1000 + i, dtype=dtype, device=device)
        config_ = EngineConfig(model=str(root / "model"), device=device.type,
                               dtype="bfloat16" if cuda else "float32",
                               max_num_seqs=args.rows, enable_prefix_caching=False,
                               cuda_graphs=False)  # fmt: skip
        engine = Engine(config_)
        refs = [engine.register_lora(f"a{i}", p, "bench") for i, p in enumerate(paths)]
        ids = prompts_for(args.rows, config["vocab_size"])
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        engine.generate(ids, params, [refs[i % len(refs)] for i in range(args.rows)])  # warm-up
        for name, loras in (("base", [None] * args.rows),
                            (f"{args.adapters} adapters",
                             [refs[i % len(refs)] for i in range(args.rows)])):  # fmt: skip
            step = decode_step_seconds(engine, loras, 6, ids)
            print(f"== {name}: eager decode step {step * 1e3:.2f} ms, "
                  f"{step * 1e3 / args.layers:.3f} ms per layer", flush=True)  # fmt: skip
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                decode_step_seconds(engine, loras, args.steps, ids)
                if cuda:
                    torch.cuda.synchronize()
            print(f"  (profiled run {time.perf_counter() - start:.2f} s)")
            table = prof.key_averages()
            print(
                table.table(
                    sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60
                )
            )
            if cuda:
                print(table.table(sort_by="self_cuda_time_total", row_limit=args.top // 2,
                              max_name_column_width=60))  # fmt: skip
            # the host's Python, Triton's launcher included (the profiler's table shows aten ops)
            python = cProfile.Profile()
            python.enable()
            decode_step_seconds(engine, loras, args.steps, ids)
            python.disable()
            pstats.Stats(python).sort_stats("tottime").print_stats(args.top)
    return 0


def prompts_for(rows: int, vocab: int) -> list[list[int]]:
    from engine_gpu import FULL

    return prompts(FULL, vocab, seed=3, count=rows)


if __name__ == "__main__":
    sys.exit(main())
