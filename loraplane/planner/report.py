"""What `loraplane plan` works out and prints: `run_plan(args)` -> `PlanReport`."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplane.adapters import base_model
from loraplane.dataplane.config import EngineConfig
from loraplane.planner.cost import (
    GPUS,
    ROOFLINE_CONFIDENCE,
    CostModel,
    GPUSpec,
    LinearCost,
    Roofline,
)
from loraplane.planner.fleet import FleetResult, Workload
from loraplane.planner.layout import (
    LAYOUTS,
    Layout,
    LayoutFit,
    cheapest,
    fit_json,
    fit_layout,
    layout_table,
)
from loraplane.planner.memory import AdapterProfile, MemoryPlan, plan_memory, weights_bytes
from loraplane.planner.parallel import TP_SIZES
from loraplane.planner.replica import ReplicaSettings
from loraplane.planner.routing import POLICIES, make_policy
from loraplane.planner.search import replicas_needed
from loraplane.planner.shapes import ModelShape, named_shape


class PlanError(ValueError):
    """Inputs the planner cannot work with (the message says which)."""


@dataclass(slots=True)
class PlanReport:
    """The plan: inputs, memory split, and per policy the replicas needed."""

    shape: ModelShape
    config: EngineConfig
    profile: AdapterProfile
    plan: MemoryPlan
    cost: CostModel
    load: Workload | None
    ttft_p99_s: float
    needed: dict[str, int | None] = field(default_factory=dict)
    results: dict[str, dict[int, FleetResult]] = field(default_factory=dict)
    plot: str | None = None
    layouts: list[LayoutFit] = field(default_factory=list)  # --recommend-layout's table
    layout_note: str = ""  # why the layouts were compared unasked
    quantization: str | None = None  # the weights' form: config's, or "int4" (a checkpoint's)

    def to_json(self) -> dict[str, Any]:
        """The JSON object `--json` prints."""
        plan = self.plan
        out: dict[str, Any] = {
            "model": self.shape.as_dict() | {"params": self.shape.num_params()},
            "dtype": self.config.dtype,
            "quantization": self.quantization,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "device": self.config.device,
            "memory": dataclasses.asdict(plan)
            | {"kv_tokens": plan.kv_tokens, "host_copies": plan.host_copies},
            "adapter_bytes": plan.adapter_bytes,
            "adapter_device_bytes": plan.adapter_device_bytes,
            "kv_bytes_per_token": plan.kv_bytes_per_token,
            "adapters_resident": plan.adapters_resident,
            "adapters_unpinned": plan.adapters_unpinned,
            "host_tier_bytes": plan.host_tier_bytes,
            "disk_tier_bytes": plan.disk_tier_bytes,
            "adapters": dataclasses.asdict(self.profile),
            "cost": self.cost.describe(),
        }
        if self.layouts:
            out["layouts"] = [fit_json(f, self.config.dtype) for f in self.layouts]
            out["recommended_layout"] = Layout(
                self.config.tensor_parallel_size, self.quantization
            ).label(self.config.dtype)
        if self.load is not None:
            load = dataclasses.asdict(self.load)
            out["gpus"] = {
                policy: None if n is None else n * plan.devices for policy, n in self.needed.items()
            }
            out["workload"] = load
            out["ttft_p99_target_s"] = self.ttft_p99_s
            out["replicas"] = dict(self.needed)
            out["results"] = {
                policy: _result_json(self.results[policy][n]) if n is not None else None
                for policy, n in self.needed.items()
            }
        if self.plot:
            out["plot"] = self.plot
        return out

    def text(self) -> str:
        """The human-readable report."""
        s, plan, cfg = self.shape, self.plan, self.config
        gb = 1e9
        lines = []
        if self.layouts:
            if self.layout_note:
                lines.append(self.layout_note)
            lines.append(
                f"layouts on {_gpu_name(self.cost)} ({plan.device_memory / gb:.1f} GB each),"
                f" {self.profile.count:,} adapters of rank {self.profile.rank}; cheapest first:"
            )
            rate = self.load.rate if self.load is not None else None
            lines += layout_table(self.layouts, cfg.dtype, rate)
            label = Layout(cfg.tensor_parallel_size, self.quantization).label(cfg.dtype)
            lines.append(f"recommended: {label}; its plan follows")
        lines += [
            f"model {s.name} ({s.model_type}, {s.num_layers} layers, hidden {s.hidden_size},"
            f" {s.num_params() / 1e9:.2f} B parameters) in {cfg.dtype}"
            f"{f', {self.quantization} weights' if self.quantization else ''} on {cfg.device},"
            f" {plan.device_memory / gb:.1f} GB of device memory"
            f"{f'; tensor-parallel over {plan.devices} GPUs' if plan.devices > 1 else ''}",
            *_memory_lines(plan, cfg, s),
            f"adapters: {self.profile.count:,} of rank {self.profile.rank} on"
            f" {_modules(self.profile.modules)}, {plan.adapter_full_bytes / 1e6:.1f} MB each"
            f" ({plan.adapter_device_bytes / 1e6:.1f} MB on "
            f"{'the device' if plan.devices == 1 else 'each GPU: its slices'})",
            f"  running at once  {plan.adapters_resident:,} per replica (of"
            f" {plan.lora_slots} slots)",
            *_pinned_lines(plan),
            f"  host tier        {min(plan.host_copies, self.profile.count):,} adapters,"
            f" {plan.host_tier_bytes / gb:.1f} GB (max_cpu_loras {plan.max_cpu_loras}"
            f"{_host_limit(plan)}"
            f"{'; rank 0 holds the slices of every rank' if plan.devices > 1 else ''})",
            f"  disk tier        {self.profile.count:,} adapters,"
            f" {plan.disk_tier_bytes / gb:.1f} GB",
            f"cost model: {_describe_cost(self.cost)}",
        ]
        if self.cost.describe()["kind"] == "roofline":
            lines.append(f"confidence: {ROOFLINE_CONFIDENCE}")
        if self.load is None:
            lines.append("(give --rate to size the fleet for a load)")
            return "\n".join(lines)
        load = self.load
        lines += [
            f"load: {load.rate:g} requests/s, prompt {load.prompt_tokens} and output"
            f" {load.output_tokens} tokens (+-{load.spread:.0%}), {load.popularity};"
            f" target p99 TTFT {self.ttft_p99_s:g} s",
            f"  {'policy':<14} {'replicas':>8} {'p99 TTFT':>9} {'p50 TTFT':>9}"
            f" {'tokens/s':>10} {'cold loads/s':>12}{'   GPUs' if plan.devices > 1 else ''}",
        ]
        span = load.duration_s
        for policy, n in self.needed.items():
            if n is None:
                lines.append(f"  {policy:<14} {'> max':>8}")
                continue
            r = self.results[policy][n]
            lines.append(
                f"  {policy:<14} {n:>8} {r.ttft_p99_s:>8.3f}s {r.ttft_p50_s:>8.3f}s"
                f" {r.tokens_per_s:>10,.0f} {r.cold_loads / span:>12.1f}"
                f"{f' {n * plan.devices:>6}' if plan.devices > 1 else ''}"
            )
        if self.plot:
            lines.append(f"plot: {self.plot}")
        return "\n".join(lines)


def _result_json(r: FleetResult) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(r).items() if k != "ttft_s"}


def _lora_memory(value: int | float) -> str:
    return f"{value:g}" if isinstance(value, float) else f"{value / 1e9:.2f} GB"


def _memory_lines(plan: MemoryPlan, cfg: EngineConfig, shape: ModelShape) -> list[str]:
    """The memory split: of the replica's one device, or of each of its GPUs."""
    gb, n = 1e9, plan.devices
    split = f"  ({plan.model_weights_bytes / gb:.2f} GB in all, split {n} ways)" if n > 1 else ""
    heads = f" on each GPU, {_kv_heads(shape, n)}" if n > 1 else ""
    return [
        "memory per replica:" if n == 1 else f"memory per GPU (each of the replica's {n}):",
        f"  weights          {plan.weights_bytes / gb:8.2f} GB"
        f"{_share(plan, plan.weights_bytes)}{split}",
        f"  KV cache         {plan.kv_cache_bytes / gb:8.2f} GB"
        f"{_share(plan, plan.kv_cache_bytes)}  ({plan.kv_blocks:,} blocks of"
        f" {cfg.block_size} tokens = {plan.kv_tokens:,} tokens;"
        f" {plan.kv_bytes_per_token / 1024:.0f} KiB per token{heads})",
        f"  adapter memory   {plan.lora_budget_bytes / gb:8.2f} GB"
        f"{_share(plan, plan.lora_budget_bytes)}  (--lora-memory"
        f" {_lora_memory(cfg.lora_memory)} of {plan.free_bytes / gb:.2f} GB free"
        f"{'; inside the KV cache' if plan.kv_lora_shared else ''})",
    ]


def _share(plan: MemoryPlan, nbytes: int) -> str:
    return f" {plan.share(nbytes):>4.0%}"


def _kv_heads(shape: ModelShape, n: int) -> str:
    local = max(1, shape.num_kv_heads // n)
    if shape.num_kv_heads >= n:
        return f"{local} of {shape.num_kv_heads} KV heads"
    return f"1 of {shape.num_kv_heads} KV heads, each held by {n // shape.num_kv_heads} GPUs"


def _gpu_name(cost: CostModel) -> str:
    name: str = cost.describe().get("gpu", {}).get("name", "the device")
    return name


def _describe_cost(cost: CostModel) -> str:
    d = cost.describe()
    if d["kind"] == "roofline":
        g = d["gpu"]
        text = (
            f"roofline of {g['name']} ({g['bandwidth'] / 1e9:,.0f} GB/s at"
            f" {d['bandwidth_efficiency']:.0%}, {g['flops'] / 1e12:,.0f} TFLOPS at"
            f" {d['flops_efficiency']:.0%}, PCIe {g['pcie'] / 1e9:.0f} GB/s)"
        )
        n = d.get("tensor_parallel_size", 1)
        if n > 1:
            text += (
                f"; per step per GPU its shard, then 2 all-reduces per layer and one of the"
                f" embedding (ring: 2({n}-1)/{n} of [tokens, hidden]) and an all-gather of the"
                f" logits over {g['interconnect'] / 1e9:,.0f} GB/s at"
                f" {d['interconnect_efficiency']:.0%} + {g['collective_latency'] * 1e6:g} us"
                " each (assumed, not measured on a GPU yet; no CUDA graphs under tensor"
                " parallelism, which the roofline does not charge)"
            )
        return text
    return f"calibrated on {d.get('measured_on') or 'this machine'} ({d.get('model', '')})"


def _shape(args: argparse.Namespace) -> ModelShape:
    try:
        if args.model:
            return ModelShape.from_dir(args.model)
        return named_shape(args.model_shape)
    except ValueError as e:  # BaseModelError is a ValueError
        raise PlanError(str(e)) from e


def _gpu(args: argparse.Namespace) -> GPUSpec:
    base = GPUS[args.gpu]
    flags = (args.device_memory, args.device_bandwidth, args.device_flops, args.pcie,
             args.interconnect)  # fmt: skip
    return GPUSpec(
        name=base.name if all(f is None for f in flags) else f"{base.name} as adjusted",
        memory=args.device_memory or base.memory,
        bandwidth=args.device_bandwidth * 1e9 if args.device_bandwidth else base.bandwidth,
        flops=args.device_flops * 1e12 if args.device_flops else base.flops,
        pcie=args.pcie * 1e9 if args.pcie else base.pcie,
        interconnect=args.interconnect * 1e9 if args.interconnect else base.interconnect,
        collective_latency=base.collective_latency,
    )


def _cost(args: argparse.Namespace, shape: ModelShape, profile: AdapterProfile,
          gpu: GPUSpec, config: EngineConfig, quantization: str | None) -> CostModel:  # fmt: skip
    if args.calibrate:
        return _calibrate(args, profile, config)
    if args.cost:
        try:
            return LinearCost.load(args.cost)
        except ValueError as e:
            raise PlanError(str(e)) from e
    return Roofline(gpu, shape, args.dtype, profile, quantization,
                    tensor_parallel_size=config.tensor_parallel_size,
                    kv_cache_dtype=config.kv_cache_dtype)  # fmt: skip


def _calibrate(args: argparse.Namespace, profile: AdapterProfile,
               config: EngineConfig) -> LinearCost:  # fmt: skip
    import tempfile
    from pathlib import Path

    from loraplane.planner.calibrate import BATCHES, LOAD_SAMPLES, calibrate
    from loraplane.planner.measure import build_bench

    if not args.model:
        raise PlanError("--calibrate measures the engine on a real model: give --model DIR")
    root = Path(tempfile.mkdtemp(prefix="loraplane-plan-"))
    try:
        need = max(n for _, n, _, _ in BATCHES) + LOAD_SAMPLES
        bench = build_bench(root, need, profile.rank, profile.modules, model=Path(args.model))
        cost = calibrate(bench, machine=_machine(), device=config.device, dtype=config.dtype)
    except (ValueError, RuntimeError, OSError) as e:
        raise PlanError(f"calibration failed: {e}") from e
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.cost:
        cost.save(args.cost)
    return cost


def _machine() -> str:
    import os
    import platform

    return f"{os.cpu_count()} cores {platform.machine()}, Python {platform.python_version()}"


def _pinned_lines(plan: MemoryPlan) -> list[str]:
    """The pins' line (none without pins): their bytes, and what the rest of the traffic has."""
    if not plan.adapters_pinned:
        return []
    return [
        f"  pinned           {plan.adapters_pinned:,} per replica,"
        f" {plan.pinned_bytes / 1e6:,.1f} MB of the adapter memory;"
        f" {plan.adapters_unpinned:,} at once left for the rest"
    ]


def _host_limit(plan: MemoryPlan) -> str:
    """The report's words for the host tier's byte limit, if any."""
    if plan.max_cpu_lora_bytes is None:
        return ""
    return (
        f", max_cpu_lora_bytes {plan.max_cpu_lora_bytes / 1e9:.1f} GB:"
        f" {plan.host_copies:,} copies fit"
    )


def _weights_form(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the form the plan holds the projections in, the form --model's checkpoint stores them
    in): a quantized checkpoint is planned as it is stored, --quantization must agree with it,
    and int4 names a 4-bit checkpoint (the data plane cannot quantize to 4 bits at load)."""
    stored = None
    if args.model:
        try:
            stored = base_model.checkpoint_quantization(base_model.read_config(args.model))
        except ValueError as e:  # BaseModelError, BaseModelUnavailable
            raise PlanError(str(e)) from e
    asked = args.quantization
    if stored == "unsupported":
        raise PlanError(
            f"--model {args.model}: its quantization_config is a form the data plane does not"
            " serve (FP8 float-quantized, 4-bit AWQ, GPTQ or pack-quantized, or 16 bits)"
        )
    if stored is not None and asked not in (None, stored):
        word = {"int4": "a 4-bit", "fp8": "an FP8"}[stored]
        raise PlanError(
            f"--model {args.model} is {word} checkpoint, served as it is stored: give"
            f" --quantization {stored} or leave it out"
        )
    if asked == "int4" and args.model and stored is None:
        raise PlanError(
            f"--quantization int4 plans a 4-bit checkpoint (AWQ, GPTQ, pack-quantized), and"
            f" --model {args.model} holds 16-bit weights: the data plane reads 4-bit weights"
            " from checkpoints only (it quantizes to fp8 at load, not to 4 bits)"
        )
    return asked or stored, stored


def run_plan(args: argparse.Namespace) -> PlanReport:
    """Work out the plan `args` (the `plan` command's flags) ask for."""
    shape = _shape(args)
    form, stored = _weights_form(args)
    if args.device == "cpu" and args.device_memory is None:
        raise PlanError("--device cpu: give --device-memory (the host memory to plan for)")
    gpu = _gpu(args)
    try:
        profile = AdapterProfile(args.adapters, args.adapter_rank, tuple(args.adapter_modules),
                                 args.popularity, pinned=getattr(args, "pinned", 0))  # fmt: skip

        def make_config(layout: Layout) -> EngineConfig:
            return EngineConfig(
                model=shape.name,
                dtype=args.dtype,
                # "int4" is a checkpoint's form, not a setting: the engine reads it as such
                quantization=layout.quantization if layout.quantization == "fp8" else None,
                tensor_parallel_size=layout.tensor_parallel_size,
                kv_cache_dtype=args.kv_cache_dtype,
                device=args.device,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                max_loras=args.max_loras,
                max_cpu_loras=args.max_cpu_loras,
                max_cpu_lora_bytes=getattr(args, "max_cpu_lora_bytes", None),
                max_lora_rank=max(64, args.adapter_rank),
                lora_memory=args.lora_memory,
            )

        layouts, note = _layouts(args, shape, gpu, profile, make_config, stored)
        layout = Layout(args.tensor_parallel_size or 1, form)
        if layouts:
            best = cheapest(layouts)
            if best is None:
                raise PlanError(
                    f"no layout of {shape.name} fits {gpu.name} GPUs: "
                    + "; ".join(f"{f.layout.label(args.dtype)}: {f.why_not}" for f in layouts)
                )
            layout = best.layout
        config = make_config(layout)
        plan = plan_memory(shape, config, gpu.memory, profile, args.reserved, layout.quantization)
        load = None
        if args.rate is not None:
            load = Workload(profile.count, profile.popularity, args.prompt_tokens,
                            args.output_tokens, rate=args.rate, duration_s=args.duration,
                            warmup_s=args.warmup, spread=args.spread, seed=args.seed)  # fmt: skip
            if not 0 <= args.warmup < args.duration:
                raise ValueError("--warmup must be at least 0 and below --duration")
    except ValueError as e:
        raise PlanError(str(e)) from e
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in policies:
        try:
            make_policy(policy, 1, 1)
        except ValueError as e:
            raise PlanError(f"--policies: {e}") from e
    if not policies:
        raise PlanError(f"--policies: give some of {', '.join(POLICIES)}")
    cost = _cost(args, shape, profile, gpu, config, layout.quantization)
    report = PlanReport(shape, config, profile, plan, cost, load, args.ttft_p99,
                        layouts=layouts, layout_note=note,
                        quantization=layout.quantization)  # fmt: skip
    if load is None:
        return report
    if plan.adapters_resident < 1:
        raise PlanError(
            f"one adapter ({plan.adapter_device_bytes / 1e6:.1f} MB) does not fit in the"
            f" adapter memory ({plan.lora_budget_bytes / 1e6:.1f} MB): raise --lora-memory"
        )
    settings = ReplicaSettings.from_plan(plan, config)
    for policy in policies:
        n, results = replicas_needed(settings, cost, policy, load, args.ttft_p99,
                                     args.max_replicas)  # fmt: skip
        report.needed[policy], report.results[policy] = n, results
    if args.plot:
        report.plot = _plot(report, settings, args.plot)
    return report


def _layouts(
    args: argparse.Namespace,
    shape: ModelShape,
    gpu: GPUSpec,
    profile: AdapterProfile,
    make_config: Callable[[Layout], EngineConfig],
    stored: str | None = None,
) -> tuple[list[LayoutFit], str]:
    """Every layout sized, when `--recommend-layout` asks, or unasked when the model does not
    fit one GPU in --dtype and no layout flag was given (with a line saying so); else none.
    A quantized checkpoint (`stored`) is compared in its own form only, on 1 to 8 GPUs."""
    note = ""
    if not args.recommend_layout:
        chosen = args.tensor_parallel_size is not None or args.quantization is not None
        measured = args.device == "cpu" or args.calibrate or args.cost
        weights = weights_bytes(shape, args.dtype, stored)  # a quantized checkpoint's form
        if chosen or measured or weights < gpu.memory - args.reserved:
            return [], ""
        note = (
            f"{shape.name} in {stored or args.dtype} does not fit one {gpu.name}: weights"
            f" {weights / 1e9:.1f} GB > {(gpu.memory - args.reserved) / 1e9:.1f} GB of device"
            " memory; comparing the layouts that could serve it"
        )
    replicas_for = None
    if args.rate is not None:
        policy = next(p.strip() for p in f"{args.policies},round_robin".split(",") if p.strip())
        load = Workload(profile.count, profile.popularity, args.prompt_tokens,
                        args.output_tokens, rate=args.rate, duration_s=args.duration,
                        warmup_s=args.warmup, spread=args.spread, seed=args.seed)  # fmt: skip

        def replicas_for(plan: MemoryPlan, config: EngineConfig, cost: Roofline) -> int | None:
            settings = ReplicaSettings.from_plan(plan, config)
            return replicas_needed(settings, cost, policy, load, args.ttft_p99,
                                   args.max_replicas)[0]  # fmt: skip

    fits = [
        fit_layout(layout, shape, make_config, gpu, profile, args.reserved,
                   args.prompt_tokens, args.output_tokens, replicas_for)
        for layout in (LAYOUTS if stored is None else [Layout(n, stored) for n in TP_SIZES])
    ]  # fmt: skip
    return fits, note


def _plot(report: PlanReport, settings: ReplicaSettings, path: str) -> str:
    from loraplane.planner.fleet import simulate
    from loraplane.planner.plot import PlotUnavailable, plot_curves

    assert report.load is not None
    found = [n for n in report.needed.values() if n is not None] or [1]
    sizes = range(max(1, min(found) - 2), max(found) + 3)
    curves = {}
    for policy, results in report.results.items():
        for n in sizes:
            if n not in results:
                results[n] = simulate(settings, report.cost, policy, n, report.load)
        curves[policy] = [(float(n), results[n]) for n in sizes]
    load = report.load
    title = (
        f"{report.shape.name} {report.config.dtype}, {load.adapters:,} adapters"
        f" {load.popularity}, rank {report.profile.rank}; {load.rate:g} req/s"
    )
    try:
        return str(plot_curves(curves, "replicas", report.ttft_p99_s, path, title))
    except PlotUnavailable as e:
        raise PlanError(str(e)) from e


def _modules(modules: tuple[str, ...]) -> str:
    from loraplane.adapters.base_model import SUPPORTED_MODULES

    return "all seven projections" if set(modules) == set(SUPPORTED_MODULES) else ", ".join(modules)
