"""What `loraplane plan` works out and prints: `run_plan(args)` -> `PlanReport`."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from dataclasses import dataclass, field
from typing import Any

from loraplane.dataplane.config import EngineConfig
from loraplane.planner.cost import GPUS, CostModel, GPUSpec, LinearCost, Roofline
from loraplane.planner.fleet import FleetResult, Workload
from loraplane.planner.memory import AdapterProfile, MemoryPlan, plan_memory
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

    def to_json(self) -> dict[str, Any]:
        """The JSON object `--json` prints."""
        plan = self.plan
        out: dict[str, Any] = {
            "model": dataclasses.asdict(self.shape) | {"params": self.shape.num_params()},
            "dtype": self.config.dtype,
            "device": self.config.device,
            "memory": dataclasses.asdict(plan) | {"kv_tokens": plan.kv_tokens},
            "adapter_bytes": plan.adapter_bytes,
            "adapter_device_bytes": plan.adapter_device_bytes,
            "kv_bytes_per_token": plan.kv_bytes_per_token,
            "adapters_resident": plan.adapters_resident,
            "host_tier_bytes": plan.host_tier_bytes,
            "disk_tier_bytes": plan.disk_tier_bytes,
            "adapters": dataclasses.asdict(self.profile),
            "cost": self.cost.describe(),
        }
        if self.load is not None:
            load = dataclasses.asdict(self.load)
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
        lines = [
            f"model {s.name} ({s.model_type}, {s.num_layers} layers, hidden {s.hidden_size},"
            f" {s.num_params() / 1e9:.2f} B parameters) in {cfg.dtype}"
            f"{', fp8 weights' if cfg.quantization else ''} on {cfg.device},"
            f" {plan.device_memory / gb:.1f} GB of device memory",
            "memory per replica:",
            f"  weights          {plan.weights_bytes / gb:8.2f} GB",
            f"  KV cache         {plan.kv_cache_bytes / gb:8.2f} GB  ({plan.kv_blocks:,} blocks"
            f" of {cfg.block_size} tokens = {plan.kv_tokens:,} tokens;"
            f" {plan.kv_bytes_per_token / 1024:.0f} KiB per token)",
            f"  adapter memory   {plan.lora_budget_bytes / gb:8.2f} GB  (--lora-memory"
            f" {_lora_memory(cfg.lora_memory)} of {plan.free_bytes / gb:.2f} GB free"
            f"{'; inside the KV cache' if plan.kv_lora_shared else ''})",
            f"adapters: {self.profile.count:,} of rank {self.profile.rank} on"
            f" {_modules(self.profile.modules)}, {plan.adapter_bytes / 1e6:.1f} MB each"
            f" ({plan.adapter_device_bytes / 1e6:.1f} MB on the device)",
            f"  running at once  {plan.adapters_resident:,} per replica (of"
            f" {plan.lora_slots} slots)",
            f"  host tier        {min(plan.max_cpu_loras, self.profile.count):,} adapters,"
            f" {plan.host_tier_bytes / gb:.1f} GB (max_cpu_loras {plan.max_cpu_loras})",
            f"  disk tier        {self.profile.count:,} adapters,"
            f" {plan.disk_tier_bytes / gb:.1f} GB",
            f"cost model: {_describe_cost(self.cost)}",
        ]
        if self.load is None:
            lines.append("(give --rate to size the fleet for a load)")
            return "\n".join(lines)
        load = self.load
        lines += [
            f"load: {load.rate:g} requests/s, prompt {load.prompt_tokens} and output"
            f" {load.output_tokens} tokens (+-{load.spread:.0%}), {load.popularity};"
            f" target p99 TTFT {self.ttft_p99_s:g} s",
            f"  {'policy':<14} {'replicas':>8} {'p99 TTFT':>9} {'p50 TTFT':>9}"
            f" {'tokens/s':>10} {'cold loads/s':>12}",
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
            )
        if self.plot:
            lines.append(f"plot: {self.plot}")
        return "\n".join(lines)


def _result_json(r: FleetResult) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(r).items() if k != "ttft_s"}


def _lora_memory(value: int | float) -> str:
    return f"{value:g}" if isinstance(value, float) else f"{value / 1e9:.2f} GB"


def _describe_cost(cost: CostModel) -> str:
    d = cost.describe()
    if d["kind"] == "roofline":
        g = d["gpu"]
        return (
            f"roofline of {g['name']} ({g['bandwidth'] / 1e9:,.0f} GB/s at"
            f" {d['bandwidth_efficiency']:.0%}, {g['flops'] / 1e12:,.0f} TFLOPS at"
            f" {d['flops_efficiency']:.0%}, PCIe {g['pcie'] / 1e9:.0f} GB/s)"
        )
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
    flags = (args.device_memory, args.device_bandwidth, args.device_flops, args.pcie)
    return GPUSpec(
        name=base.name if all(f is None for f in flags) else f"{base.name} as adjusted",
        memory=args.device_memory or base.memory,
        bandwidth=args.device_bandwidth * 1e9 if args.device_bandwidth else base.bandwidth,
        flops=args.device_flops * 1e12 if args.device_flops else base.flops,
        pcie=args.pcie * 1e9 if args.pcie else base.pcie,
    )


def _cost(args: argparse.Namespace, shape: ModelShape, profile: AdapterProfile,
          gpu: GPUSpec, config: EngineConfig) -> CostModel:  # fmt: skip
    if args.calibrate:
        return _calibrate(args, profile, config)
    if args.cost:
        try:
            return LinearCost.load(args.cost)
        except ValueError as e:
            raise PlanError(str(e)) from e
    return Roofline(gpu, shape, args.dtype, profile, args.quantization)


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


def run_plan(args: argparse.Namespace) -> PlanReport:
    """Work out the plan `args` (the `plan` command's flags) ask for."""
    shape = _shape(args)
    if args.device == "cpu" and args.device_memory is None:
        raise PlanError("--device cpu: give --device-memory (the host memory to plan for)")
    gpu = _gpu(args)
    try:
        profile = AdapterProfile(args.adapters, args.adapter_rank, tuple(args.adapter_modules),
                                 args.popularity)  # fmt: skip
        config = EngineConfig(
            model=shape.name,
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras,
            max_lora_rank=max(64, args.adapter_rank),
            lora_memory=args.lora_memory,
        )
        plan = plan_memory(shape, config, gpu.memory, profile, args.reserved)
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
    cost = _cost(args, shape, profile, gpu, config)
    report = PlanReport(shape, config, profile, plan, cost, load, args.ttft_p99)
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
