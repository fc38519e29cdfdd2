"""Turns a scheduled step into logits: owns the model, its paged KV cache and the LoRA pool.

The adapter pool gets `lora_memory` bytes (or that share of the device memory the weights leave
free; on CUDA the KV cache is sized from what remains after it). Per step it puts the step's
adapters into device slots, lays the rows end to end as one flat
batch (input ids, positions, KV slot mapping, per-token adapter slot), runs the model once and
returns the logits of the rows that sample, in `SchedulerOutput.sampled` order, on the device
(the sampler runs there), and the prompt log-probabilities of scoring requests, reduced on the
device (prompt_logprobs.py). What crosses to the host goes through its `host_copy`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import numpy as np
import torch

from loraplane.adapters.base_model import read_config
from loraplane.dataplane import host_memory
from loraplane.dataplane.config import GPU_MEMORY_FRACTION, EngineConfig
from loraplane.dataplane.cpus import size_torch_threads
from loraplane.dataplane.cuda_graphs import (
    Capture,
    DecodeGraphs,
    GraphShape,
    capture_decode_graphs,
)
from loraplane.dataplane.devices import torch_device
from loraplane.dataplane.host_copy import HostCopy
from loraplane.dataplane.lora.dora_cache import NORM_FOLDER, NormCache
from loraplane.dataplane.lora.manager import LoRAManager
from loraplane.dataplane.lora.metadata import BASE_SLOT
from loraplane.dataplane.lora.weights import LoadedAdapter
from loraplane.dataplane.model_step import (
    TORCH_DTYPES,
    PromptRow,
    StepLogits,
    StepPlan,
    build_model,
    run_plan,
)
from loraplane.dataplane.models import gemma
from loraplane.dataplane.parallel.group import SlotLoad, StepMessage, WorkerGroup
from loraplane.dataplane.parallel.shard import TPShard, heads_of, shard_adapter
from loraplane.dataplane.parallel.ship import PackedPart, peer_parts, wire
from loraplane.dataplane.scheduler import SchedulerOutput
from loraplane.dataplane.step_metadata import StepRow
from loraplane.dataplane.tiers.disk import DiskTier
from loraplane.sizes import resolve_memory

__all__ = ["TORCH_DTYPES", "ModelRunner", "StepLogits", "lora_budget_bytes"]
CPU_KV_BUDGET = 4 << 30  # bytes of KV cache at most on CPU (or a quarter of RAM, if less)


def _model_max_len(model_dir: str) -> int:
    # an image-text Gemma 3 keeps it in text_config, and Gemma configs may leave it to
    # transformers' default
    value = gemma.text_config(read_config(model_dir)).get("max_position_embeddings") or 4096
    return int(value)


def lora_budget_bytes(lora_memory: int | float, device: torch.device) -> int:
    """`lora_memory` in bytes: as given, or that fraction of the device memory free now (after
    the weights: CUDA's free memory, or on CPU the RAM available to new allocations, page cache
    the kernel can reclaim included: `host_memory.available_bytes`)."""
    if isinstance(lora_memory, int):
        return lora_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = host_memory.available_bytes()
    return resolve_memory(lora_memory, free)


class ModelRunner:
    """The model on its device, its KV cache, and the adapters in its LoRA slots."""

    def __init__(self, config: EngineConfig, disk: DiskTier | None = None) -> None:
        self.device = torch_device(config.device)  # ValueError without CUDA
        self.dtype = TORCH_DTYPES[config.dtype]
        # tensor parallelism: this process is rank 0; the workers start (and load their
        # shards) while it loads its own
        self.workers: WorkerGroup | None = None
        shard = None
        # torch's team within the CPUs the process may use (a container's CPU limit, not the
        # node's cores), shared out between the ranks of a CPU tensor-parallel group
        size_torch_threads(config.tensor_parallel_size if self.device.type == "cpu" else 1)
        if config.tensor_parallel_size > 1:
            self.workers = WorkerGroup.start(config, self.device)
            shard = self.workers.comm.shard
        try:
            comm = None if self.workers is None else self.workers.comm
            built = build_model(config, self.device, shard, comm)
        except BaseException:
            self.close()
            raise
        self.model, self.pool, self._vocab_size = built.model, built.pool, built.vocab_size
        self._heads = heads_of(built.spec)  # the whole model's: how its q/k/v rows split
        if disk is not None and not disk.local:  # DoRA's g kept beside the downloaded copies
            self.pool.norm_cache = NormCache(disk.root / NORM_FOLDER)
        self.lora_budget_bytes = lora_budget_bytes(config.lora_memory, self.device)
        self.loras = LoRAManager(
            self.pool,
            built.spec,
            config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            max_cpu_lora_bytes=config.max_cpu_lora_bytes,
            disk=disk,
            device_budget_bytes=self.lora_budget_bytes,
            prefetch=config.enable_lora_prefetch,
            shard=None
            if shard is None
            else functools.partial(shard_adapter, shard=shard, heads=heads_of(built.spec)),
            peers=None if shard is None else functools.partial(self._peer_parts, shard),
        )
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=_model_max_len(config.model))
        if config.num_kv_blocks is None:
            config = dataclasses.replace(config, num_kv_blocks=self._auto_blocks(config))
        assert config.num_kv_blocks is not None
        # shared: the adapter memory is KV blocks too (lora/arena.py), on top of the KV share
        self.num_blocks = config.num_kv_blocks
        if config.kv_lora_shared:
            block_bytes = self.model.kv_cache_block_bytes(config.block_size)
            self.num_blocks += -(-self.lora_budget_bytes // block_bytes)
        self.model.allocate_kv_cache(self.num_blocks, config.block_size)
        if self.workers is not None:
            self.workers.allocate(self.num_blocks, config.block_size)
        # slot -> (adapter key, slot generation), as the workers hold them
        self._mirrored: dict[int, tuple[str, int]] = {}
        if self.model.kv_cache is None:  # pragma: no cover - allocate_kv_cache sets it
            raise RuntimeError("the KV cache was not allocated")
        self.kv_cache: torch.Tensor = self.model.kv_cache  # [2, layers, blocks, bs, kv, dim]
        self.config = config
        self.cuda_graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        # the step's device->host copies, counted (the engine's sampler shares it)
        self.host_copy = HostCopy()

    def enable_cuda_graphs(self, pad_block: int, capture: Capture | None = None) -> bool:
        """Capture decode graphs (cuda_graphs.py) whose padding rows write into KV block
        `pad_block`, which the caller keeps from every sequence; False (logged) when they
        cannot be captured, and decode steps stay eager."""
        assert self.config.max_model_len is not None
        shape = GraphShape(
            max_batch=self.config.max_num_seqs,
            max_model_len=self.config.max_model_len,
            block_size=self.config.block_size,
            pad_block=pad_block,
            max_lora_rank=self.config.max_lora_rank,
        )
        self.cuda_graphs = capture_decode_graphs(self.model, self.pool, shape, capture)
        return self.cuda_graphs is not None

    @property
    def vocab_size(self) -> int:
        """Columns of the logits (the model's vocabulary, padding included)."""
        return self._vocab_size

    def _peer_parts(self, shard: TPShard, adapter: LoadedAdapter) -> tuple[PackedPart, ...]:
        """The workers' parts of `adapter` (rank 0's loader threads), in the pool's dtype and
        B layout as they are when it loads (an arena, attached after this runner is built,
        lays B out untransposed): every rank's pool has rank 0's."""
        return peer_parts(adapter, shard, self._heads, self.pool.dtype, self.pool.transposes_b)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.workers is not None:
            self.workers.close()

    def _auto_blocks(self, config: EngineConfig) -> int:
        """KV blocks from free memory: all a full batch of max-length sequences could use,
        capped by a share of the device's free memory."""
        block_bytes = self.model.kv_cache_block_bytes(config.block_size)
        max_len = config.max_model_len or 4096
        full_batch = config.max_num_seqs * -(-max_len // config.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # the adapter pool fills up later: its budget is not KV memory
            budget = int(free * GPU_MEMORY_FRACTION) - self.lora_budget_bytes
        else:
            budget = min(CPU_KV_BUDGET, host_memory.total_bytes() // 4)
        return max(1, min(full_batch, budget // block_bytes))

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, in_use: set[str], wanted: set[str] | None = None
    ) -> StepLogits:
        """Run one step; return fp32 logits [len(out.sampled), vocab] on the device, and the
        prompt scores (prompt_logprobs.py) of the rows whose request wants prompt
        log-probabilities, already on the host (one copy through `host_copy`).

        `in_use` holds the adapter keys of running sequences (never evicted from their slots),
        `wanted` those of waiting ones (evicted only after every other idle adapter).
        """
        rows = out.scheduled
        if not rows:
            empty = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
            return StepLogits(empty, {})
        self.loras.make_resident(out.lora_keys, in_use, wanted or ())
        slot_of = self.loras.slot_of
        step_rows = [
            StepRow(
                r.seq.token_ids[r.start : r.start + r.num_new_tokens],
                r.start + r.num_new_tokens,
                r.seq.block_table,
                BASE_SLOT if r.seq.lora is None else slot_of(r.seq.lora.key),
            )
            for r in rows
        ]
        prompt = []
        for i, r in enumerate(rows):  # rows whose request wants its prompt's log-probabilities
            top = r.seq.params.prompt_logprobs
            if top is None:
                continue
            # position p's logits predict token p + 1: those of the prompt's tokens 1..P-1
            stop = min(r.start + r.num_new_tokens, r.seq.num_prompt_tokens - 1)
            if stop > r.start:
                tokens = r.seq.prompt_token_ids[r.start + 1 : stop + 1]
                prompt.append(PromptRow(i, r.seq.request_id, r.start + 1, tokens, top))
        plan = StepPlan(step_rows, bool(out.lora_keys), [r.sample for r in rows], prompt)
        if self.workers is None:
            return run_plan(self.model, plan, self.config.block_size, self.host_copy,
                            self.cuda_graphs)  # fmt: skip
        message, buffers = self._message(plan)
        self.workers.send(message, buffers)
        self.pool.sync_norms(message.norms, self.workers.comm.all_reduce)
        return run_plan(self.model, plan, self.config.block_size, self.host_copy)

    def _message(self, plan: StepPlan) -> tuple[StepMessage, list[list[np.ndarray]]]:
        """`plan` with the slot changes since the last step, so the workers' slots hold what
        this rank's do, and the bytes of each worker's parts of the adapters put in slots
        (`[r - 1]` for rank r, in the loads' order), kept by rank 0's host tier since it read
        them (parallel/ship.py)."""
        # a slot refilled since (its generation moved) is shipped again, even with the same
        # adapter: in the KV cache it may lie in another run of blocks now
        generation = self.pool.slot_generation
        slots = {s: (key, generation[s]) for s, key in self.loras.slot_keys().items()}
        frees = [s for s, held in self._mirrored.items() if slots.get(s) != held]
        loads = []
        buffers: list[list[np.ndarray]] = [[] for _ in range(self.config.tensor_parallel_size - 1)]
        for slot, (key, _) in slots.items():
            if self._mirrored.get(slot) != slots[slot]:
                parts = self.loras.peer_parts(key)
                if not all(isinstance(p, PackedPart) for p in parts):  # pragma: no cover
                    raise TypeError(f"adapter {key}: its workers' parts are not packed")
                layout, theirs = wire(cast("list[PackedPart]", parts))
                placement = self.pool.placement(slot)
                first = None if placement is None else placement.first
                loads.append(SlotLoad(slot, key, layout, theirs[0].nbytes, first))
                for mine, buffer in zip(buffers, theirs, strict=True):
                    mine.append(buffer)
        self._mirrored = slots
        norms = sorted(self.pool.pending_norms & slots.keys())
        return StepMessage(plan, frees, loads, norms), buffers
