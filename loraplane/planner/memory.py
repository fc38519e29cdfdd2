"""One replica's memory split, computed by the rules the engine applies (docs/dataplane.md,
"Adapter memory"):

- weights: every parameter in the serving dtype;
- adapter memory (`--lora-memory`): bytes as given, or that fraction of what the weights leave
  free, `int(free * fraction)` (`model_runner.lora_budget_bytes`);
- KV cache (CUDA): `int(free * 0.85)` less the adapter memory, in whole blocks, at most what
  `max_num_seqs` sequences of `max_model_len` tokens could use (`ModelRunner._auto_blocks`); on
  a CPU a quarter of RAM, at most 4 GiB;
- an adapter's bytes: rank-exact, `r * (in + out) * dtype bytes` per adapted module and layer
  (`LoRAPool.bytes_needed`); with adapters inside the KV cache (`kv_lora_shared`, the CUDA
  default) whole blocks of every layer, packed first-fit largest first, each tensor's offset
  rounded up to 16 bytes (`KVArena.blocks_for`);
- adapters running at once: as many as fit in the adapter memory, at most the pool's slots
  (`EngineConfig.lora_slots`: `--max-loras`, or for `auto` `max_num_seqs`);
- host tier: `max_cpu_loras` copies (auto: twice the slots), each the rank-exact bytes (split
  over N ranks: rank 0 keeps every rank's part of each copy, N parts); with
  `max_cpu_lora_bytes` at most as many copies as those bytes hold (`host_copies`), and one
  copy larger than them is refused (every load would fail);
- disk tier: every adapter's stored file;
- pinned adapters (`AdapterProfile.pinned`): resident on every replica, counted in the adapter
  memory (`pinned_bytes`, `adapters_unpinned` is what the rest of the traffic has), and refused
  past half the adapter memory or slots, as the data plane caps them.

Split over N ranks (`EngineConfig.tensor_parallel_size`, `planner/parallel.py`) every figure
above but the host tier's is one rank's, each rank the same: its shard of the weights, its KV
heads, its slice of each adapter (inside its KV cache as on one device, each rank's part in
the run of blocks rank 0 reserves); the KV blocks are rank 0's count, which every rank
allocates.

`EngineConfig` itself checks the settings and derives the slots and `max_cpu_loras`, so the
planner cannot drift from the engine; it is torch-free.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from loraplane.adapters.base_model import (
    SUPPORTED_MODULES,
    fp8_block_split_problem,
    w4_split_problem,
)
from loraplane.dataplane.arena_layout import ALIGN_BYTES, blocks_needed
from loraplane.dataplane.config import GPU_MEMORY_FRACTION, EngineConfig
from loraplane.planner.parallel import rank_shape
from loraplane.planner.shapes import ModelShape
from loraplane.sizes import resolve_memory

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CPU_KV_BUDGET = 4 << 30  # model_runner.CPU_KV_BUDGET


@dataclass(frozen=True, slots=True)
class AdapterProfile:
    """The adapters a pool serves: how many, their rank and modules, and how popular each is."""

    count: int
    rank: int = 16
    modules: tuple[str, ...] = SUPPORTED_MODULES
    popularity: str = "zipf:1.0"  # zipf:S or uniform (see fleet.popularity_weights)
    stored_dtype: str | None = None  # dtype of the stored files; None: the serving dtype
    pinned: int = 0  # of them, pinned on each replica (kept resident: docs/dataplane.md)

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"adapter count must be a positive integer, got {self.count!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"adapter rank must be a positive integer, got {self.rank!r}")
        unknown = [m for m in self.modules if m not in SUPPORTED_MODULES]
        if unknown or not self.modules:
            raise ValueError(
                f"adapter modules must be among {', '.join(SUPPORTED_MODULES)}, got"
                f" {', '.join(self.modules) or 'none'}"
            )
        if self.stored_dtype is not None and self.stored_dtype not in DTYPE_BYTES:
            raise ValueError(f"stored dtype must be one of {', '.join(DTYPE_BYTES)}")
        if isinstance(self.pinned, bool) or not isinstance(self.pinned, int) or self.pinned < 0:
            raise ValueError(f"pinned adapters must be an integer >= 0, got {self.pinned!r}")
        if self.pinned > self.count:
            raise ValueError(f"pinned adapters ({self.pinned}) exceed the adapters ({self.count})")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What one replica holds (bytes unless named otherwise); split over ranks, what each
    rank (each device) holds."""

    device_memory: int  # of one device
    weights_bytes: int  # on one device: the rank's shard
    free_bytes: int  # device memory the weights (and `reserved`) leave
    kv_bytes_per_token: int
    block_bytes: int  # one KV block, all layers, K and V
    kv_blocks: int  # the sequences' share of the KV cache
    kv_cache_bytes: int
    lora_budget_bytes: int  # --lora-memory resolved
    adapter_bytes: int  # one adapter, rank-exact (host copy, and the device copy off the arena)
    adapter_device_bytes: int  # what it takes in the device pool (whole blocks in the arena)
    adapter_stored_bytes: int
    lora_slots: int
    adapters_resident: int  # adapters that can run at once on the device
    max_cpu_loras: int
    host_tier_bytes: int
    disk_tier_bytes: int
    kv_lora_shared: bool
    tensor_parallel_size: int = 1  # devices (ranks) the replica is split over
    model_weights_bytes: int = 0  # the whole model's weights, unsplit
    adapter_full_bytes: int = 0  # one adapter unsplit (what a load reads), rank-exact
    adapters_pinned: int = 0  # of adapters_resident, pinned: always there, for their tenants
    pinned_bytes: int = 0  # the device bytes they hold
    max_cpu_lora_bytes: int | None = None  # the host tier's byte limit (None: none)

    @property
    def host_copies(self) -> int:
        """Copies the host tier keeps at most: `max_cpu_loras`, and as many as
        `max_cpu_lora_bytes` holds of copies of `adapter_bytes` on each of the ranks (rank 0
        keeps every rank's part)."""
        if self.max_cpu_lora_bytes is None:
            return self.max_cpu_loras
        copy = self.adapter_bytes * self.tensor_parallel_size
        return min(self.max_cpu_loras, self.max_cpu_lora_bytes // copy)

    @property
    def adapters_unpinned(self) -> int:
        """Adapters the rest of the traffic can have on the device at once (pins set aside)."""
        return self.adapters_resident - self.adapters_pinned

    @property
    def devices(self) -> int:
        """Devices one replica takes."""
        return self.tensor_parallel_size

    def share(self, nbytes: int) -> float:
        """`nbytes` as a share of one device's memory."""
        return nbytes / self.device_memory

    @property
    def kv_tokens(self) -> int:
        """Tokens the sequences' KV share holds."""
        return self.kv_cache_bytes // self.kv_bytes_per_token


# "int4": a 4-bit checkpoint (AWQ, GPTQ, compressed-tensors pack-quantized), read as such by
# the data plane with no flag (models/w4_formats.py): groups of `ModelShape.w4_group` input
# columns (the checkpoint's, else 128), each with a 16-bit scale and a zero point (a byte in
# the data plane's layout)
W4_GROUP_BYTES = 2 + 1


def w4_bytes_per_weight(shape: ModelShape) -> float:
    """A 4-bit linear weight's bytes with its share of its group's scale and zero point."""
    group = shape.w4_group if shape.w4_group > 0 else shape.hidden_size  # -1: one per row
    return 0.5 + W4_GROUP_BYTES / group


def check_quantized_split(shape: ModelShape, size: int, quantization: str | None) -> None:
    """ValueError when `shape`'s weights in `quantization` cannot be split over `size` ranks:
    4-bit groups, or a block-wise FP8 checkpoint's scale blocks, would be cut (the data
    plane's rules, `base_model.w4_split_problem` and `fp8_block_split_problem`)."""
    problem = None
    if quantization == "int4":
        problem = w4_split_problem(shape.spec, size, shape.w4_group)
    elif quantization == "fp8" and shape.fp8_block is not None:
        problem = fp8_block_split_problem(shape.spec, size, shape.fp8_block)
    if problem is not None:
        raise ValueError(problem)


def weights_bytes(shape: ModelShape, dtype: str, quantization: str | None = None) -> int:
    """Bytes of the model's parameters in `dtype`. With `quantization` "fp8" (models/quant.py)
    the decoder's linear weights take a byte each and an fp32 scale per output row (per block
    of the weight for a block-wise FP8 checkpoint, `shape.fp8_block`); with "int4"
    (models/quant_w4.py) half a byte each and a scale and zero point per group of
    `shape.w4_group` inputs of a row. Embeddings, norms, a mixture of experts' routers and
    the LM head stay in `dtype` (biases, a few per layer, are counted as weights); every
    expert's linears are quantized as the dense projections are."""
    if quantization is None:
        return shape.num_params() * DTYPE_BYTES[dtype]
    routers = shape.hidden_size * shape.num_experts * len(shape.moe_layers)
    linear = shape.linear_params() - routers
    others = (shape.num_params() - linear) * DTYPE_BYTES[dtype]
    if quantization == "int4":
        return others + math.ceil(linear * w4_bytes_per_weight(shape))
    shapes = [s for layer in range(shape.num_layers)
              for s in shape.adapted_shapes(SUPPORTED_MODULES, layer)]  # fmt: skip
    if shape.fp8_block is not None:
        rows, cols = shape.fp8_block
        scales = sum(-(-out // rows) * -(-inputs // cols) for inputs, out in shapes)
    else:
        scales = sum(out for _, out in shapes)
    return others + linear + 4 * scales


# What the FP8 torch path moves per linear weight in a step, before the matmul reads the
# 16-bit copy (models/quant.py: the e4m3 byte read, an fp32 copy written and read by the scale,
# the product written and read by the cast, the 16-bit copy written): until a W8A16 kernel
# reads the byte alone, an FP8 base on a GPU saves memory, not time
FP8_TORCH_PATH_BYTES = 1 + 4 + 4 + 4 + 4 + 2


def kv_bytes_per_token(shape: ModelShape, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token across all layers: in `dtype`, or a byte each with
    `kv_cache_dtype` "fp8" (kv_quant.py: the per-layer scales are a few floats, left out)."""
    elt = 1 if kv_cache_dtype == "fp8" else DTYPE_BYTES[dtype]
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * elt


def adapter_elements(shape: ModelShape, profile: AdapterProfile) -> int:
    """A and B elements of one adapter: r * (in + out) per adapted module and layer (the
    profile's modules by role: `ModelShape.adapted_shapes`, fused layers and experts)."""
    return profile.rank * _features(shape, profile.modules)


@functools.lru_cache(maxsize=64)
def _features(shape: ModelShape, modules: tuple[str, ...]) -> int:
    # cached: the cost model asks once per simulated step
    return sum(
        fan_in + fan_out
        for layer in range(shape.num_layers)
        for fan_in, fan_out in shape.adapted_shapes(modules, layer)
    )


def arena_blocks(
    shape: ModelShape, profile: AdapterProfile, block_size: int, dtype: str,
    kv_cache_dtype: str = "auto",
) -> int:  # fmt: skip
    """KV blocks one adapter (in `dtype`) takes inside a KV cache of `dtype`, or of a byte per
    value with `kv_cache_dtype` "fp8" (its blocks' bytes viewed in `dtype`, half as many
    elements in bf16, `kv_quant.storage_view`): the fewest n such that each
    layer's A and B tensors, largest first, fit first-fit into that layer's two regions (K and
    V) of n blocks, each tensor's offset in its region rounded up to ALIGN_BYTES: the rule
    `KVArena.blocks_for` places by (`arena_layout.blocks_needed`, shared). The layer that
    needs the most decides (they differ only where a mixture of experts has dense layers)."""
    # elements (in `dtype`) per block and region
    chunk = block_size * shape.num_kv_heads * shape.head_dim
    if kv_cache_dtype == "fp8":
        chunk //= DTYPE_BYTES[dtype]
    align = max(1, ALIGN_BYTES // DTYPE_BYTES[dtype])  # elements per aligned offset
    layouts = {tuple(shape.adapted_shapes(profile.modules, i)) for i in range(shape.num_layers)}
    layers = [
        sorted((n for i, o in layout for n in (profile.rank * i, o * profile.rank)), reverse=True)
        for layout in layouts
    ]
    return blocks_needed(layers, chunk, align)


def plan_memory(
    shape: ModelShape,
    config: EngineConfig,
    device_memory: int,
    profile: AdapterProfile,
    reserved: int = 0,
    quantization: str | None = None,
) -> MemoryPlan:
    """The memory split of one replica of `config` on a device of `device_memory` bytes;
    `reserved`: memory the weights do not explain (CUDA context, activations) taken off first;
    `quantization`: the weights' form where it is not `config.quantization`'s ("int4": a 4-bit
    checkpoint, which the engine reads as such with no setting)."""
    if device_memory < 1:
        raise ValueError(f"device memory must be positive, got {device_memory}")
    dtype, size = config.dtype, config.tensor_parallel_size
    quantization = quantization or config.quantization
    whole = shape
    shape = rank_shape(shape, size)  # TensorParallelRefused (a ValueError) names why not
    check_quantized_split(whole, size, quantization)
    weights = weights_bytes(shape, dtype, quantization)
    total = weights_bytes(whole, dtype, quantization) if size > 1 else weights
    free = device_memory - weights - reserved
    if free <= 0:
        form = f"{dtype}, {quantization}" if quantization else dtype
        split = f", {weights / 1e9:.1f} GB on each of {size} devices" if size > 1 else ""
        raise ValueError(
            f"the weights of {whole.name} ({total / 1e9:.1f} GB in {form}{split}) do not fit"
            f" in {device_memory / 1e9:.1f} GB of device memory"
        )
    per_token = kv_bytes_per_token(shape, dtype, config.kv_cache_dtype)
    block_bytes = per_token * config.block_size
    budget = resolve_memory(config.lora_memory, free)
    max_len = config.max_model_len or shape.max_position_embeddings
    wanted = config.max_num_seqs * -(-max_len // config.block_size)
    if config.device == "cuda":
        kv_budget = int(free * GPU_MEMORY_FRACTION) - budget
    else:
        kv_budget = min(CPU_KV_BUDGET, device_memory // 4)
    kv_blocks = config.num_kv_blocks or max(1, min(wanted, kv_budget // block_bytes))
    elements = adapter_elements(shape, profile)
    exact = elements * DTYPE_BYTES[dtype]
    shared = bool(config.kv_lora_shared)
    device_bytes = (
        arena_blocks(shape, profile, config.block_size, dtype, config.kv_cache_dtype) * block_bytes
        if shared
        else exact
    )
    full = adapter_elements(whole, profile)
    stored = full * DTYPE_BYTES[profile.stored_dtype or dtype]
    pinned_bytes = profile.pinned * device_bytes
    _check_pins(profile.pinned, pinned_bytes, budget, config.lora_slots)
    cpu_loras = config.max_cpu_loras or config.lora_slots
    host_limit = config.max_cpu_lora_bytes
    copies = cpu_loras if host_limit is None else min(cpu_loras, host_limit // (exact * size))
    if copies < 1:
        ranks = f" (every one of the {size} ranks' parts, which rank 0 keeps)" if size > 1 else ""
        raise ValueError(
            f"--max-cpu-lora-bytes ({host_limit} bytes) is less than one adapter's host copy"
            f" ({exact * size} bytes{ranks}): every adapter's load would fail"
        )
    return MemoryPlan(
        device_memory=device_memory,
        weights_bytes=weights,
        free_bytes=free,
        kv_bytes_per_token=per_token,
        block_bytes=block_bytes,
        kv_blocks=kv_blocks,
        kv_cache_bytes=kv_blocks * block_bytes,
        lora_budget_bytes=budget,
        adapter_bytes=exact,
        adapter_device_bytes=device_bytes,
        adapter_stored_bytes=stored,
        lora_slots=config.lora_slots,
        adapters_resident=min(config.lora_slots, budget // device_bytes),
        max_cpu_loras=cpu_loras,
        # rank 0 keeps every rank's part of each copy (lora/host_tier.py), all the same size
        host_tier_bytes=min(copies, profile.count) * exact * size,
        disk_tier_bytes=profile.count * stored,
        kv_lora_shared=shared,
        tensor_parallel_size=size,
        model_weights_bytes=total if size > 1 else weights,
        adapter_full_bytes=full * DTYPE_BYTES[dtype],
        adapters_pinned=profile.pinned,
        pinned_bytes=pinned_bytes,
        max_cpu_lora_bytes=host_limit,
    )


PIN_FRACTION = 0.5  # lora/pins.PIN_FRACTION: pins take at most half the memory and slots


def _check_pins(pinned: int, pinned_bytes: int, budget: int, slots: int) -> None:
    """ValueError naming the numbers when `pinned` adapters would not be let in: a replica
    pins at most half its adapter memory and half its slots."""
    cap_slots = max(1, int(slots * PIN_FRACTION))
    if pinned > cap_slots:
        raise ValueError(
            f"{pinned} pinned adapters per replica exceed its cap of {cap_slots} (half of its"
            f" {slots} adapter slots)"
        )
    cap = int(budget * PIN_FRACTION)
    if pinned_bytes > cap:
        raise ValueError(
            f"{pinned} pinned adapters take {pinned_bytes:,} bytes of adapter memory, more than"
            f" the {cap:,} bytes pins may take (half of the {budget:,}-byte adapter memory,"
            " --lora-memory)"
        )


def shared_pool_blocks(plan: MemoryPlan) -> int:
    """KV blocks allocated with adapters inside the cache: the KV share plus the adapter
    memory in whole blocks (`ModelRunner`)."""
    return plan.kv_blocks + math.ceil(plan.lora_budget_bytes / plan.block_bytes)
