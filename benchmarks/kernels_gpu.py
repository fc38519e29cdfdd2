"""SGMV LoRA kernels on a GPU: ours against a gather + bmm baseline, the torch per-adapter loop,
and our own kernels over slots padded to the largest rank.

Shapes: hidden 4096 (in = out), bf16, ranks 8/16/64 in turn over the adapters; decode: 64 tokens
over 8, 32 and 64 adapters; prefill: 4096 tokens over 8 adapters.
Variants:
- pair: our shrink + expand (two launches, fp32 intermediate)
- fused: our fused kernel (one launch, intermediate kept on chip)
- gather: each token gathers its adapter's A and B padded to the max rank, then two bmm
- loop: sgmv_torch.lora_apply, one matmul pair per adapter in a Python loop
- padded: our pair over slots padded to the max rank (what rank-exactness saves)
Figures: microseconds per call (CUDA-graph replay, so launch overhead from Python is left out;
`pair_eager` is the same call without a graph) and GB/s = the rank-exact bytes of A, B, x and y
(y read and written) divided by the time, with its share of the H200's 4.8 TB/s. Each call
works on its own copy of the inputs and weights, rotating over enough copies to exceed the L2
cache, so weights come from memory as in serving.
Goals at the decode shapes: the better of pair/fused at least 2x the gather baseline and at
least 60% of memory bandwidth.
Run: python benchmarks/kernels_gpu.py (exits 0 with a message when there is no CUDA device)
(--smoke: every shape and variant, 2 copies of the inputs, 2 timed rounds)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _common import add_smoke_flag, cuda_time_us, goal, report

HIDDEN = 4096
RANKS = (8, 16, 64)
DTYPE = torch.bfloat16
PEAK_GBPS = 4800.0  # H200 HBM3e
SHAPES = {  # name -> (tokens, adapters)
    "decode8": (64, 8),
    "decode32": (64, 32),
    "decode64": (64, 64),
    "prefill8": (4096, 8),
}
ROTATE_BYTES = 256 * 2**20  # working set per variant: several times the 50 MB L2
VARIANTS = ("pair", "fused", "gather", "loop", "padded")


@dataclass
class Instance:
    """One independent copy of a shape's inputs and weights, in every layout a variant needs."""

    x: torch.Tensor  # [T, in]
    y: torch.Tensor  # [T, out]
    token_slots: torch.Tensor  # [T] int64 (every token uses an adapter)
    batch: Any  # LoRABatch
    lora_a: list[torch.Tensor | None]  # per slot [r, in], views of one buffer per slot
    lora_b: list[torch.Tensor | None]  # per slot [out, r]
    scales: torch.Tensor  # [L] fp32
    exact: Any  # SlotWeights at each slot's rank
    padded: Any  # SlotWeights over copies padded to the max rank
    a_pad: torch.Tensor  # [L, R, in]
    b_pad: torch.Tensor  # [L, out, R]


def useful_bytes(tokens: int, ranks: list[int]) -> int:
    """Bytes a rank-exact implementation must move: A, B, x, and y read and written."""
    weights = sum(r * HIDDEN * 2 for r in ranks)
    return (weights + tokens * HIDDEN * 3) * torch.empty(0, dtype=DTYPE).element_size()


def build(tokens: int, adapters: int, seed: int, device: str = "cuda") -> Instance:
    from loraplane.dataplane.kernels.sgmv_triton import SlotWeights
    from loraplane.dataplane.lora import LoRABatch

    dev = torch.empty(0, device=device).device
    ranks = [RANKS[k % len(RANKS)] for k in range(adapters)]
    rmax = max(ranks)
    gen = torch.Generator(device=dev).manual_seed(seed)
    lora_a: list[torch.Tensor | None] = []
    lora_b: list[torch.Tensor | None] = []
    a_pad = torch.zeros(adapters, rmax, HIDDEN, dtype=DTYPE, device=dev)
    b_pad = torch.zeros(adapters, HIDDEN, rmax, dtype=DTYPE, device=dev)
    for k, r in enumerate(ranks):
        buffer = torch.empty(2 * r * HIDDEN, dtype=DTYPE, device=dev)  # like the pool's slots
        a, b = buffer[: r * HIDDEN].view(r, HIDDEN), buffer[r * HIDDEN :].view(HIDDEN, r)
        a.copy_(torch.randn(r, HIDDEN, generator=gen, device=dev) / HIDDEN**0.5)
        b.copy_(torch.randn(HIDDEN, r, generator=gen, device=dev) / r**0.5)
        a_pad[k, :r], b_pad[k, :, :r] = a, b
        lora_a.append(a)
        lora_b.append(b)
    order = [k % adapters for k in range(tokens)]
    random.Random(seed).shuffle(order)
    token_slots = torch.tensor(order, dtype=torch.int64, device=dev)
    return Instance(
        x=torch.randn(tokens, HIDDEN, generator=gen, device=dev).to(DTYPE),
        y=torch.randn(tokens, HIDDEN, generator=gen, device=dev).to(DTYPE),
        token_slots=token_slots,
        batch=LoRABatch.from_token_slots(order, device=dev),
        lora_a=lora_a,
        lora_b=lora_b,
        scales=torch.full((adapters,), 2.0, device=dev),
        exact=SlotWeights.build(lora_a, lora_b, DTYPE, dev),
        padded=SlotWeights.build(list(a_pad), list(b_pad), DTYPE, dev),
        a_pad=a_pad,
        b_pad=b_pad,
    )


def call(variant: str, inst: Instance) -> Callable[[], object]:
    """A no-argument function running `variant` once on `inst` (y accumulates in place)."""
    from loraplane.dataplane.kernels import sgmv_torch, sgmv_triton

    b = inst.batch
    bounds = b.seg_bounds
    max_seg_len = max(e - s for s, e in itertools.pairwise(bounds))
    segs = (b.token_order, b.seg_slots_t, b.seg_bounds_t)
    if variant in ("pair", "fused", "padded"):
        weights = inst.padded if variant == "padded" else inst.exact
        fused = variant == "fused"
        return lambda: sgmv_triton.lora_apply(
            inst.y, inst.x, *segs, weights, inst.scales, max_seg_len, fused=fused
        )
    if variant == "loop":
        return lambda: sgmv_torch.lora_apply(
            inst.y,
            inst.x,
            b.token_order,
            b.seg_slots,
            bounds,
            inst.lora_a,
            inst.lora_b,
            inst.scales,
        )

    def gather() -> None:
        a = inst.a_pad[inst.token_slots]  # [T, R, in]
        h = torch.bmm(a, inst.x.unsqueeze(-1))  # [T, R, 1]
        bt = inst.b_pad[inst.token_slots]  # [T, out, R]
        delta = torch.bmm(bt, h).squeeze(-1) * inst.scales[inst.token_slots].unsqueeze(-1)
        inst.y.add_(delta.to(DTYPE))

    return gather


def time_us(fns: list[Callable[[], object]], iters: int, graph: bool) -> float:
    """Mean microseconds per call of fns (one call per instance per round), CUDA-event timed."""
    for fn in fns:  # compile and warm up outside any capture
        fn()

    def round_() -> None:
        for fn in fns:
            fn()

    return cuda_time_us(round_, iters, graph) / len(fns)


def check(inst: Instance) -> float:
    """Largest |pair - loop| on one fresh y: a sanity check of the kernels on this GPU."""
    y0 = inst.y.clone()
    call("pair", inst)()
    got = inst.y.clone()
    inst.y.copy_(y0)
    call("loop", inst)()
    diff = (got.float() - inst.y.float()).abs().max().item()
    inst.y.copy_(y0)
    return float(diff)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="timed rounds per variant")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset")
    add_smoke_flag(parser)
    args = parser.parse_args()
    rounds = 2 if args.smoke else args.iters
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device: skipped")
        return 0
    if importlib.util.find_spec("triton") is None:
        print("kernels_gpu: triton is not installed: skipped")
        return 0
    print(f"kernels_gpu on {torch.cuda.get_device_name()}")
    figures: dict[str, float] = {}
    goals: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        tokens, adapters = SHAPES[name]
        ranks = [RANKS[k % len(RANKS)] for k in range(adapters)]
        nbytes = useful_bytes(tokens, ranks)
        copies = max(2, min(32, -(-ROTATE_BYTES // nbytes)))  # rotate past the L2
        if args.smoke:
            copies = 2
        insts = [build(tokens, adapters, seed) for seed in range(copies)]
        figures[f"{name}.max_abs_diff_vs_loop"] = check(insts[0])
        for variant in VARIANTS:
            fns = [call(variant, inst) for inst in insts]
            iters = max(2, rounds // 4) if name.startswith("prefill") else rounds
            if variant == "gather" and name.startswith("prefill"):
                fns = fns[:2]  # its per-call temporaries are GBs at prefill
            us = time_us(fns, iters, graph=True)
            figures[f"{name}.{variant}.us"] = us
            figures[f"{name}.{variant}.GBps"] = nbytes / us / 1e3
            print(f"  {name:<9} {variant:<7} {us:10.1f} us  {nbytes / us / 1e3:8.0f} GB/s")
        figures[f"{name}.pair_eager.us"] = time_us(
            [call("pair", inst) for inst in insts], rounds, graph=False
        )
        best = min(figures[f"{name}.pair.us"], figures[f"{name}.fused.us"])
        figures[f"{name}.best.bw_share"] = nbytes / best / 1e3 / PEAK_GBPS
        figures[f"{name}.best.speedup_vs_gather"] = figures[f"{name}.gather.us"] / best
        figures[f"{name}.best.speedup_vs_loop"] = figures[f"{name}.loop.us"] / best
        figures[f"{name}.padded_over_exact"] = (
            figures[f"{name}.padded.us"] / figures[f"{name}.pair.us"]
        )
        if name.startswith("decode"):
            goals.append(goal(figures, f"{name}.best.speedup_vs_gather", ">=", 2.0))
            goals.append(goal(figures, f"{name}.best.bw_share", ">=", 0.6))
        del insts
        torch.cuda.empty_cache()
    return report("kernels_gpu", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
