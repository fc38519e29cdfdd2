"""LoRA on a mixture of experts' linears, rows grouped by (expert, adapter slot).

A sparse layer routes each token to k experts: T tokens make T * k routed rows. `route_rows`
sorts them (stably) by expert, then by the adapter slot of their token, so one expert's rows
are contiguous (its base linears run once over them, as transformers runs them) and, inside,
each adapter's rows are a segment: that adapter's A and B of that expert are read once per
segment. Rows of the base model (slot -1) sort first in each expert and get no delta.

Given the pool's slot count S, `route_rows` also gives every expert's adapter rows as one
LoRABatch over the layer's routed rows (`RoutedRows.batch`), segment (expert e, slot k) with
the stacked slot e * S + k; `ExpertLoRA.stacked` lays the E experts' slot tables of one linear
end to end in that order, so one SGMV call per linear does every expert of the layer (one C
call or one Triton launch, not one per expert), as the base rows of every expert skip it.

Per step, as the dense layers: a layer's batch takes the step batch's `LORAPLANE_SGMV` choice
(read once, when the step's batch was built), and with the pool's stamp (`LoRAContext.stamp`)
the stacked tables are compared with the pool's slot generations, and the kernels' slot tables
checked against the pool's tensors (`kernels/dispatch.py`), once per load or free, not at
every layer's call.

The pool keeps one slot table per (layer, `experts.N.NAME`), the names 4.x checkpoints and
adapters use; a transformers 5 adapter of the packed experts (PEFT `target_parameters` on
`experts.gate_up_proj` / `experts.down_proj`) is split into those per-expert factors when it
is loaded (`loader.per_expert_modules`), rank-exact: expert e's A is rows e*r..(e+1)*r of the packed
A, its B the columns e, e + E, ... of the packed B, as PEFT's ParamWrapper reads them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora.metadata import BASE_SLOT, LoRABatch
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.lora.pool import LoRAPool

Segment = tuple[int, int, int]  # (slot, start, end): rows start:end of one expert use slot


@dataclass(frozen=True, slots=True)
class RoutedRows:
    """A sparse layer's routed rows, sorted by (expert, slot).

    Row n is (token `tokens[n]`, its `pairs[n] % k`-th choice); rows of expert e are
    `expert_bounds[e]:expert_bounds[e + 1]`, and `segments(e)` gives their adapter segments
    (slot >= 0 only), offsets relative to the expert's first row.
    """

    tokens: torch.Tensor  # [T * k] int64: each row's token
    pairs: torch.Tensor  # [T * k] int64: each row's index into the router's [T, k] choices
    expert_bounds: tuple[int, ...]  # [E + 1]
    experts_hit: tuple[int, ...]  # experts with at least one row, ascending
    # the runs of equal (expert, slot) in row order: key expert * width + slot + 1, row count
    keys: tuple[int, ...] = ()
    key_counts: tuple[int, ...] = ()
    width: int = 1
    # every expert's adapter rows as one batch over these rows, slot e * num_slots + k for
    # slot k's rows of expert e (route_rows with num_slots, and adapter rows; else None)
    batch: LoRABatch | None = None

    @property
    def by_expert(self) -> dict[int, tuple[Segment, ...]]:
        """expert -> its adapter segments (experts with none left out)."""
        found: dict[int, list[Segment]] = {}
        pos = 0
        for key, count in zip(self.keys, self.key_counts, strict=True):
            expert, slot = divmod(key, self.width)
            if slot > 0:
                start = pos - self.expert_bounds[expert]
                found.setdefault(expert, []).append((slot - 1, start, start + count))
            pos += count
        return {e: tuple(segs) for e, segs in found.items()}

    def segments(self, expert: int) -> tuple[Segment, ...]:
        """The adapter segments of one expert's rows (empty: base rows only)."""
        return self.by_expert.get(expert, ())


def route_rows(
    experts: torch.Tensor,  # [T, k] int64: each token's experts
    batch: LoRABatch | None,
    num_experts: int | None = None,
    num_slots: int | None = None,
) -> RoutedRows:
    """Sort the routed rows by (expert, adapter slot); `batch` None: all rows are base rows.

    With `num_slots` (the pool's slot count), `RoutedRows.batch` holds the adapter rows of
    every expert as one LoRABatch (see `ExpertLoRA.stacked`). The host work is one sort and
    one copy of the runs' keys to the host, whatever the experts and adapters."""
    tokens_n, k = experts.shape
    device = experts.device
    flat = experts.reshape(-1)
    num = num_experts if num_experts is not None else int(flat.max()) + 1 if flat.numel() else 0
    counts_t = torch.bincount(flat, minlength=num)
    if batch is None or batch.is_empty:
        order = torch.argsort(flat, stable=True)
        counts = counts_t.tolist()
        keys: list[int] = []
        key_counts: list[int] = []
        width = 1
        backend = ""
    else:
        backend = batch.backend  # the step's choice, read once when it was built
        if batch.static_max_seg_len is not None:
            raise ValueError("expert LoRA needs the batch's segments on the host (no CUDA graph)")
        top = max(batch.seg_slots)
        if num_slots is not None and top >= num_slots:
            raise ValueError(f"slot {top} is not below the {num_slots} slots")
        width = (num_slots if num_slots is not None else top + 1) + 1  # slot + 1 in 0..width-1
        token_slot = torch.full((tokens_n,), BASE_SLOT, dtype=torch.int64, device=device)
        token_slot[batch.token_order] = batch.token_slots
        key = flat * width + (token_slot + 1).repeat_interleave(k)
        order = torch.argsort(key, stable=True)
        sorted_key = key[order]
        runs, run_counts = torch.unique_consecutive(sorted_key, return_counts=True)
        host = torch.cat((counts_t, runs, run_counts)).tolist()  # one copy to the host
        counts, keys, key_counts = host[:num], host[num : num + len(runs)], host[num + len(runs) :]
    bounds = list(itertools.accumulate(counts, initial=0))
    layer_batch = None
    if num_slots is not None and keys:
        adapter = [(key, count) for key, count in zip(keys, key_counts, strict=True) if key % width]
        if adapter:
            seg_slots = [key // width * num_slots + key % width - 1 for key, _ in adapter]
            seg_bounds = list(itertools.accumulate((count for _, count in adapter), initial=0))
            adapter_rows = torch.nonzero(sorted_key % width).squeeze(1)  # ascending
            row_keys = sorted_key[adapter_rows]
            layer_batch = LoRABatch(
                num_tokens=tokens_n * k,
                token_order=adapter_rows,
                seg_slots=tuple(seg_slots),
                seg_bounds=tuple(seg_bounds),
                seg_slots_t=torch.tensor(seg_slots, dtype=torch.int32, device=device),
                seg_bounds_t=torch.tensor(seg_bounds, dtype=torch.int32, device=device),
                token_slots=row_keys // width * num_slots + row_keys % width - 1,
                backend=backend,
            )
    return RoutedRows(
        tokens=torch.div(order, k, rounding_mode="floor"),
        pairs=order,
        expert_bounds=tuple(bounds),
        experts_hit=tuple(e for e, c in enumerate(counts) if c),
        keys=tuple(keys),
        key_counts=tuple(key_counts),
        width=width,
        batch=layer_batch,
    )


def expert_lora_torch(
    y: torch.Tensor,  # [R, out]: one expert's rows, updated in place
    x: torch.Tensor,  # [R, in]
    segments: Sequence[Segment],
    table: ModuleSlots,
) -> None:
    """The reference (and CPU path) of expert LoRA:

        for (slot, s, e) in segments, where table holds slot's A [r, in] and B [out, r]:
            y[s:e] += scale[slot] * (x[s:e] @ A.T) @ B.T

    A slot whose adapter does not adapt this expert's linear adds nothing."""
    for slot, start, end in segments:
        a, b = table.lora_a[slot], table.lora_b[slot]
        if a is None or b is None or end <= start:
            continue
        delta = (x[start:end] @ a.t()) @ b.t()
        y[start:end] += delta * table.scales[slot].to(delta.dtype)


def expert_batch(segments: Sequence[Segment], device: torch.device, backend: str = "") -> LoRABatch:
    """One expert's adapter segments as a LoRABatch over its rows (already sorted by slot, so
    no sort): what the SGMV kernels take, each segment one (expert, adapter) group. `backend`:
    the step batch's `LORAPLANE_SGMV` choice ("": read it now)."""
    order = [i for _, start, end in segments for i in range(start, end)]
    bounds = [0]
    slots = []
    for slot, start, end in segments:
        bounds.append(bounds[-1] + end - start)
        slots.append(slot)
    token_slots = [slot for slot, start, end in segments for _ in range(start, end)]
    num_rows = max((end for _, _, end in segments), default=0)
    return LoRABatch(
        num_tokens=num_rows,
        token_order=torch.tensor(order, dtype=torch.int64, device=device),
        seg_slots=tuple(slots),
        seg_bounds=tuple(bounds),
        seg_slots_t=torch.tensor(slots, dtype=torch.int32, device=device),
        seg_bounds_t=torch.tensor(bounds, dtype=torch.int32, device=device),
        token_slots=torch.tensor(token_slots, dtype=torch.int64, device=device),
        backend=backend,
    )


def expert_lora_apply(
    y: torch.Tensor,  # [R, out]: one expert's rows, updated in place
    x: torch.Tensor,  # [R, in]
    segments: Sequence[Segment],
    table: ModuleSlots,
    batch: LoRABatch | None = None,  # expert_batch(segments): built once per expert, if given
) -> None:
    """`expert_lora_torch`'s meaning on any device, through the SGMV dispatch the attention
    LoRA layers use (`kernels/dispatch.py`): the Triton kernels on CUDA, one launch over all
    of an expert's (expert, adapter) segments; the native C kernel or torch on the CPU."""
    if not any(table.lora_a[slot] is not None for slot, _, _ in segments):
        return
    dispatch.lora_apply(y, x, batch or expert_batch(segments, x.device), table)


class ExpertLoRA:
    """The pool's slot tables of one sparse layer: [expert][gate, up, down]; and per linear,
    the experts' tables stacked end to end (`stacked`) for a whole layer's SGMV call."""

    def __init__(
        self,
        tables: list[tuple[ModuleSlots, ModuleSlots, ModuleSlots]],
        generation: list[int] | None = None,
    ) -> None:
        self.tables = tables
        self.num_slots = len(tables[0][0].lora_a) if tables else 0
        device = tables[0][0].scales.device if tables else torch.device("cpu")
        size = len(tables) * self.num_slots
        # kept between steps: their kernels' memos (checked shapes, the native slot table,
        # the Triton pointer table) stay valid while the pool's tensors stay the same
        self._stacked = tuple(ModuleSlots(size, device) for _ in range(3))
        # the pool's per-slot load/free counts (LoRAPool.slot_generation), and what they
        # were when the stacked tables were last filled; None: refilled at every call
        self._generation = generation
        self._filled: list[int] | None = None
        self._filled_stamp: int | None = None  # the pool's stamp they were last brought to

    @classmethod
    def from_pool(
        cls, pool: LoRAPool, layer: int, num_experts: int, names: Sequence[str]
    ) -> ExpertLoRA:
        """Look up `experts.N.NAME` of `layer` for every expert N and name (gate, up, down)."""
        gate, up, down = names
        tables = [
            (
                pool.module_slots(layer, f"experts.{e}.{gate}"),
                pool.module_slots(layer, f"experts.{e}.{up}"),
                pool.module_slots(layer, f"experts.{e}.{down}"),
            )
            for e in range(num_experts)
        ]
        return cls(tables, pool.slot_generation)

    def apply(
        self,
        y: torch.Tensor,  # [R, out]
        x: torch.Tensor,  # [R, in]
        expert: int,
        proj: int,  # 0 gate, 1 up, 2 down
        segments: Sequence[Segment],
        batch: LoRABatch | None = None,
    ) -> None:
        """Add the adapters' deltas of one expert's linear to its rows (`batch`: the
        segments as `expert_batch` gives them, shared by the expert's three linears)."""
        expert_lora_apply(y, x, segments, self.tables[expert][proj], batch)

    def stacked(self, proj: int, stamp: int | None = None) -> ModuleSlots:
        """Linear `proj`'s (0 gate, 1 up, 2 down) slot tables of every expert, end to end:
        entry e * num_slots + k is expert e's slot k, as the pool holds it now (the entries of
        a slot loaded or freed since the last call are refilled, E per linear). With the
        pool's `stamp` (the sum of its slot generations, `LoRAContext.stamp`), nothing is
        compared while it stays what it was at the last call."""
        if stamp is not None and stamp == self._filled_stamp and self._generation is not None:
            return self._stacked[proj]
        generation, filled = self._generation, self._filled
        if generation is None or filled is None:
            changed: Sequence[int] = range(self.num_slots)
        elif filled != generation:
            changed = [k for k, (g, f) in enumerate(zip(generation, filled, strict=True)) if g != f]
        else:
            changed = ()
        if changed:
            for p in range(3):
                self._fill(p, changed)
            self._filled = list(generation) if generation is not None else None
        self._filled_stamp = stamp
        return self._stacked[proj]

    def _fill(self, proj: int, slots: Sequence[int]) -> None:
        table, size = self._stacked[proj], self.num_slots
        parts = [t[proj] for t in self.tables]
        for e, part in enumerate(parts):
            for k in slots:
                i = e * size + k
                a, b = part.lora_a[k], part.lora_b[k]
                if a is not table.lora_a[i] or b is not table.lora_b[i]:
                    table.clear(i)  # drops its memos (and the old tensors they hold)
                    table.lora_a[i], table.lora_b[i] = a, b
        if parts:
            torch.cat([p.scales for p in parts], out=table.scales)

    def apply_layer(
        self,
        y: torch.Tensor,  # [R, out]: the layer's routed rows, sorted by (expert, slot)
        x: torch.Tensor,  # [R, in]
        proj: int,  # 0 gate, 1 up, 2 down
        batch: LoRABatch,  # RoutedRows.batch (route_rows with num_slots=self.num_slots)
        stamp: int | None = None,  # the pool's stamp for this step (LoRAContext.stamp)
    ) -> None:
        """Add every expert's adapter deltas of one linear to the layer's rows, in one SGMV
        call: the meaning of `apply` for each expert's rows and segments. With `stamp` (used
        only when the tables follow a pool's generations: `from_pool`), the caller promises
        the pool's slots changed only through the pool (which moves the stamp): the stacked
        tables and their kernels' slot tables are checked once per stamp."""
        if stamp is None or stamp < 0 or self._generation is None:
            stamp = None  # not activated (LoRAContext.stamp -1), or tables of no pool
        dispatch.lora_apply(y, x, batch, self.stacked(proj, stamp), stamp)
