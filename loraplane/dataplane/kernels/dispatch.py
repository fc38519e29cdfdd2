"""Pick the LoRA implementation per call: Triton on CUDA tensors, the native C kernel or torch
on the CPU; and for Triton, the SGMV or the BGMV kernels.

`LORAPLANE_SGMV` overrides the choice: `native` (the C kernel of `sgmv_cpu`, CPU fp32 only),
`torch`, `triton` (the unfused shrink + expand pairs), `triton-fused` (one launch), or `auto`
(the default: Triton on CUDA, the native kernel on CPU fp32 where it builds, torch otherwise).
It is read once per step, when the step's `LoRABatch` is built (`LoRABatch.backend`), so tests
can set it between steps; `backend(x)` reads it now (for start-up decisions). `triton` on CPU
tensors needs `TRITON_INTERPRET=1` set before Triton is first imported; this module imports
Triton only when a Triton path is taken.

Launch rule (`kernels/launch.py`, decided once per step as `LoRABatch.launch`): BGMV (one
program per token, `bgmv_triton`) when that grid has no more programs than SGMV's (segments x
token blocks of the longest segment, `sgmv_triton`), SGMV otherwise; a batch captured in a CUDA
graph always launches BGMV over its rows, so its launches grow linearly with the batch.

Per call the work is O(1) in the step's segments when the caller passes the pool's `stamp`
(the sum of `LoRAPool.slot_generation`, taken once per step by `LoRAContext.activate`): each
module remembers, per stamp, the bit mask of slots its adapters target and whether its
pointer table (`SlotWeights`, what the Triton launchers read) was checked against the pool's
tensors; a stamp that moved (a load or free since) re-checks every slot once. A sparse
layer's stacked expert tables take the same stamp (`ExpertLoRA.apply_layer`: they are refilled
only when it moves). Without a stamp (direct callers) the check runs over the batch's slots.

DoRA (lora/dora.py): on the Triton paths the kernels rescale a DoRA slot's rows where they
store y (the table's g pointers, `SlotWeights.g_ptrs`; the base layer's `bias` left out), eager
or captured in a CUDA graph; the torch and native paths leave that to the caller
(`dora.rescale`), and `fuses_dora` says which a step's batch takes.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplane.dataplane.devices import same_device
from loraplane.dataplane.kernels import sgmv_cpu, sgmv_torch
from loraplane.dataplane.kernels.backends import SGMV_BACKENDS, SGMV_ENV, choose, resolve
from loraplane.dataplane.kernels.launch import BGMV
from loraplane.dataplane.kernels.slot_weights import SlotWeights

if TYPE_CHECKING:  # annotations only: `lora.layers` imports this module
    from loraplane.dataplane.lora.metadata import LoRABatch
    from loraplane.dataplane.lora.module_slots import ModuleSlots

ENV = SGMV_ENV
BACKENDS = SGMV_BACKENDS

_tables: weakref.WeakKeyDictionary[ModuleSlots, SlotWeights] = weakref.WeakKeyDictionary()


@dataclass(slots=True)
class _Memo:
    """What one module knows about the pool as of a stamp (see the module docstring)."""

    stamp: int = -1  # the pool stamp `targeted` was computed at
    targeted: int = 0  # bit k set when slot k's adapter adapts this module
    table_stamp: int = -1  # the stamp at which every entry of _tables[slots] was checked


_memos: weakref.WeakKeyDictionary[ModuleSlots, _Memo] = weakref.WeakKeyDictionary()


def backend(x: torch.Tensor) -> str:
    """The implementation `lora_apply` uses for input `x`: native, torch, triton or
    triton-fused."""
    return choose(ENV, BACKENDS, x, cpu_auto=_cpu_auto)


def b_transposed(dtype: torch.dtype, device: torch.device) -> bool:
    """The B layout of a LoRA pool whose slots `lora_apply` reads in `dtype` on `device`
    (`LoRAPool.b_transposed`): transposed where the native or torch path serves (its expand
    reads rows of B^T), B as stored, [out, r], where the Triton kernels do."""
    return backend(torch.empty(0, dtype=dtype, device=device)) in ("torch", "native")


def _cpu_auto(x: torch.Tensor) -> str:
    """`auto` off CUDA: the native kernel for CPU fp32 where it builds, else torch."""
    cpu_fp32 = x.device.type == "cpu" and x.dtype == torch.float32
    return "native" if cpu_fp32 and sgmv_cpu.library() is not None else "torch"


def fuses_dora(batch: LoRABatch, x: torch.Tensor) -> bool:
    """True when `lora_apply` over `batch` (input `x`) also applies DoRA's per-row scale (the
    Triton kernels' epilogue, and every captured graph's batch); False when the caller must
    (`dora.rescale`: the torch and native paths)."""
    if batch.static_max_seg_len is not None:
        return True
    return resolve(batch.backend, x, _cpu_auto) not in ("torch", "native")


def _is_current(table: SlotWeights, slots: ModuleSlots, used: Sequence[int]) -> bool:
    """True when the table's entries for the slots in `used` match the pool's tensors."""
    for k in used:
        a, b, g = slots.lora_a[k], slots.lora_b[k], slots.dora[k]
        if (g.data_ptr() if g is not None else 0) != table.g_ptrs_host[k]:
            return False
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
        or not same_device(table.device, device)
        or table.num_slots != len(slots.lora_a)
        or not _is_current(table, slots, used)
    ):
        fresh = SlotWeights.build(slots.lora_a, slots.lora_b, dtype, device, slots.dora)
        same_shape = table is not None and table.num_slots == fresh.num_slots
        if table is not None and same_shape and table.device == fresh.device:
            # refill the old device tensors in place: their addresses stay valid for anything
            # captured against them (a CUDA graph), and nothing is allocated per reload
            for old, new in (
                (table.a_ptrs, fresh.a_ptrs),
                (table.b_ptrs, fresh.b_ptrs),
                (table.ranks, fresh.ranks),
                (table.g_ptrs, fresh.g_ptrs),
            ):
                old.copy_(new)
            fresh = dataclasses.replace(
                fresh, a_ptrs=table.a_ptrs, b_ptrs=table.b_ptrs, ranks=table.ranks,
                g_ptrs=table.g_ptrs,
            )  # fmt: skip
        table = _tables[slots] = fresh
    return table


def _memo(slots: ModuleSlots, stamp: int) -> _Memo:
    """The module's memo, its targeted mask brought up to `stamp` (O(L) when it moved)."""
    memo = _memos.get(slots)
    if memo is None:
        memo = _memos[slots] = _Memo()
    if memo.stamp != stamp:
        mask = 0
        for k, a in enumerate(slots.lora_a):
            if a is not None:
                mask |= 1 << k
        memo.stamp, memo.targeted, memo.table_stamp = stamp, mask, -1
    return memo


def _step_table(slots: ModuleSlots, memo: _Memo, x: torch.Tensor) -> SlotWeights:
    """The pointer table for a stamped step: checked in full once per stamp, then trusted."""
    table = _tables.get(slots)
    if (
        table is not None
        and memo.table_stamp == memo.stamp
        and table.dtype == x.dtype
        and table.device == x.device
    ):
        return table
    table = slot_weights(slots, range(len(slots.lora_a)), x.dtype, x.device)
    memo.table_stamp = memo.stamp
    return table


def lora_apply(
    y: torch.Tensor,  # [T, out], the base layer's output; updated in place
    x: torch.Tensor,  # [T, in], the base layer's input
    batch: LoRABatch,  # the step's segments, tensors on x's device
    slots: ModuleSlots,  # this (layer, module)'s per-slot A, B and scales (and DoRA's g)
    stamp: int | None = None,  # the pool's stamp for this step (LoRAContext.stamp), if known
    bias: torch.Tensor | None = None,  # [out]: the base layer's bias (DoRA leaves it out)
) -> torch.Tensor:  # y
    """y[t] += scales[k] * B_k (A_k x[t]) for every adapter token t of slot k, on any device;
    where `fuses_dora`, also y[t] = g_k * (y[t] - bias) + bias for a DoRA slot k.

    Same meaning as `sgmv_torch.lora_apply` (plus `dora.rescale` where fused); returns y
    untouched, launching nothing, when no token uses a slot whose adapter targets this module.
    With `stamp`, the caller promises the slots' tensors changed only through the pool (which
    moves the stamp).
    """
    if batch.static_max_seg_len is not None:
        return _lora_apply_static(y, x, batch, slots, bias)
    if batch.is_empty:
        return y
    memo = _memo(slots, stamp) if stamp is not None else None
    if memo is not None:
        if not memo.targeted & batch.slot_mask:
            return y
    elif not any(slots.lora_a[k] is not None for k in batch.seg_slots):
        return y
    name = resolve(batch.backend, x, _cpu_auto)
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
    if memo is not None:
        weights = _step_table(slots, memo, x)
    else:
        weights = slot_weights(slots, batch.seg_slots, x.dtype, x.device)
    fused = name == "triton-fused"
    if batch.launch == BGMV:
        from loraplane.dataplane.kernels import bgmv_triton

        return bgmv_triton.lora_apply(
            y, x.contiguous(), batch.token_order, batch.token_slots, weights, slots.scales,
            fused=fused, bias=bias,
        )  # fmt: skip
    from loraplane.dataplane.kernels import sgmv_triton

    return sgmv_triton.lora_apply(
        y,
        x.contiguous(),
        batch.token_order,
        batch.seg_slots_t,
        batch.seg_bounds_t,
        weights,
        slots.scales,
        batch.max_seg_len,
        fused=fused,
        bias=bias,
    )


def _lora_apply_static(
    y: torch.Tensor,
    x: torch.Tensor,
    batch: LoRABatch,
    slots: ModuleSlots,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`lora_apply` for a batch captured in a CUDA graph: always the Triton BGMV kernels, one
    program per row of the graph (`batch.static_max_seg_len` rows; rows past the step's own
    have slot -1 and exit at once), reading the slot table the graph owner keeps current
    (`slots.graph_table`: A, B, ranks and DoRA's g, whose epilogue it always compiles in)."""
    name = resolve(batch.backend, x, _cpu_auto)
    if name in ("torch", "native") or slots.graph_table is None:
        raise RuntimeError(
            "a static (CUDA graph) LoRA batch needs the Triton SGMV kernels and a graph slot "
            f"table; backend {name!r}, table {'set' if slots.graph_table else 'missing'}"
        )
    from loraplane.dataplane.kernels import bgmv_triton

    return bgmv_triton.lora_apply(
        y,
        x.contiguous(),
        batch.token_order,
        batch.token_slots,
        slots.graph_table,
        slots.scales,
        fused=name == "triton-fused",
        bias=bias,
    )
