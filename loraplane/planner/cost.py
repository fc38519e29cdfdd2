"""How long one replica's step and adapter loads take: the planner's cost model.

Two sources:
- `Roofline`: a GPU spec (memory bandwidth, dense peak flop/s, host link). A step moves the
  streamed weights, the K/V it attends over and the step's distinct adapters (SGMV reads each
  adapter's A and B once per step), and computes 2 flops per parameter per token plus
  attention and the LoRA side path (on a mixture of experts a token computes with its top-k
  experts only, and a step reads the experts its tokens can reach: `expert_reach`); it takes
  the longer of the two at the given efficiencies, plus a fixed launch overhead. An adapter
  placed on the device for a step is copied over the host link inside that step.
  Split over N GPUs (`tensor_parallel_size`), the step is one rank's: its shard's bytes and
  flops (`parallel.rank_shape`), then the step's all-reduces and logits all-gather over the
  GPU's interconnect (`parallel.Collectives`: a ring's bytes at the link's rate, plus a
  latency per collective; data-sheet assumptions, not measured on a GPU yet).
- `LinearCost`: coefficients measured on this engine (`calibrate.py`): a step costs
  `base + per_token * tokens + per_seq * rows + per_context * context + per_adapter * adapters`
  seconds, fitted to timed `Engine.step()` calls; a cold load the measured time per byte. How
  much identical steps vary (`jitter`: each over their median, in the order measured) is
  replayed by the simulated replicas, so the simulation sees the step-time variation of the
  machine it was calibrated on (a shared CPU's, say), not only its mean.
Both load adapters into host memory on the loader threads (disk -> host) at `host_load_seconds`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from loraplane.planner.memory import (
    DTYPE_BYTES,
    FP8_TORCH_PATH_BYTES,
    AdapterProfile,
    adapter_elements,
    kv_bytes_per_token,
    w4_bytes_per_weight,
)
from loraplane.planner.parallel import Collectives, rank_shape
from loraplane.planner.shapes import ModelShape


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes."""

    tokens: int  # prompt chunk and decode tokens
    seqs: int  # rows (sequences) in the step
    context: int  # K/V tokens the step attends over: sum of the rows' lengths after the step
    attention: int  # query x key pairs: sum over rows of new tokens x length after the step
    adapters: int  # distinct adapters in the step
    adapter_bytes: int  # their device bytes together
    placed_bytes: int = 0  # adapter bytes copied host -> device for this step
    deferred: int = 0  # waiting requests the adapter rules held back (the scheduler's work)


class CostModel(Protocol):
    """Seconds for a step and for an adapter's load."""

    def step_seconds(self, step: StepShape) -> float:
        """Wall time of one step (device copies of adapters placed for it included)."""
        ...

    def host_load_seconds(self, nbytes: int) -> float:
        """Wall time of one adapter's load into host memory on a loader thread."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-able description, for reports."""
        ...

    @property
    def jitter(self) -> tuple[float, ...]:
        """Measured step time over predicted, in the order measured: a simulated replica
        replays them (from a seeded offset) on its steps; empty: steps take what is predicted."""
        ...


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """A GPU's memory, bandwidth (bytes/s), dense bf16/fp16 peak (flop/s), host link, and
    its link to the other GPUs of its node (bytes/s per direction) with a collective's fixed
    latency (seconds): what a tensor-parallel replica's all-reduces run over."""

    name: str
    memory: int
    bandwidth: float
    flops: float
    pcie: float
    interconnect: float = 0.0  # 0: none known (tensor parallelism cannot be costed)
    collective_latency: float = 10e-6
    # FP8 conversions in hardware (compute capability 8.9+): the data plane's FP8 weights take
    # the Triton W8A16 kernel (a byte per weight read) rather than the torch dequantize path
    fp8: bool = True


# Vendor data sheets (SXM parts; dense tensor-core peak without sparsity; PCIe at a usable
# ~80% of the link's rate). Interconnect: NVLink's rate per direction (NVLink 4 on H100/H200:
# 900 GB/s both ways; NVLink 3 on A100: 600), the L40S has none and talks over PCIe. The
# latency per collective (~10 us over NVLink, ~20 us over PCIe, NCCL's small-message range)
# is an assumption until a GPU run measures it.
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("h200", 141 * 10**9, 4.8e12, 989e12, 50e9, 450e9, 10e-6),
        GPUSpec("h100", 80 * 10**9, 3.35e12, 989e12, 50e9, 450e9, 10e-6),
        GPUSpec("a100-80gb", 80 * 10**9, 2.039e12, 312e12, 25e9, 300e9, 10e-6, fp8=False),
        GPUSpec("l40s", 48 * 10**9, 0.864e12, 362e12, 25e9, 25e9, 20e-6),
    )
}


def expert_reach(shape: ModelShape, tokens: int) -> float:
    """The expected share of a sparse layer's experts that `tokens` tokens route to (each
    choosing `experts_per_tok` of `num_experts` as if at random): 1 - (1 - k/E)^tokens. One
    token reaches k/E of them; a prefill chunk of hundreds, all of them. 1.0 for a dense model."""
    if not shape.num_experts:
        return 1.0
    return 1.0 - (1.0 - shape.experts_per_tok / shape.num_experts) ** max(tokens, 1)


def streamed_linear_params(shape: ModelShape, tokens: int) -> float:
    """The decoder's linear parameters a step of `tokens` tokens reads: every dense one, and
    of the experts the share its tokens reach."""
    total, active = shape.linear_params(), shape.active_linear_params()
    if total == active:
        return float(total)
    k, n = shape.experts_per_tok, shape.num_experts
    experts = (total - active) * n / (n - k)  # every expert of every sparse layer
    return total - experts + experts * expert_reach(shape, tokens)


# What a plan from the roofline can be trusted for, printed with every GPU plan (issue 32).
ROOFLINE_CONFIDENCE = (
    "unvalidated on GPUs: no GPU run has checked the roofline's seconds (the simulator's rules"
    " are checked against a real CPU replica, loraplane.planner.validate, not these costs). It"
    " leaves out kernel efficiency below the assumed 80% of bandwidth and 50% of peak (small"
    " batches, attention, SGMV over many adapters), host time beyond a fixed 2 ms a step"
    " (Python scheduling, sampling, a long waiting queue), CUDA graphs, adapter copies that"
    " contend with other PCIe traffic, and collectives' real latency: read its replica counts"
    " as estimates, possibly optimistic, until a GPU run calibrates them (--calibrate)"
)


@dataclass(frozen=True, slots=True)
class Roofline:
    """A step at the roofline of `gpu` for `shape` in `dtype` (see the module docstring)."""

    gpu: GPUSpec
    shape: ModelShape
    dtype: str
    profile: AdapterProfile
    # "fp8": the linear weights as the data plane's FP8 path on this GPU moves them; "int4":
    # as its Triton W4A16 kernel reads them (half a byte, and the groups' scales and zeros)
    quantization: str | None = None
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.5
    step_overhead_s: float = 0.002  # launches, scheduling and sampling on the host
    host_load_fixed_s: float = 0.002  # a load's fixed cost: open, parse, verify
    host_load_bandwidth: float = 1.5e9  # bytes/s: local read, digest and dtype conversion
    tensor_parallel_size: int = 1  # ranks: each moves and computes its shard (parallel.py)
    kv_cache_dtype: str = "auto"  # "fp8": a byte per cached K and V value
    interconnect_efficiency: float = 0.8  # share of the GPU link a ring collective reaches

    def __post_init__(self) -> None:
        rank_shape(self.shape, self.tensor_parallel_size)  # TensorParallelRefused if it can't
        if self.tensor_parallel_size > 1 and self.gpu.interconnect <= 0:
            raise ValueError(f"{self.gpu.name}: no interconnect bandwidth to cost collectives")

    @property
    def collectives(self) -> Collectives:
        """The step's collectives over this GPU's link (none on one rank)."""
        g = self.gpu
        return Collectives(self.tensor_parallel_size, g.interconnect, g.collective_latency,
                           self.interconnect_efficiency)  # fmt: skip

    def step_seconds(self, step: StepShape) -> float:
        """The longer of one rank's memory and compute time, its collectives after (not
        overlapped), plus overheads."""
        elt = DTYPE_BYTES[self.dtype]
        shape = rank_shape(
            self.shape, self.tensor_parallel_size
        )  # the rank's shard (the model itself on one)
        embed = shape.vocab_size * shape.hidden_size
        # a step gathers a few embedding rows; the LM head (the embedding, if tied) is read
        others = shape.num_params() - shape.linear_params()  # embedding, norms, LM head
        streamed_params = others + streamed_linear_params(shape, step.tokens)
        streamed = (streamed_params - (0 if shape.tie_word_embeddings else embed)) * elt
        if self.quantization == "int4":  # the W4A16 kernel, on every CUDA GPU
            per_weight = w4_bytes_per_weight(shape)
            streamed -= streamed_linear_params(shape, step.tokens) * (elt - per_weight)
        elif self.quantization is not None and self.gpu.fp8:  # the W8A16 kernel: a byte a weight
            streamed -= streamed_linear_params(shape, step.tokens) * (elt - 1)
        elif self.quantization is not None:  # the torch path: dequantization, then the matmul
            streamed += streamed_linear_params(shape, step.tokens) * FP8_TORCH_PATH_BYTES
        per_token_kv = kv_bytes_per_token(shape, self.dtype, self.kv_cache_dtype)
        moved = streamed + per_token_kv * (step.context + step.tokens) + step.adapter_bytes
        q_dim = shape.num_heads * shape.head_dim
        flops = (
            2 * shape.active_linear_params() * step.tokens  # top-k experts per token
            + 2 * embed * step.seqs  # the LM head, for the rows that sample
            + 4 * shape.num_layers * q_dim * step.attention
            + 2 * adapter_elements(shape, self.profile) * step.tokens
        )
        busy = max(
            moved / (self.gpu.bandwidth * self.bandwidth_efficiency),
            flops / (self.gpu.flops * self.flops_efficiency),
        )
        comm = self.collectives.step_seconds(self.shape, elt, step.tokens, step.seqs)
        return busy + comm + self.step_overhead_s + self._placing_seconds(step.placed_bytes)

    def _placing_seconds(self, placed_bytes: int) -> float:
        """Putting adapters in slots for a step: rank 0 copies its slices over PCIe; the other
        ranks, meanwhile, each read the whole adapter from the disk tier and keep their slices
        (parallel/worker.py), inside the step."""
        copy = placed_bytes / self.gpu.pcie
        if self.tensor_parallel_size == 1 or not placed_bytes:
            return copy
        elt = DTYPE_BYTES[self.dtype]
        local = adapter_elements(rank_shape(self.shape, self.tensor_parallel_size), self.profile)
        placed = max(1, round(placed_bytes / (local * elt)))
        whole = adapter_elements(self.shape, self.profile) * elt
        return max(copy, placed * self.host_load_seconds(whole))

    def host_load_seconds(self, nbytes: int) -> float:
        """Fixed cost plus bytes at the host's load bandwidth."""
        return self.host_load_fixed_s + nbytes / self.host_load_bandwidth

    @property
    def jitter(self) -> tuple[float, ...]:
        return ()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "roofline",
            "gpu": asdict(self.gpu),
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "flops_efficiency": self.flops_efficiency,
            "step_overhead_s": self.step_overhead_s,
            "host_load_fixed_s": self.host_load_fixed_s,
            "host_load_bandwidth": self.host_load_bandwidth,
            "tensor_parallel_size": self.tensor_parallel_size,
            "interconnect_efficiency": self.interconnect_efficiency,
            "confidence": ROOFLINE_CONFIDENCE,
        }


@dataclass(frozen=True, slots=True)
class LinearCost:
    """Step and load costs fitted to this engine's measured times (`calibrate.py`)."""

    base: float
    per_token: float
    per_seq: float
    per_context: float
    per_adapter: float
    load_seconds_per_byte: float
    measured_on: str = ""
    model: str = ""
    jitter: tuple[float, ...] = ()  # identical steps' times over their median, in order
    # the engine's work per deferred request and step (the scheduler and the housekeeping go
    # over the waiting queue): 0 in cost files from before it was measured
    per_deferred: float = 0.0

    def step_seconds(self, step: StepShape) -> float:
        """The fitted linear model."""
        return (
            self.base
            + self.per_token * step.tokens
            + self.per_seq * step.seqs
            + self.per_context * step.context
            + self.per_adapter * step.adapters
            + self.per_deferred * step.deferred
        )

    def host_load_seconds(self, nbytes: int) -> float:
        """The measured load time, scaled by bytes."""
        return self.load_seconds_per_byte * nbytes

    def describe(self) -> dict[str, Any]:
        return {"kind": "linear", **asdict(self)}

    def save(self, path: Path | str) -> None:
        """Write the coefficients as JSON (`--cost FILE` reads them back)."""
        Path(path).write_text(json.dumps(self.describe(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path | str) -> LinearCost:
        """Read coefficients saved by `save`; ValueError naming what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read cost file {path}: {e}") from e
        if not isinstance(data, dict) or data.get("kind") != "linear":
            raise ValueError(f"{path} is not a calibrated cost file (kind 'linear')")
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = data.get(f.name, 0.0 if f.name == "per_deferred" else None)
            if f.name == "jitter":
                value = value or []
                if not isinstance(value, list) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value
                ):
                    raise ValueError(f"{path}: jitter must be a list of positive numbers")
                value = tuple(float(v) for v in value)
            elif f.type == "float":
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{path}: {f.name} must be a number, got {value!r}")
                value = float(value)
            elif not isinstance(value, str):
                value = ""
            values[f.name] = value
        return cls(**values)
