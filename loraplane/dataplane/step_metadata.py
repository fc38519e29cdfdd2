"""A step's inputs, built once on the host and copied to the device in one transfer.

The model runner describes each row of a step (its new tokens, context length, block table and
adapter slot) as host lists; `build_step` turns them, with numpy and no per-sequence tensor op,
into everything the layers read: token ids, RoPE positions, the attention metadata (query
offsets, context lengths, block tables, the cache slot of each new token) and the LoRA segments
(tokens grouped by adapter slot). All the integer arrays are packed into one host buffer
(pinned on CUDA) and sent with a single non-blocking copy; the device tensors are views of it.
The host-side numbers the torch paths need travel as Python values beside the tensors, so no
layer ever reads a device tensor back (`.tolist()`, `.item()`); the LoRA launch metadata (the
longest segment, SGMV or BGMV, the `LORAPLANE_SGMV` choice) is computed when the step's
`LoRABatch` is built, once per step.

The pinned host buffer is a new one each step, from torch's caching host allocator, which
records an event on the stream of the non-blocking copy out of it and hands the block out
again only once that copy is done: the next step never writes into memory a copy still reads,
with or without a blocking read of the logits at the end of the step. (The CUDA graph path's
persistent staging buffers wait on an event of their own: `cuda_graphs.DecodeGraphs`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplane.dataplane.attention import AttentionMetadata
from loraplane.dataplane.devices import torch_device
from loraplane.dataplane.lora.metadata import BASE_SLOT, LoRABatch


@dataclass(frozen=True, slots=True)
class StepRow:
    """One row of a step: its new tokens (the last `len(tokens)` positions of a context of
    `context_len` tokens), its block table and its adapter slot (BASE_SLOT: none)."""

    tokens: Sequence[int]
    context_len: int
    block_table: Sequence[int]
    slot: int = BASE_SLOT


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What the model reads in one step (tensors on the device)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    lora: LoRABatch | None  # None when no token uses an adapter slot


@dataclass(frozen=True, slots=True)
class HostSegments:
    """A step's adapter tokens grouped by slot, on the host (int64)."""

    order: np.ndarray  # [Ta] the adapter tokens' indices, grouped by slot (stable)
    sorted_slots: np.ndarray  # [Ta] each of those tokens' slot
    seg_slots: np.ndarray  # [S] each segment's slot, ascending
    bounds: np.ndarray  # [S + 1] each segment's first index into `order`


@dataclass(frozen=True, slots=True)
class HostStep:
    """A step's integer arrays on the host (int64), before they go to the device."""

    ids: np.ndarray  # [T] token ids
    positions: np.ndarray  # [T] RoPE positions
    cu: np.ndarray  # [B + 1] query offsets
    ctx: np.ndarray  # [B] context lengths
    tables: np.ndarray  # [B, width] block tables, padded with -1
    slot_mapping: np.ndarray  # [T] each new token's cache slot
    lora: HostSegments | None  # None: no token uses an adapter slot (or none asked for)

    @property
    def width(self) -> int:
        """Block table columns."""
        return int(self.tables.shape[1])

    @property
    def has_lora(self) -> bool:
        """True when some token uses an adapter slot."""
        return self.lora is not None

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by name (flat), in the order `_to_device` packs them."""
        named = {
            "ids": self.ids, "positions": self.positions, "cu": self.cu, "ctx": self.ctx,
            "tables": self.tables.reshape(-1), "slot_mapping": self.slot_mapping,
        }  # fmt: skip
        if self.lora is not None:
            s = self.lora
            named.update(order=s.order, sorted_slots=s.sorted_slots, seg_slots=s.seg_slots,
                         bounds=s.bounds)  # fmt: skip
        return named


def host_step(rows: Sequence[StepRow], block_size: int, with_lora: bool = True) -> HostStep:
    """The step's arrays from its rows, with numpy and no per-sequence tensor op; ValueError
    for a row whose block table does not cover its context or holds a negative block id."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not rows:
        raise ValueError("a step needs at least one row")
    q_lens = np.fromiter((len(r.tokens) for r in rows), dtype=np.int64, count=len(rows))
    ctx = np.fromiter((r.context_len for r in rows), dtype=np.int64, count=len(rows))
    if (q_lens < 1).any() or (ctx < q_lens).any():
        raise ValueError("every row needs at least one new token and a context that holds them")
    width = max(1, max(len(r.block_table) for r in rows))
    tables = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):  # list copies only: one numpy row per sequence
        tables[i, : len(r.block_table)] = r.block_table
    lengths = np.fromiter((len(r.block_table) for r in rows), dtype=np.int64, count=len(rows))
    short = lengths * block_size < ctx
    if short.any() or (tables[np.arange(width) < lengths[:, None]] < 0).any():
        bad = next(i for i, r in enumerate(rows) if short[i] or min(r.block_table) < 0)
        raise ValueError(
            f"row {bad}: a block table of {lengths[bad]} blocks of {block_size} for "
            f"{int(ctx[bad])} tokens (too few, or a negative block id)"
        )
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of = np.repeat(np.arange(len(rows)), q_lens)  # [T] the row of each new token
    positions = ctx[seq_of] - (cu[1:][seq_of] - np.arange(num_tokens))  # [T]
    slot_mapping = tables[seq_of, positions // block_size] * block_size + positions % block_size
    ids = np.fromiter(
        (t for r in rows for t in r.tokens), dtype=np.int64, count=num_tokens
    )  # fmt: skip
    segments = None
    if with_lora:
        token_slots = np.repeat(
            np.fromiter((r.slot for r in rows), dtype=np.int64, count=len(rows)), q_lens
        )
        order = np.argsort(token_slots, kind="stable")
        order = order[int((token_slots == BASE_SLOT).sum()) :]  # base tokens sort first
        if order.size:
            sorted_slots = token_slots[order]
            seg_slots, counts = np.unique(sorted_slots, return_counts=True)
            bounds = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=bounds[1:])
            segments = HostSegments(order, sorted_slots, seg_slots, bounds)
    return HostStep(ids, positions, cu, ctx, tables, slot_mapping, segments)


def build_step(
    rows: Sequence[StepRow], block_size: int, device: torch.device | str, with_lora: bool = True
) -> StepInputs:
    """The step's inputs from its rows (see the module docstring); ValueError for a row whose
    block table does not cover its context or holds a negative block id."""
    device = torch_device(device)
    host = host_step(rows, block_size, with_lora)
    cu, ctx = host.cu, host.ctx
    num_tokens = int(cu[-1])
    views = _to_device(host.arrays(), device)
    attn = AttentionMetadata(
        cu_seqlens_q=views["cu"].to(torch.int32),
        context_lens=views["ctx"].to(torch.int32),
        block_tables=views["tables"].view(len(rows), host.width).to(torch.int32),
        slot_mapping=views["slot_mapping"],
        host_cu_seqlens_q=cu.tolist(),
        host_context_lens=ctx.tolist(),
    )
    lora = None
    if host.lora is not None:
        lora = LoRABatch(
            num_tokens=num_tokens,
            token_order=views["order"],
            seg_slots=tuple(host.lora.seg_slots.tolist()),
            seg_bounds=tuple(host.lora.bounds.tolist()),
            seg_slots_t=views["seg_slots"].to(torch.int32),
            seg_bounds_t=views["bounds"].to(torch.int32),
            token_slots=views["sorted_slots"],
        )
    return StepInputs(views["ids"], views["positions"], attn, lora)


def _to_device(parts: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Every int64 array in one host buffer (pinned for CUDA), one copy, then views."""
    sizes = [a.size for a in parts.values()]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    flat = host.numpy()
    offset = 0
    for array, size in zip(parts.values(), sizes, strict=True):
        flat[offset : offset + size] = array.reshape(-1)
        offset += size
    on_device = host.to(device, non_blocking=True) if device.type != "cpu" else host
    views, offset = {}, 0
    for name, size in zip(parts, sizes, strict=True):
        views[name] = on_device[offset : offset + size]
        offset += size
    return views
