"""The CPU LoRA path over many adapters: B stored transposed against B as it is in the file.

One step's LoRA work (q_proj and v_proj of every layer of the benchmark model, rank-16 fp16
adapters in fp32 slots, through `sgmv_torch.lora_apply_grouped`, one torch thread) over 42
distinct adapters, the number a 64-request Zipf(1.0) step over 2,000 adapters touches: a
decode step (1-2 tokens per adapter) and a step that mixes prompts and decodes. Each layout
runs twice, alternating, with caches flushed before each pass (the adapters of a step are read
from memory, not from cache); a figure is the best pass, in microseconds per layer.

Goal: the transposed layout (`LoRAPool(b_transposed=True)`, the CPU default) takes at most
0.95 of the plain layout's time on both steps.

Run: .venv/bin/python benchmarks/lora_cpu.py [--adapters 42] [--passes 7]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from _common import add_smoke_flag, goal, report
from engine_cpu import shape

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.kernels import sgmv_torch
from loraplane.dataplane.lora import LoadedAdapter, LoRAPool, LoRAWeights

MODULES = ("q_proj", "v_proj")


def model_spec(smoke: bool) -> BaseModelSpec:
    s = shape(smoke)
    heads = s["num_attention_heads"]
    return BaseModelSpec("bench", "llama", s["num_hidden_layers"], s["hidden_size"],
                         s["intermediate_size"], heads, s["num_key_value_heads"],
                         s["hidden_size"] // heads)  # fmt: skip


def adapter(spec: BaseModelSpec, seed: int, rank: int = 16) -> LoadedAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(spec.num_layers):
        for module in MODULES:
            fan_in, fan_out = spec.module_shape(module)
            a = torch.randn(rank, fan_in, generator=g).half()
            b = torch.randn(fan_out, rank, generator=g).half()
            weights[(layer, module)] = LoRAWeights(a, b, 2.0)
    return LoadedAdapter(f"a{seed}", weights)


def step_seconds(spec: BaseModelSpec, adapters: list[LoadedAdapter], lengths: list[int],
                 transposed: bool, passes: int) -> float:  # fmt: skip
    """Best pass's seconds per layer of one step whose segment s has lengths[s] tokens."""
    pool = LoRAPool(len(adapters), spec, torch.float32, "cpu", b_transposed=transposed)
    for slot, a in enumerate(adapters):
        pool.load(slot, pool.host_form(a))
    tables = [pool.module_slots(layer, m) for layer in range(spec.num_layers) for m in MODULES]
    n = sum(lengths)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    token_slots = torch.tensor([s for s, length in enumerate(lengths) for _ in range(length)])
    seg_slots = list(range(len(lengths)))
    x = torch.randn(n, spec.hidden_size)
    flush = torch.empty(64 << 18)  # 64 MiB, more than the L2 caches
    best = float("inf")
    for _ in range(passes):
        flush.add_(1.0)
        start = time.perf_counter()
        for t in tables:
            b = t.lora_b[0]
            assert b is not None
            y = torch.zeros(n, b.shape[0])
            sgmv_torch.lora_apply_grouped(y, x, order, token_slots, seg_slots, bounds,
                                          t.lora_a, t.lora_b, t.scales, t.checked)  # fmt: skip
        best = min(best, time.perf_counter() - start)
    return best / spec.num_layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=42)
    parser.add_argument("--passes", type=int, default=7)
    add_smoke_flag(parser)
    args = parser.parse_args()
    count, passes = (4, 1) if args.smoke else (args.adapters, args.passes)
    torch.set_num_threads(1)
    spec = model_spec(args.smoke)
    print(f"{count} rank-16 q/v adapters of a {spec.num_layers}-layer model ...", flush=True)
    adapters = [adapter(spec, i) for i in range(count)]
    rng = random.Random(0)
    steps = {
        "decode": [rng.choice((1, 1, 2)) for _ in range(count)],
        "mixed": [rng.choice((1, 1, 1, 2, 2, 3, 17, 18)) for _ in range(count)],
    }
    figures: dict[str, float] = {}
    for label, lengths in steps.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for transposed in (False, True, False, True):
            times[transposed].append(step_seconds(spec, adapters, lengths, transposed, passes))
        plain, trans = min(times[False]), min(times[True])
        figures[f"{label}_tokens"] = float(sum(lengths))
        figures[f"{label}_plain_us_per_layer"] = plain * 1e6
        figures[f"{label}_transposed_us_per_layer"] = trans * 1e6
        figures[f"{label}_transposed_over_plain"] = trans / plain
    goals = [goal(figures, f"{label}_transposed_over_plain", "<=", 0.95) for label in steps]
    return report("lora_cpu", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
