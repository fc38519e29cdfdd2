"""Decode steps replayed from CUDA graphs (`--cuda-graphs`): one launch sequence per step.

An eager decode step launches every kernel of every layer from Python (30+ per layer), which
on a GPU costs about as much as the step's memory traffic. With graphs the model's forward
is captured once per batch size of a ladder (1, 2, 4, 8, 16, 24, 32, 48, 64, then steps of 32)
and replayed: a step costs its host preparation, two or three host-to-device copies and one
replay.

What a graph reads lives in static buffers, refilled before each replay:
- input ids, positions, KV slot mapping, context lengths, block tables (`max_model_len` wide)
  and query offsets (always 0..b: every row is one decode token);
- the LoRA tokens (token order and each token's slot), b entries: the graph's LoRA launches are
  the BGMV kernels (`kernels/bgmv_triton.py`, one program per token per column block), sized
  for b tokens, so a layer's launched blocks grow linearly with b (SGMV sized for b segments
  of up to b tokens grew as b^2: at b = 256 about 11M mostly empty blocks per step on an 8B
  model); entries past the step's own tokens have slot -1 and exit at once;
- one slot table per (layer, module) (`ModuleSlots.graph_table`): each slot's A and B pointers
  and rank, and a DoRA slot's per-row scale g (its pointer; 0 for a plain slot, and the base
  and padding rows read no slot), rewritten for a step's slots whose adapter changed since
  (`LoRAPool.slot_generation`). The graphs' BGMV launches always carry the DoRA epilogue
  (`dora_triton.dora_epilogue`: a DoRA row rescaled where the expand stores it, the base
  layer's bias left out), so steps with DoRA rows replay like any other.
The host writes these through pinned staging buffers and copies them with non-blocking
copies; before it writes them again for the next step it waits on a CUDA event recorded after
the previous step's copies, so the staging is safe whatever the caller does after a replay (no
blocking read of the logits needed). On the CPU (and with `replay_eagerly`) the copies are
synchronous and there is no event: a no-op.
A step of B rows runs in the graph of the smallest ladder size b >= B. The b - B padding rows
decode token 0 at position 0 of a one-token context in a KV block reserved for them (taken
from the block manager at start, never given to a sequence), use no adapter, and their outputs
are dropped. Two graphs per size: with the LoRA launches, for steps where some row uses an
adapter, and without, for base-model steps.

A step runs eagerly instead when a row is not a single decode token, when it has more rows than
the largest graph, or when a slot it uses breaks the table's alignment promise (pointers on 16
bytes, ranks a multiple of 8: what the kernels were compiled for). Graphs need the Triton
attention and LoRA paths (the CUDA defaults); a capture error leaves the runner eager, with a
log line.

Capture is pluggable (`Capture`): `cuda_capture` records CUDA graphs; `replay_eagerly`, for
tests on CPU (Triton's interpreter), "replays" by running the captured function again on the
same static buffers and the same host-side objects, so anything a graph would have frozen at
capture (sizes, host numbers, launch grids) is frozen there too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplane.dataplane import attention
from loraplane.dataplane.attention import AttentionMetadata
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.kernels.slot_weights import SlotWeights
from loraplane.dataplane.lora.layers import LinearWithLoRA
from loraplane.dataplane.lora.metadata import BASE_SLOT, LoRABatch
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.models.llama import LlamaForCausalLM
from loraplane.dataplane.step_metadata import HostStep, StepRow, host_step

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
LARGE_STEP = 32  # past 64 rows, a graph every this many
PTR_ALIGN = 16  # bytes: what the graph's slot tables promise the LoRA kernels
RANK_MULTIPLE = 8

Forward = Callable[[], torch.Tensor]
# records `forward` (run against the static buffers) and returns what replays it
Capture = Callable[[Forward], Forward]


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The ladder of graph batch sizes up to `max_batch` (which is always the last)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in SMALL_SIZES if b < max_batch]
    sizes += range(SMALL_SIZES[-1] + LARGE_STEP, max_batch, LARGE_STEP)
    return (*sizes, max_batch)


def cuda_capture() -> Capture:
    """A Capture recording CUDA graphs in one shared memory pool (warmed up on a side stream
    first: Triton compiles and cuBLAS picks its kernels outside the capture)."""
    mempool = torch.cuda.graph_pool_handle()

    def capture(forward: Forward) -> Forward:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def replay_eagerly(forward: Forward) -> Forward:
    """A Capture for CPU tests: runs `forward` once (as capture's warm-up does) and replays it
    by running it again on the same static buffers and host objects."""
    forward()
    return forward


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What the graphs are sized for: the largest batch (the ladder's top), the longest
    context (block tables' width), the KV block size, the KV block padding rows write into,
    and the largest adapter rank (the LoRA launches' rank space)."""

    max_batch: int
    max_model_len: int
    block_size: int
    pad_block: int
    max_lora_rank: int


@dataclass(frozen=True, slots=True)
class _Static:
    """The static inputs a graph of one size reads (views of the shared buffers)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    lora: LoRABatch


class DecodeGraphs:
    """Captured decode forwards at a ladder of batch sizes and the static buffers they read."""

    def __init__(
        self, model: LlamaForCausalLM, pool: LoRAPool, shape: GraphShape, capture: Capture
    ) -> None:
        self.model = model
        self.pool = pool
        self.block_size = block_size = shape.block_size
        pad_block = shape.pad_block
        self.pad_slot = pad_block * block_size  # where padding rows write their K and V
        self.batch_sizes = batch_sizes(shape.max_batch)
        self.replays = 0  # steps replayed from a graph
        self.fallbacks = 0  # decode steps run eagerly for a slot breaking the alignment promise
        self.max_batch = m = self.batch_sizes[-1]
        self.width = w = -(-shape.max_model_len // block_size)
        device = pool.device
        pin = device.type == "cuda"
        # the static buffers: int64 ids, positions, slot mapping, token order, token slots;
        # int32 query offsets, context lengths, segment slots and bounds; block tables
        self._i64_host = torch.zeros(5, m, dtype=torch.int64, pin_memory=pin)
        self._i32_host = torch.zeros(4, m + 1, dtype=torch.int32, pin_memory=pin)
        self._tables_host = torch.zeros(m, w, dtype=torch.int32, pin_memory=pin)
        self._i64 = self._i64_host.to(device)
        self._i32 = self._i32_host.to(device)
        self._i32[0] = torch.arange(m + 1, dtype=torch.int32, device=device)  # query offsets
        self._tables = self._tables_host.to(device)
        self._pad_defaults(m, pad_block)
        # one slot table per (layer, module), its pointers and ranks in two packed buffers
        wrapped = [mod for mod in model.modules() if isinstance(mod, LinearWithLoRA)]
        self._modules: list[ModuleSlots] = []
        for mod in wrapped:
            if mod.slots is None:
                raise ValueError(f"{mod} is not bound to the LoRA pool")
            self._modules.append(mod.slots)
        slots = pool.num_slots
        # A, B and DoRA's g pointers [3, modules, slots]
        self._ptrs_np = np.zeros((3, len(wrapped), slots), dtype=np.int64)
        self._ranks_np = np.zeros((len(wrapped), slots), dtype=np.int32)
        self._ptrs = torch.zeros(3, len(wrapped), slots, dtype=torch.int64, device=device)
        self._ranks = torch.zeros(len(wrapped), slots, dtype=torch.int32, device=device)
        for i, mod in enumerate(wrapped):
            assert mod.slots is not None
            mod.slots.graph_table = SlotWeights(
                a_ptrs=self._ptrs[0, i], b_ptrs=self._ptrs[1, i], ranks=self._ranks[i],
                a_ptrs_host=(0,) * slots, b_ptrs_host=(0,) * slots,
                ranks_host=(shape.max_lora_rank,) + (0,) * (slots - 1),  # R: the largest rank
                in_features=mod.base_layer.in_features, out_features=mod.base_layer.out_features,
                dtype=pool.dtype, device=self._ptrs.device,
                ptr_align=PTR_ALIGN, rank_multiple=RANK_MULTIPLE,
                g_ptrs=self._ptrs[2, i], g_ptrs_host=(0,) * slots,
                dora=True,  # captured before any adapter: a DoRA slot may come later
            )  # fmt: skip
        self._seen = [-1] * slots  # slot -> the pool generation its table entries show
        # recorded after each step's staging copies (CUDA only): the host waits on it before
        # writing the pinned staging buffers again
        self._copied: torch.cuda.Event | None = None
        self._unfit: set[int] = set()  # slots whose tensors break PTR_ALIGN / RANK_MULTIPLE
        self._graphs: dict[tuple[int, bool], Forward] = {}
        for b in reversed(self.batch_sizes):  # the largest first: smaller ones reuse its memory
            for with_lora in (True, False):
                self._graphs[(b, with_lora)] = capture(self._forward(b, with_lora))

    def _pad_defaults(self, rows: int, pad_block: int) -> None:
        """Padding rows from `rows` on: token 0 at position 0 in the reserved block, no adapter."""
        i64, i32, tables = self._i64_host, self._i32_host, self._tables_host
        i64[:, :] = 0
        i64[2, :] = self.pad_slot  # slot mapping
        i32[1, :] = 1  # context lengths
        i32[2:, :] = 0  # segment slots and bounds (the BGMV launches do not read them)
        i64[4, :] = BASE_SLOT  # token slots: no adapter
        tables[:, 0] = pad_block
        self._i64.copy_(i64)
        self._i32[1:].copy_(i32[1:])
        self._tables.copy_(tables)

    def _static(self, b: int) -> _Static:
        i64, i32 = self._i64, self._i32
        attn = AttentionMetadata(
            cu_seqlens_q=i32[0, : b + 1],
            context_lens=i32[1, :b],
            block_tables=self._tables[:b],
            slot_mapping=i64[2, :b],
            host_cu_seqlens_q=list(range(b + 1)),
            # what the attention launcher sizes its split-KV grid for: the longest context
            host_context_lens=[self.width * self.block_size] * b,
        )
        lora = LoRABatch(
            num_tokens=b,
            token_order=i64[3, :b],
            seg_slots=(),
            seg_bounds=(0,),
            seg_slots_t=i32[2, :b],
            seg_bounds_t=i32[3, : b + 1],
            token_slots=i64[4, :b],
            static_max_seg_len=b,  # launches: BGMV over these b tokens
        )
        return _Static(i64[0, :b], i64[1, :b], attn, lora)

    def _forward(self, b: int, with_lora: bool) -> Forward:
        static = self._static(b)
        lora = static.lora if with_lora else None
        model = self.model

        def forward() -> torch.Tensor:
            with torch.inference_mode():
                hidden: torch.Tensor = model(static.input_ids, static.positions, static.attn, lora)
            return hidden

        return forward

    def run(self, rows: Sequence[StepRow]) -> torch.Tensor | None:
        """Replay the step of decode `rows` ([len(rows), hidden] hidden states), or None when
        it must run eagerly (see the module docstring)."""
        count = len(rows)
        if not count or count > self.max_batch or any(len(r.tokens) != 1 for r in rows):
            return None
        host = host_step(rows, self.block_size)
        used = None if host.lora is None else host.lora.seg_slots
        if used is not None and not self._refresh(used.tolist()):
            self.fallbacks += 1
            return None
        b = next(size for size in self.batch_sizes if size >= count)
        self._fill(host, count, b)
        hidden = self._graphs[(b, used is not None)]()
        self.replays += 1
        return hidden[:count]

    def _fill(self, host: HostStep, count: int, b: int) -> None:
        """Write the step's arrays into the static buffers (rows count..b-1: padding), once the
        previous step's copies out of the staging buffers are done."""
        if self._copied is not None:
            self._copied.synchronize()
        i64, i32, tables = self._i64_host, self._i32_host, self._tables_host
        i64[0, :count] = torch.from_numpy(host.ids)
        i64[1, :count] = torch.from_numpy(host.positions)
        i64[2, :count] = torch.from_numpy(host.slot_mapping)
        i64[0:2, count:b] = 0
        i64[2, count:b] = self.pad_slot
        i32[1, :count] = torch.from_numpy(host.ctx)
        i32[1, count:b] = 1
        width = host.width
        tables[:count, :width] = torch.from_numpy(host.tables)
        tables[count:b, 0] = self.pad_slot // self.block_size  # (other columns: never read)
        if host.lora is not None:
            n = len(host.lora.order)
            i64[3, :n] = torch.from_numpy(host.lora.order)
            i64[4, :n] = torch.from_numpy(host.lora.sorted_slots)
            i64[3, n:b] = 0
            i64[4, n:b] = BASE_SLOT  # base and padding rows: their programs exit at once
        self._i64[:, :b].copy_(i64[:, :b], non_blocking=True)
        self._i32[1, :b].copy_(i32[1, :b], non_blocking=True)
        self._tables[:b, :width].copy_(tables[:b, :width], non_blocking=True)
        if self._i64.is_cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()

    def _refresh(self, used: list[int]) -> bool:
        """Bring the slot tables' entries for `used` up to date with the pool; False when one of
        them cannot be replayed (its tensors break the tables' alignment promise)."""
        generation = self.pool.slot_generation
        stale = [slot for slot in used if generation[slot] != self._seen[slot]]
        for slot in stale:
            fit = True
            for i, slots in enumerate(self._modules):
                a, b, g = slots.lora_a[slot], slots.lora_b[slot], slots.dora[slot]
                if a is None or b is None:
                    self._ptrs_np[:, i, slot] = 0
                    self._ranks_np[i, slot] = 0
                    continue
                rank = a.shape[0]
                pa, pb = a.data_ptr(), b.data_ptr()
                fit &= pa % PTR_ALIGN == 0 and pb % PTR_ALIGN == 0 and rank % RANK_MULTIPLE == 0
                self._ptrs_np[0, i, slot], self._ptrs_np[1, i, slot] = pa, pb
                # DoRA's per-row scale, fp32 [out] (the epilogue reads it unhinted); 0: plain
                self._ptrs_np[2, i, slot] = g.data_ptr() if g is not None else 0
                self._ranks_np[i, slot] = rank
            self._seen[slot] = generation[slot]
            if fit:
                self._unfit.discard(slot)
            else:
                self._unfit.add(slot)
        if stale:
            self._ptrs.copy_(torch.from_numpy(self._ptrs_np))
            self._ranks.copy_(torch.from_numpy(self._ranks_np))
        return not any(slot in self._unfit for slot in used)

    def close(self) -> None:
        """Drop the graphs and the modules' graph tables."""
        self._graphs.clear()
        for slots in self._modules:
            slots.graph_table = None


def capture_decode_graphs(
    model: LlamaForCausalLM, pool: LoRAPool, shape: GraphShape, capture: Capture | None = None
) -> DecodeGraphs | None:
    """Capture the decode graphs, or None (with a log line saying why) when they cannot be."""
    probe = torch.empty(0, device=pool.device)
    backends = (attention.backend(probe), dispatch.backend(probe))
    if "torch" in backends or "native" in backends:
        log.warning(
            "CUDA graphs need the Triton attention and SGMV paths (LORAPLANE_ATTENTION, "
            "LORAPLANE_SGMV), got %s / %s: decode steps run eagerly",
            *backends,
        )
        return None
    if capture is None:
        if pool.device.type != "cuda":
            log.warning("CUDA graphs need a CUDA device: decode steps run eagerly")
            return None
        capture = cuda_capture()
    try:
        graphs = DecodeGraphs(model, pool, shape, capture)
    except Exception as e:  # any capture error: serve eagerly, say why
        for mod in model.modules():
            if isinstance(mod, LinearWithLoRA) and mod.slots is not None:
                mod.slots.graph_table = None
        log.warning("CUDA graph capture failed (%r): decode steps run eagerly", e)
        return None
    log.info("captured CUDA graphs for decode batches of %s rows", list(graphs.batch_sizes))
    return graphs
