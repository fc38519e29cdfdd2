"""Paged attention on a GPU: the Triton kernel against the torch path it replaces, and against
the HBM roofline.

Heads: Llama-3-8B (32 query heads over 8 KV heads, head_dim 128), bf16, block_size 16, block
tables drawn from a shuffled pool (as the block manager hands blocks out).
Shapes (sequences x context):
- decode64: 64 decodes at 2048 tokens (the goal's shape); decode64_w1k: the same with a
  1024-token sliding window (each decode reads half)
- decode8_8k: 8 decodes at 8192; decode1_32k: 1 decode at 32768 (few (sequence, KV head)
  programs: the split-KV shapes)
- mixed: 60 decodes at 2048 and 4 prefill chunks of 256 tokens over 1792 cached ones
Variants:
- triton: the kernel (launcher call, CUDA-graph replay: Python launch overhead left out)
- triton_eager: the same without a graph
- torch: attention.torch_attention, the path CUDA took before (decodes: each sequence's blocks
  gathered into a padded tensor + one SDPA; prefill: an SDPA per sequence), eager
(write_kv, the same for both, is left out.)
Figures per shape: microseconds per call; GB/s = the bytes attention must move (each
sequence's K and V once, within its window; q read and out written) / time, and its share
of the H200's 4.8 TB/s; speedup over torch; the largest |triton - torch| (bf16). For decode64
a small sweep of kernel configs (tile, splits, warps, stages) gives the best time and its
config, to tune `default_config` from.
Goals at decode64: triton >= 60% of HBM bandwidth, and faster than the torch path.
FP8 KV cache (--kv-cache-dtype fp8, kv_quant.py), at decode64 without goals yet: the kernel over
the same K/V in float8 e4m3 (scales 0.5; half the cache bytes to read), its time, GB/s (of the
bytes it moves), speedup over the bf16 cache, and its largest |triton - torch| over that cache.
Run: python benchmarks/attention_gpu.py (exits 0 with a message when there is no CUDA device)
(--smoke: 4-sequence shapes, 2 timed rounds, one sweep entry; --device cpu: the smoke shapes
in fp32 through Triton's interpreter, one timed call each, to check the script itself on a
machine without CUDA)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _common import add_smoke_flag, cuda_time_us, goal, gpu_goal, report

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PEAK_GBPS = 4800.0  # H200 HBM3e
FP8_SCALE = 0.5  # the FP8 variant's K and V scale (any scale costs the kernel the same)
# name -> (rows: (q_len, context_len) per sequence, sliding window)
Shape = tuple[list[tuple[int, int]], int | None]
SHAPES: dict[str, Shape] = {
    "decode64": ([(1, 2048)] * 64, None),
    "decode64_w1k": ([(1, 2048)] * 64, 1024),
    "decode8_8k": ([(1, 8192)] * 8, None),
    "decode1_32k": ([(1, 32768)], None),
    "mixed": ([(1, 2048)] * 60 + [(256, 2048)] * 4, None),
}
SMOKE_SHAPES: dict[str, Shape] = {
    "decode64": ([(1, 200)] * 4, None),
    "decode64_w1k": ([(1, 200)] * 4, 64),
    "decode1_32k": ([(1, 700)], None),
    "mixed": ([(1, 100)] * 3 + [(40, 100)], None),
}
SWEEP = [  # (tile_n, num_splits, num_warps, num_stages) at decode64; block_m from the default
    (64, 1, 4, 2),
    (32, 1, 4, 2),
    (128, 1, 4, 2),
    (64, 1, 4, 3),
    (64, 1, 8, 2),
    (64, 2, 4, 2),
    (128, 2, 8, 3),
]


@dataclass
class Case:
    """One shape's inputs on the device: new tokens, a filled paged cache, the metadata."""

    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, KV, D]
    v_cache: torch.Tensor
    meta: Any  # AttentionMetadata
    window: int | None
    useful_bytes: int
    kv_elements: int  # K and V values attention reads (the cache's share of useful_bytes)


def build(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Case:
    from loraplane.dataplane.attention import AttentionMetadata

    rows, window = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-ctx // BLOCK_SIZE) for _, ctx in rows]
    pool = list(range(sum(need)))
    random.Random(seed).shuffle(pool)
    tables = []
    for n in need:
        tables.append(pool[:n])
        pool = pool[n:]
    blocks, tokens = sum(need), sum(q for q, _ in rows)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    q_lens, ctx_lens = [q for q, _ in rows], [c for _, c in rows]
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, BLOCK_SIZE, device)
    item = torch.empty(0, dtype=dtype).element_size()
    kv_read = sum(min(c, c if window is None else q - 1 + window) for q, c in rows)
    useful = (kv_read * KV_HEADS * HEAD_DIM * 2 + tokens * HEADS * HEAD_DIM * 2) * item
    return Case(
        q=rand(tokens, HEADS, HEAD_DIM),
        k_cache=rand(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        v_cache=rand(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        meta=meta,
        window=window,
        useful_bytes=useful,
        kv_elements=kv_read * KV_HEADS * HEAD_DIM * 2,
    )


def fp8_case(case: Case) -> Case:
    """The same case over an FP8 cache (K and V quantized with scale FP8_SCALE)."""
    from loraplane.dataplane import kv_quant

    k8 = kv_quant.quantize(case.k_cache, FP8_SCALE)
    v8 = kv_quant.quantize(case.v_cache, FP8_SCALE)
    saved = case.kv_elements * (case.k_cache.element_size() - 1)
    return dataclasses.replace(case, k_cache=k8, v_cache=v8,
                               useful_bytes=case.useful_bytes - saved)  # fmt: skip


def torch_path(case: Case, kv_scale: float = 1.0) -> Callable[[], torch.Tensor]:
    from loraplane.dataplane.attention import torch_attention

    def run() -> torch.Tensor:
        return torch_attention(
            case.q, case.k_cache, case.v_cache, case.meta, HEAD_DIM**-0.5, case.window,
            None, kv_scale, kv_scale,
        )  # fmt: skip

    return run


def triton_path(
    case: Case, config: Any = None, kv_scale: float = 1.0
) -> Callable[[], torch.Tensor]:
    from loraplane.dataplane.kernels import attention_triton

    def run() -> torch.Tensor:
        return attention_triton.paged_attention(
            case.q, case.k_cache, case.v_cache, case.meta, HEAD_DIM**-0.5, case.window, config,
            None, kv_scale, kv_scale,
        )  # fmt: skip

    return run


def time_us(fn: Callable[[], object], iters: int, graph: bool, device: torch.device) -> float:
    """Mean microseconds per call: CUDA events (a CUDA graph's replays when `graph`), or the
    wall clock on CPU (no warm-up there: the interpreter compiles nothing, and each of its
    calls takes about a second)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e6 / iters
    fn()  # compile and warm up outside any capture
    return cuda_time_us(fn, iters, graph)


def sweep(case: Case, iters: int, smoke: bool, device: torch.device) -> dict[str, float]:
    """The kernel at decode64 over a few configs: the best time, and which config it was."""
    from loraplane.dataplane.kernels import attention_triton as at

    base = at.default_config(case.meta, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, device)
    best, best_index = float("inf"), 0
    for i, (tile_n, splits, warps, stages) in enumerate(SWEEP[:1] if smoke else SWEEP):
        cfg = at.AttentionConfig(block_m=base.block_m, tile_n=tile_n, num_splits=splits,
                                 num_warps=warps, num_stages=stages)  # fmt: skip
        us = time_us(triton_path(case, cfg), iters, graph=device.type == "cuda", device=device)
        print(f"  sweep tile_n={tile_n:<3} splits={splits} warps={warps} stages={stages}: "
              f"{us:9.1f} us  {case.useful_bytes / us / 1e3:7.0f} GB/s")  # fmt: skip
        if us < best:
            best, best_index = us, i
    tile_n, splits, warps, stages = SWEEP[best_index]
    return {
        "decode64.sweep_best.us": best,
        "decode64.sweep_best.bw_share": case.useful_bytes / best / 1e3 / PEAK_GBPS,
        "decode64.sweep_best.tile_n": tile_n,
        "decode64.sweep_best.num_splits": splits,
        "decode64.sweep_best.num_warps": warps,
        "decode64.sweep_best.num_stages": stages,
    }


def fp8_figures(case: Case, bf16_us: float, iters: int, device: torch.device) -> dict[str, float]:
    """The kernel over an FP8 cache holding the same K/V: time, bandwidth, speedup, error."""
    fp8 = fp8_case(case)
    want, got = torch_path(fp8, FP8_SCALE)(), triton_path(fp8, None, FP8_SCALE)()
    us = time_us(triton_path(fp8, None, FP8_SCALE), iters, device.type == "cuda", device)
    gbps = fp8.useful_bytes / us / 1e3
    print(f"  {'decode64':<13} {'triton_fp8':<13} {us:10.1f} us  {gbps:8.0f} GB/s")
    return {
        "decode64.triton_fp8.us": us,
        "decode64.triton_fp8.GBps": gbps,
        "decode64.triton_fp8.bw_share": gbps / PEAK_GBPS,
        "decode64.fp8_speedup_vs_bf16_cache": bf16_us / us,
        "decode64.fp8_max_abs_diff_vs_torch": float((got - want).abs().max()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per variant")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attention_gpu: needs a CUDA device (none here): skipped")
        return 0
    if args.device == "cpu":  # before Triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.smoke = True
    if importlib.util.find_spec("triton") is None:
        print("attention_gpu: triton is not installed: skipped")
        return 0
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    iters = (2 if device.type == "cuda" else 1) if args.smoke else args.iters
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"attention_gpu on {name}, {dtype}")
    figures: dict[str, float] = {}
    goals: list[dict[str, Any]] = []
    for shape_name, shape in shapes.items():
        case = build(shape, dtype, device)
        want, got = torch_path(case)(), triton_path(case)()
        figures[f"{shape_name}.max_abs_diff_vs_torch"] = float((got - want).abs().max())
        on_gpu = device.type == "cuda"
        triton_us = time_us(triton_path(case), iters, on_gpu, device)
        timings = {
            "triton": triton_us,
            # without CUDA there is no graph: the eager call is the one just timed
            "triton_eager": (
                time_us(triton_path(case), iters, False, device) if on_gpu else triton_us
            ),
            "torch": time_us(torch_path(case), max(2, iters // 5), False, device),
        }
        for variant, us in timings.items():
            gbps = case.useful_bytes / us / 1e3
            figures[f"{shape_name}.{variant}.us"] = us
            figures[f"{shape_name}.{variant}.GBps"] = gbps
            print(f"  {shape_name:<13} {variant:<13} {us:10.1f} us  {gbps:8.0f} GB/s")
        figures[f"{shape_name}.triton.bw_share"] = (
            case.useful_bytes / timings["triton"] / 1e3 / PEAK_GBPS
        )
        figures[f"{shape_name}.speedup_vs_torch"] = timings["torch"] / timings["triton"]
        if shape_name == "decode64":
            figures.update(sweep(case, iters, args.smoke, device))
            # on_gpu: the CPU path interprets Triton, with no speed to judge
            goals.append(gpu_goal(figures, "decode64.triton.bw_share", ">=", 0.6, on_gpu))
            goals.append(gpu_goal(figures, "decode64.speedup_vs_torch", ">=", 1.0, on_gpu))
            goals.append(goal(figures, "decode64.max_abs_diff_vs_torch", "<=", 0.05))
            figures.update(fp8_figures(case, timings["triton"], iters, device))
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report("attention_gpu", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
