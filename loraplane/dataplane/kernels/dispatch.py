"""Pick the SGMV implementation per call: Triton on CUDA tensors, the native C kernel or torch
on the CPU.

`LORAPLANE_SGMV` overrides the choice (read at each call, so tests can set it):
`native` (the C kernel of `sgmv_cpu`, CPU fp32 only), `torch`, `triton` (the unfused shrink +
expand pair), `triton-fused` (one launch), or `auto` (the default: Triton on CUDA, the native
kernel on CPU fp32 where it builds, torch otherwise). `triton` on CPU tensors needs
`TRITON_INTERPRET=1` set before Triton is first imported; this module imports Triton only when
a Triton path is taken.

The Triton launchers read per-slot pointer tables (`SlotWeights`) instead of the pool's Python
lists; `slot_weights` builds one per `ModuleSlots` and caches it until a slot the batch uses
has changed (a load or free in the pool gives the slot new tensors).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from loraplane.dataplane.kernels import sgmv_cpu, sgmv_torch
from loraplane.dataplane.kernels.backends import choose
from loraplane.dataplane.kernels.slot_weights import SlotWeights

if TYPE_CHECKING:  # annotations only: `lora.layers` imports this module
    from loraplane.dataplane.lora.metadata import LoRABatch
    from loraplane.dataplane.lora.pool import ModuleSlots

ENV = "LORAPLANE_SGMV"
BACKENDS = ("auto", "native", "torch", "triton", "triton-fused")

_tables: weakref.WeakKeyDictionary[ModuleSlots, SlotWeights] = weakref.WeakKeyDictionary()


def backend(x: torch.Tensor) -> str:
    """The implementation `lora_apply` uses for input `x`: native, torch, triton or
    triton-fused."""
    return choose(ENV, BACKENDS, x, cpu_auto=_cpu_auto)


def _cpu_auto(x: torch.Tensor) -> str:
    """`auto` off CUDA: the native kernel for CPU fp32 where it builds, else torch."""
    cpu_fp32 = x.device.type == "cpu" and x.dtype == torch.float32
    return "native" if cpu_fp32 and sgmv_cpu.library() is not None else "torch"


def _is_current(table: SlotWeights, slots: ModuleSlots, used: Sequence[int]) -> bool:
    """True when the table's entries for the slots in `used` match the pool's tensors."""
    for k in used:
        a, b = slots.lora_a[k], slots.lora_b[k]
        if a is None or b is None:
            if table.ranks_host[k] != 0:
                return False
        elif (
            a.data_ptr() != table.a_ptrs_host[k]
            or b.data_ptr() != table.b_ptrs_host[k]
            or a.shape[0] != table.ranks_host[k]
        ):
            return False
    return True


def slot_weights(
    slots: ModuleSlots, used: Sequence[int], dtype: torch.dtype, device: torch.device
) -> SlotWeights:
    """The pointer table of `slots`, rebuilt only when a slot in `used` changed since the last.

    Entries of slots not in `used` may be stale (their adapter freed); the kernels read only the
    entries of the segments' slots, which are checked here on every call (O(len(used))).
    """
    table = _tables.get(slots)
    if (
        table is None
        or table.dtype != dtype
        or table.device != device
        or table.num_slots != len(slots.lora_a)
        or not _is_current(table, slots, used)
    ):
        fresh = SlotWeights.build(slots.lora_a, slots.lora_b, dtype, device)
        if table is not None and table.num_slots == fresh.num_slots and table.device == device:
            # refill the old device tensors in place: their addresses stay valid for anything
            # captured against them (a CUDA graph), and nothing is allocated per reload
            for old, new in (
                (table.a_ptrs, fresh.a_ptrs),
                (table.b_ptrs, fresh.b_ptrs),
                (table.ranks, fresh.ranks),
            ):
                old.copy_(new)
            fresh = dataclasses.replace(
                fresh, a_ptrs=table.a_ptrs, b_ptrs=table.b_ptrs, ranks=table.ranks
            )
        table = _tables[slots] = fresh
    return table


def lora_apply(
    y: torch.Tensor,  # [T, out], the base layer's output; updated in place
    x: torch.Tensor,  # [T, in], the base layer's input
    batch: LoRABatch,  # the step's segments, tensors on x's device
    slots: ModuleSlots,  # this (layer, module)'s per-slot A, B and scales
) -> torch.Tensor:  # y
    """y[t] += scales[k] * B_k (A_k x[t]) for every adapter token t of slot k, on any device.

    Same meaning as `sgmv_torch.lora_apply`; returns y untouched, launching nothing, when no
    token uses a slot whose adapter targets this module.
    """
    if batch.static_max_seg_len is not None:
        return _lora_apply_static(y, x, batch, slots)
    if batch.is_empty or not any(slots.lora_a[k] is not None for k in batch.seg_slots):
        return y
    name = backend(x)
    if name == "native" and sgmv_cpu.lora_apply(y, x, batch, slots):
        return y
    if name in ("torch", "native"):  # native: tensors the kernel does not take
        return sgmv_torch.lora_apply_grouped(
            y,
            x,
            batch.token_order,
            batch.token_slots,
            batch.seg_slots,
            batch.seg_bounds,
            slots.lora_a,
            slots.lora_b,
            slots.scales,
            slots.checked,
        )
    from loraplane.dataplane.kernels import sgmv_triton

    weights = slot_weights(slots, batch.seg_slots, x.dtype, x.device)
    bounds = batch.seg_bounds
    max_seg_len = max(end - start for start, end in itertools.pairwise(bounds))
    return sgmv_triton.lora_apply(
        y,
        x.contiguous(),
        batch.token_order,
        batch.seg_slots_t,
        batch.seg_bounds_t,
        weights,
        slots.scales,
        max_seg_len,
        fused=name == "triton-fused",
    )


def _lora_apply_static(
    y: torch.Tensor, x: torch.Tensor, batch: LoRABatch, slots: ModuleSlots
) -> torch.Tensor:
    """`lora_apply` for a batch captured in a CUDA graph: always the Triton kernels, reading
    the slot table the graph owner keeps current (`slots.graph_table`), launched for
    `batch.static_max_seg_len`-token segments whatever the segments hold at replay."""
    name = backend(x)
    if name in ("torch", "native") or slots.graph_table is None:
        raise RuntimeError(
            "a static (CUDA graph) LoRA batch needs the Triton SGMV kernels and a graph slot "
            f"table; backend {name!r}, table {'set' if slots.graph_table else 'missing'}"
        )
    from loraplane.dataplane.kernels import sgmv_triton

    assert batch.static_max_seg_len is not None
    return sgmv_triton.lora_apply(
        y,
        x.contiguous(),
        batch.token_order,
        batch.seg_slots_t,
        batch.seg_bounds_t,
        slots.graph_table,
        slots.scales,
        batch.static_max_seg_len,
        fused=name == "triton-fused",
    )
