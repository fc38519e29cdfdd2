"""LoRA on a mixture of experts' linears, rows grouped by (expert, adapter slot).

A sparse layer routes each token to k experts: T tokens make T * k routed rows. `route_rows`
sorts them (stably) by expert, then by the adapter slot of their token, so one expert's rows
are contiguous (its base linears run once over them, as transformers runs them) and, inside,
each adapter's rows are a segment: that adapter's A and B of that expert are read once per
segment. Rows of the base model (slot -1) sort first in each expert and get no delta.

The pool keeps one slot table per (layer, `experts.N.NAME`), the names 4.x checkpoints and
adapters use; a transformers 5 adapter of the packed experts (PEFT `target_parameters` on
`experts.gate_up_proj` / `experts.down_proj`) is split into those per-expert factors when it
is loaded (`per_expert_modules`), rank-exact: expert e's A is rows e*r..(e+1)*r of the packed
A, its B the columns e, e + E, ... of the packed B, as PEFT's ParamWrapper reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora.loader import LoadedAdapter, LoRAWeights
from loraplane.dataplane.lora.metadata import BASE_SLOT, LoRABatch
from loraplane.dataplane.lora.pool import LoRAPool, ModuleSlots

Segment = tuple[int, int, int]  # (slot, start, end): rows start:end of one expert use slot

# one expert's (gate, up, down) names per family, as its checkpoint names them
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True, slots=True)
class RoutedRows:
    """A sparse layer's routed rows, sorted by (expert, slot).

    Row n is (token `tokens[n]`, its `pairs[n] % k`-th choice); rows of expert e are
    `expert_bounds[e]:expert_bounds[e + 1]`, and `by_expert[e]` holds their adapter segments
    (slot >= 0 only), offsets relative to the expert's first row.
    """

    tokens: torch.Tensor  # [T * k] int64: each row's token
    pairs: torch.Tensor  # [T * k] int64: each row's index into the router's [T, k] choices
    expert_bounds: tuple[int, ...]  # [E + 1]
    experts_hit: tuple[int, ...]  # experts with at least one row, ascending
    by_expert: dict[int, tuple[Segment, ...]]

    def segments(self, expert: int) -> tuple[Segment, ...]:
        """The adapter segments of one expert's rows (empty: base rows only)."""
        return self.by_expert.get(expert, ())


def route_rows(
    experts: torch.Tensor,  # [T, k] int64: each token's experts
    batch: LoRABatch | None,
    num_experts: int | None = None,
) -> RoutedRows:
    """Sort the routed rows by (expert, adapter slot); `batch` None: all rows are base rows."""
    tokens_n, k = experts.shape
    device = experts.device
    flat = experts.reshape(-1)
    pairs = torch.arange(tokens_n * k, device=device)
    token_of = torch.div(pairs, k, rounding_mode="floor")
    num = num_experts if num_experts is not None else int(flat.max()) + 1 if flat.numel() else 0
    if batch is None or batch.is_empty:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num).tolist()
        slot_keys: list[int] = []
        key_counts: list[int] = []
        width = 1
    else:
        token_slot = torch.full((tokens_n,), BASE_SLOT, dtype=torch.int64, device=device)
        token_slot[batch.token_order] = batch.token_slots
        row_slot = token_slot[token_of]  # [T * k]
        if batch.static_max_seg_len is not None:
            raise ValueError("expert LoRA needs the batch's segments on the host (no CUDA graph)")
        width = max(batch.seg_slots) + 2  # slot + 1 in 0..width-1
        key = flat * width + (row_slot + 1)
        order = torch.argsort(key, stable=True)
        keys, kcounts = torch.unique_consecutive(key[order], return_counts=True)
        slot_keys, key_counts = keys.tolist(), kcounts.tolist()
        counts = torch.bincount(flat, minlength=num).tolist()
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    by_expert: dict[int, list[Segment]] = {}
    pos = 0
    for key_value, count in zip(slot_keys, key_counts, strict=True):
        expert, slot = divmod(int(key_value), width)
        start = pos - bounds[expert]
        if slot > 0:
            by_expert.setdefault(expert, []).append((slot - 1, start, start + int(count)))
        pos += int(count)
    return RoutedRows(
        tokens=token_of[order],
        pairs=pairs[order],
        expert_bounds=tuple(bounds),
        experts_hit=tuple(e for e, c in enumerate(counts) if c),
        by_expert={e: tuple(s) for e, s in by_expert.items()},
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


def expert_batch(segments: Sequence[Segment], device: torch.device) -> LoRABatch:
    """One expert's adapter segments as a LoRABatch over its rows (already sorted by slot, so
    no sort): what the SGMV kernels take, each segment one (expert, adapter) group."""
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
    """The pool's slot tables of one sparse layer: [expert][gate, up, down]."""

    def __init__(self, tables: list[tuple[ModuleSlots, ModuleSlots, ModuleSlots]]) -> None:
        self.tables = tables

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
        return cls(tables)

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


def per_expert_modules(adapter: LoadedAdapter, spec: BaseModelSpec) -> LoadedAdapter:
    """`adapter` with any packed experts' factors split into per-expert ones, keyed
    (layer, `experts.N.NAME`) as the pool and 4.x adapters key them; returned as is when it
    has none. A packed `experts.gate_up_proj` becomes N's gate and up linears, which share
    its A (gate: the first half of B's rows, up: the second, as the packed parameter's rows)."""
    names = EXPERT_NAMES.get(spec.model_type)
    packed = [key for key in adapter.modules if key[1] in ("experts.gate_up_proj",
                                                           "experts.down_proj")]  # fmt: skip
    if names is None or not packed:
        return adapter
    gate, up, down = names
    experts = spec.num_experts
    modules: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), w in adapter.modules.items():
        if module not in ("experts.gate_up_proj", "experts.down_proj"):
            modules[(layer, module)] = w
            continue
        rank = w.a.shape[0] // experts
        if rank * experts != w.a.shape[0] or w.b.shape[1] != w.a.shape[0]:
            raise ValueError(
                f"layer {layer} {module}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not "
                f"split into {experts} experts"
            )
        for e in range(experts):
            a = w.a[e * rank : (e + 1) * rank].contiguous()  # [r, in]
            b = w.b[:, e::experts].contiguous()  # [out, r]
            if module == "experts.down_proj":
                modules[(layer, f"experts.{e}.{down}")] = LoRAWeights(a, b, w.scale)
                continue
            half = b.shape[0] // 2
            modules[(layer, f"experts.{e}.{gate}")] = LoRAWeights(a, b[:half].contiguous(),
                                                                  w.scale)  # fmt: skip
            modules[(layer, f"experts.{e}.{up}")] = LoRAWeights(a, b[half:].contiguous(), w.scale)
    return LoadedAdapter(adapter.source, modules, adapter.digest)
