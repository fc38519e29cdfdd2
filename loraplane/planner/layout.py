"""Which layout of a base serves it cheapest on a GPU: `loraplane plan --recommend-layout`.

The layouts tried: the model in `--dtype` and with its projections in FP8, each on 1, 2, 4 or
8 GPUs (tensor parallelism within a node; the data plane splits FP8 weights as 16-bit ones,
their per-channel scales with their rows). Each is sized by the
engine's memory rule (`memory.plan_memory`, per rank), and fits when its weights leave room,
its KV cache holds one sequence of the longest length, and one adapter fits in its adapter
memory; otherwise the table says which of those failed.

Its speed is a saturated replica's, from the roofline (`cost.Roofline`, collectives
included): every step decodes as many rows as the KV cache holds whole sequences of prompt
plus output tokens (at most `max_num_seqs`, and at most what `max_num_batched_tokens` allows
with the prompts' prefill spread over the decode steps), over as many adapters as run at once.
Output tokens per second are those rows over the step's time. The inter-token latency shown
is a lone request's decode step (one row, one adapter): what a layout's steps cost when the
replica is not full. With a request rate, the replicas a layout needs come from the fleet
simulation (`search.replicas_needed` under the first of `--policies`, holding the p99 TTFT
target). The cheapest layout takes the fewest GPUs for the rate (for one replica without a
rate; a layout that meets the target before one that does not), then the most tokens per
second per GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraplane.dataplane.config import EngineConfig
from loraplane.planner.cost import GPUSpec, Roofline, StepShape
from loraplane.planner.memory import (
    AdapterProfile,
    MemoryPlan,
    check_quantized_split,
    plan_memory,
    weights_bytes,
)
from loraplane.planner.parallel import TP_SIZES, TensorParallelRefused, rank_shape
from loraplane.planner.shapes import ModelShape

FP8 = "fp8"


@dataclass(frozen=True, slots=True)
class Layout:
    """How one replica holds the base: over how many GPUs, and whether in FP8."""

    tensor_parallel_size: int = 1
    quantization: str | None = None

    def label(self, dtype: str) -> str:
        """e.g. "bfloat16, TP=2", "fp8, 1 GPU"."""
        form = self.quantization or dtype
        n = self.tensor_parallel_size
        return f"{form}, TP={n}" if n > 1 else f"{form}, 1 GPU"


LAYOUTS = tuple(Layout(n, form) for form in (None, FP8) for n in TP_SIZES)


@dataclass(frozen=True, slots=True)
class Throughput:
    """A saturated replica's steady decode on the roofline."""

    rows: int  # rows every step runs
    step_s: float
    tokens_per_s: float  # output tokens per second of one replica
    itl_s: float  # a lone request's decode step


@dataclass(frozen=True, slots=True)
class LayoutFit:
    """One layout's memory split and speed, or why it does not fit."""

    layout: Layout
    plan: MemoryPlan | None = None
    throughput: Throughput | None = None
    replicas: int | None = None  # for the request rate, when one is given (None: > max)
    why_not: str | None = None
    sized: bool = False  # replicas were searched for a rate

    @property
    def fits(self) -> bool:
        return self.why_not is None

    @property
    def gpus(self) -> int:
        """GPUs the layout takes: per replica, times the replicas the rate needs."""
        return (self.replicas or 1) * self.layout.tensor_parallel_size

    def rank(self) -> tuple[bool, int, float]:
        """Sort key, cheapest first."""
        return (self.sized and self.replicas is None, self.gpus, -self.tokens_per_s_per_gpu)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        if self.throughput is None:
            return 0.0
        return self.throughput.tokens_per_s / self.layout.tensor_parallel_size


def saturated_throughput(
    plan: MemoryPlan,
    config: EngineConfig,
    cost: Roofline,
    prompt_tokens: int,
    output_tokens: int,
    adapters: int,
) -> Throughput:
    """Output tokens per second of one replica kept full (see the module docstring)."""
    length = prompt_tokens + output_tokens
    prefill_per_row = prompt_tokens / output_tokens  # prompt tokens per decode step, per row
    rows = min(
        config.max_num_seqs,
        plan.kv_tokens // length,
        int(config.max_num_batched_tokens / (1 + prefill_per_row)),
    )
    rows = max(1, rows)
    prefill = rows * prefill_per_row
    context = rows * (prompt_tokens + output_tokens / 2)  # each row halfway through its output
    running = min(rows, plan.adapters_resident, adapters)
    step = StepShape(
        tokens=round(rows + prefill),
        seqs=rows,
        context=round(context),
        attention=round(context + prefill * prompt_tokens / 2),
        adapters=running,
        adapter_bytes=running * plan.adapter_device_bytes,
    )
    seconds = cost.step_seconds(step)
    lone = StepShape(tokens=1, seqs=1, context=round(prompt_tokens + output_tokens / 2),
                     attention=round(prompt_tokens + output_tokens / 2), adapters=1,
                     adapter_bytes=plan.adapter_device_bytes)  # fmt: skip
    return Throughput(rows, seconds, rows / seconds, cost.step_seconds(lone))


def fit_layout(
    layout: Layout,
    shape: ModelShape,
    make_config: Callable[[Layout], EngineConfig],
    gpu: GPUSpec,
    profile: AdapterProfile,
    reserved: int,
    prompt_tokens: int,
    output_tokens: int,
    replicas_for: Callable[[MemoryPlan, EngineConfig, Roofline], int | None] | None = None,
) -> LayoutFit:
    """`layout` of `shape` on `gpu`s (`make_config` gives its engine settings); with
    `replicas_for`, the replicas a load needs on it (None: more than the search tries)."""
    config = make_config(layout)
    n, dtype = layout.tensor_parallel_size, config.dtype
    try:
        local = rank_shape(shape, n)
        check_quantized_split(shape, n, layout.quantization)
        weights = weights_bytes(local, dtype, layout.quantization)
    except (TensorParallelRefused, ValueError) as e:  # a refused split (heads, groups, blocks)
        return LayoutFit(layout, why_not=str(e))
    usable = gpu.memory - reserved
    if weights >= usable:
        per = " per GPU" if n > 1 else ""
        return LayoutFit(layout, why_not=f"weights {weights / 1e9:.1f} GB{per} >"
                                         f" {usable / 1e9:.1f} GB of device memory")  # fmt: skip
    plan = plan_memory(shape, config, gpu.memory, profile, reserved, layout.quantization)
    max_len = config.max_model_len or shape.max_position_embeddings
    if plan.kv_tokens < max_len:
        why = f"KV cache {plan.kv_tokens:,} tokens < one sequence of {max_len:,}"
        return LayoutFit(layout, plan, why_not=why)
    if plan.adapters_resident < 1:
        why = (f"adapter memory {plan.lora_budget_bytes / 1e6:,.0f} MB < one adapter"
               f" ({plan.adapter_device_bytes / 1e6:,.0f} MB)")  # fmt: skip
        return LayoutFit(layout, plan, why_not=why)
    cost = Roofline(gpu, shape, dtype, profile, layout.quantization, tensor_parallel_size=n,
                    kv_cache_dtype=config.kv_cache_dtype)  # fmt: skip
    speed = saturated_throughput(plan, config, cost, prompt_tokens, output_tokens, profile.count)
    if replicas_for is None:
        return LayoutFit(layout, plan, speed)
    return LayoutFit(layout, plan, speed, replicas_for(plan, config, cost), sized=True)


def cheapest(fits: list[LayoutFit]) -> LayoutFit | None:
    """The layout that fits on the fewest GPUs, then with the most tokens/s per GPU."""
    return min((f for f in fits if f.fits), key=LayoutFit.rank, default=None)


def layout_table(fits: list[LayoutFit], dtype: str, rate: float | None) -> list[str]:
    """The layouts as text rows, cheapest first, those that do not fit after with why."""
    order = sorted((f for f in fits if f.fits), key=LayoutFit.rank)
    gpus = "GPUs for rate" if rate is not None else "GPUs"
    lines = [
        f"  {'layout':<16} {gpus:>13}  {'weights/GPU':>13} {'KV cache/GPU':>13}"
        f" {'adapters/GPU':>13} {'KV tokens':>10} {'running':>7} {'tokens/s/GPU':>12}"
        f" {'ITL':>8}"
    ]
    for f in order:
        p, t = f.plan, f.throughput
        assert p is not None
        assert t is not None
        count = "> max" if f.sized and f.replicas is None else str(f.gpus)
        lines.append(
            f"  {f.layout.label(dtype):<16} {count:>13}  {_gb(p.weights_bytes, p):>13}"
            f" {_gb(p.kv_cache_bytes, p):>13} {_gb(p.lora_budget_bytes, p):>13}"
            f" {p.kv_tokens:>10,} {p.adapters_resident:>7} {f.tokens_per_s_per_gpu:>12,.0f}"
            f" {t.itl_s * 1e3:>5.0f} ms"
        )
    for f in fits:
        if not f.fits:
            lines.append(f"  {f.layout.label(dtype):<16} {'-':>13}  does not fit: {f.why_not}")
    return lines


def _gb(nbytes: int, plan: MemoryPlan) -> str:
    return f"{nbytes / 1e9:.1f} GB {plan.share(nbytes):>3.0%}"


def fit_json(f: LayoutFit, dtype: str) -> dict[str, object]:
    """One layout for `--json`."""
    out: dict[str, object] = {
        "layout": f.layout.label(dtype),
        "tensor_parallel_size": f.layout.tensor_parallel_size,
        "quantization": f.layout.quantization,
        "fits": f.fits,
        "why_not": f.why_not,
    }
    if f.plan is not None:
        p = f.plan
        out |= {"weights_bytes_per_gpu": p.weights_bytes, "kv_cache_bytes_per_gpu":
                p.kv_cache_bytes, "lora_budget_bytes_per_gpu": p.lora_budget_bytes,
                "kv_tokens": p.kv_tokens, "adapters_resident": p.adapters_resident}  # fmt: skip
    if f.throughput is not None:
        t = f.throughput
        out |= {"gpus": None if f.sized and f.replicas is None else f.gpus,
                "replicas": f.replicas, "rows": t.rows, "step_s": t.step_s,
                "tokens_per_s": t.tokens_per_s, "tokens_per_s_per_gpu": f.tokens_per_s_per_gpu,
                "itl_s": t.itl_s}  # fmt: skip
    return out
