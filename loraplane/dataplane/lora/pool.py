"""The device-resident adapter pool: slots, each holding one adapter at its own rank.

A slot is only a row in per-(layer, module) tables, so slots are cheap: the pool has as many
as one step can use (`EngineConfig.lora_slots`), and device memory, not a count, limits what
it holds (the manager keeps `bytes_used` within the adapter memory budget). With an arena
(`lora/arena.py`, `attach_arena`) a slot's weights live in KV cache blocks instead of buffers
of their own, and `load` answers False when no run of blocks is free.

Rank-exact: a slot's memory is one buffer sized to its adapter's own A and B tensors (vLLM
pads every slot to max_lora_rank instead), so a rank-8 adapter costs an eighth of a rank-64
one. Where the host copy already has the slot's device and dtype (CPU serving), the slot reads
it in place: no second copy, and no second set of bytes. The LoRA layers read the pool
through `ModuleSlots` (lora/module_slots.py), one per (layer, module), whose per-slot lists
the kernels index by slot id.

A DoRA adapter's slot also holds, per module, its per-row scale g = m / ||W + s B A|| ([out],
fp32; lora/dora.py), computed from the base weight W (the LoRA layers register their base
layer with their table: `install_lora`) when the host copy is made, on a loader thread
(`host_form`, lora/dora_cache.py, which also keeps it per node): filling the slot only copies
g, or on CPU reads it in place. Its bytes count with the slot's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from loraplane.adapters.base_model import SUPPORTED_MODULES, BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.dataplane.devices import torch_device
from loraplane.dataplane.lora import dora, dora_cache, host_form
from loraplane.dataplane.lora.dora_slots import DoRASlots
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.lora.weights import LoadedAdapter

if TYPE_CHECKING:
    from loraplane.dataplane.lora.arena import KVArena, Placement


# Phi-3 / Phi-4 checkpoints, and so the decoder serving them and their adapters, keep q/k/v
# and gate/up fused (models/llama.py)
FUSED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def engine_modules(spec: BaseModelSpec) -> tuple[str, ...]:
    """The projections of a decoder layer the engine's model of this base has."""
    return FUSED_MODULES if spec.model_type == "phi3" else SUPPORTED_MODULES


def layer_engine_modules(spec: BaseModelSpec, layer: int) -> tuple[str, ...]:
    """The adaptable linears of decoder layer `layer`: a sparse layer's attention and each
    expert's, `experts.N.NAME` (lora/experts.py), else `engine_modules`."""
    return spec.layer_modules(layer) if spec.is_moe_layer(layer) else engine_modules(spec)


class LoRAPool:
    """Fixed slots on the model's device; the engine's cache tiers decide what goes where.

    `b_transposed` keeps each B as the transpose of a dense [r, out] tensor, the layout the
    CPU path's expand (native or torch SGMV) reads fastest (a token's update is a sum of r
    contiguous rows of B^T): 10-14% less time in the LoRA layers of a step over 42 adapters
    (`benchmarks/lora_cpu.py`). The Triton kernels want B dense as [out, r], the default. The
    caller that picks the kernels decides (the engine's: `dispatch.b_transposed`, in
    model_step.py); the pool knows no kernel."""

    def __init__(
        self,
        num_slots: int,
        model_spec: BaseModelSpec,
        dtype: torch.dtype,
        device: torch.device | str,
        b_transposed: bool = False,
        norm_cache: dora_cache.NormCache | None = None,
        summed: frozenset[str] = frozenset(),
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.spec = model_spec
        self.dtype = dtype
        self.device = torch_device(device)
        self.b_transposed = b_transposed
        # DoRA's g per adapter, kept (in memory only unless given a folder): lora/dora_cache.py
        self.norm_cache = norm_cache if norm_cache is not None else dora_cache.NormCache()
        self._modules = {
            (layer, module): ModuleSlots(num_slots, self.device)
            for layer in range(model_spec.num_layers)
            for module in layer_engine_modules(model_spec, layer)
        }
        # slot -> its storage: one flat buffer, or the host copy's tensors read in place
        self._buffers: list[list[torch.Tensor] | None] = [None] * num_slots
        self._bytes = [0] * num_slots  # slot -> device bytes of its adapter
        self._free = set(range(num_slots))
        self.bytes_used = 0  # device bytes of all loaded adapters
        self.arena: KVArena | None = None
        self._placements: list[Placement | None] = [None] * num_slots
        # slot -> how many times it was filled or emptied: its tensors change with this
        # number, so a copy of its pointers (a CUDA graph's slot table) knows when to refresh
        self.slot_generation = [0] * num_slots
        # DoRA's g per slot; under tensor parallelism `summed` names the modules (o_proj,
        # down_proj) whose g is summed over the ranks when an adapter takes a slot
        self.dora_slots = DoRASlots(self._modules, self.device, summed)

    @property
    def modules(self) -> dict[tuple[int, str], ModuleSlots]:
        """Every (layer, module)'s slot table."""
        return self._modules

    def attach_arena(self, arena: KVArena) -> None:
        """Keep adapters in KV cache blocks from now on (before any adapter is loaded)."""
        if self.bytes_used or len(self._free) != self.num_slots:
            raise RuntimeError("attach the arena before loading adapters")
        self.arena = arena

    def module_slots(self, layer: int, module: str) -> ModuleSlots:
        """The slot table the LoRA layer at (layer, module) reads."""
        try:
            return self._modules[(layer, module)]
        except KeyError:
            raise ValueError(f"the pool has no LoRA module {module!r} in layer {layer}") from None

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in 0..{self.num_slots - 1}, got {slot}")

    def bytes_needed(self, adapter: LoadedAdapter) -> int:
        """Device bytes `adapter` will take in this pool's dtype (for byte budgets), a DoRA
        adapter's per-row scales (fp32, beside the arena's blocks when there is one)
        included."""
        scales = 4 * sum(w.b.shape[0] for w in adapter.modules.values() if w.magnitude is not None)
        if self.arena is not None:
            return self.arena.blocks_for(adapter) * self.arena.block_bytes + scales
        elements = sum(w.a.numel() + w.b.numel() for w in adapter.modules.values())
        return elements * torch.empty(0, dtype=self.dtype).element_size() + scales

    def check_dora(self, adapter: LoadedAdapter) -> None:
        """AdapterRejected (DoRANotSupported) when `adapter` is DoRA and a module it adapts
        cannot serve DoRA (its base projection quantized, or not registered). A host copy's
        modules with their g (`host_form` made them, after this check) are not checked again:
        filling a slot does not pay for it."""
        for (layer, module), w in adapter.modules.items():
            table = self._modules.get((layer, module))
            if w.magnitude is None or table is None or isinstance(w, dora.DoRAWeights):
                continue
            why = dora.refusal(table.base)
            if why is not None:
                raise AdapterRejected(
                    ReasonCode.DORA_NOT_SUPPORTED,
                    f"DoRA adapter on layer {layer} {module} cannot be served: {why}",
                )

    @property
    def transposes_b(self) -> bool:
        """True when host copies and slots hold B transposed (`b_transposed`, unless an arena
        lays out its own copies): the layout a tensor-parallel worker's parts take too."""
        return self.b_transposed and self.arena is None

    def host_form(self, adapter: LoadedAdapter) -> LoadedAdapter:
        """`adapter` in this pool's dtype and layout, in one host buffer (lora/host_form.py),
        a DoRA module with its g (lora/dora_cache.py: read from `norm_cache` or computed on
        this pool's device): what the loader threads hand over, so that `load` reads it in
        place on CPU and copies it without conversion on CUDA, and the engine's step does
        none of that work."""
        self.check_dora(adapter)
        cuda = self.device.type == "cuda"
        host = host_form.convert(adapter, self.dtype, transposed=self.transposes_b, cuda=cuda)
        return dora_cache.with_norms(host, self._modules, self.dtype, self.norm_cache, pin=cuda,
                                     skip=self.dora_slots.is_summed)  # fmt: skip

    def load(self, slot: int, adapter: LoadedAdapter, at: int | None = None) -> bool:
        """Put `adapter` in a free slot, at its own ranks, in the pool's dtype and device (a
        copy, unless the host copy already is that: then it is read in place). With an arena,
        a copy into KV blocks; False when no run of blocks is free now. A DoRA adapter's
        per-row scales come with its host copy (`host_form`) and are copied (`_place_dora`);
        only an adapter not made by `host_form` has them computed here. `at`: the first block
        of the run rank 0 placed the adapter in (a tensor-parallel worker's arena)."""
        self._check_slot(slot)
        self.check_dora(adapter)
        if self._buffers[slot] is not None:
            raise ValueError(f"slot {slot} already holds an adapter; free it first")
        for (layer, module), w in adapter.modules.items():
            if (layer, module) not in self._modules:
                raise ValueError(f"adapter adapts {module!r} in layer {layer}: not in this model")
            fan_in, fan_out = self.spec.module_shape(module)
            if w.a.shape != (w.rank, fan_in) or w.b.shape != (fan_out, w.rank):
                raise ValueError(
                    f"layer {layer} {module}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not "
                    f"fit in_features {fan_in}, out_features {fan_out}"
                )
        if self.arena is not None:
            placement = self.arena.place(adapter, at)
            if placement is None:
                return False
            for (layer, module), w in adapter.modules.items():
                table = self._modules[(layer, module)]
                table.lora_a[slot], table.lora_b[slot] = placement.views[(layer, module)]
                table.scales[slot] = w.scale
            self._placements[slot] = placement
            scales = self._place_dora(slot, adapter)
            nbytes = placement.num_blocks * self.arena.block_bytes
            self._take(slot, scales, nbytes + sum(g.nbytes for g in scales))
            return True
        tensors = [t for w in adapter.modules.values() for t in (w.a, w.b)]
        if all(self._can_share(t) for t in tensors):
            # The host copy already is what a slot would hold (same device and dtype): the
            # slot reads it in place. Host copies are never written, and the slot keeps them
            # alive after the host tier drops them.
            for (layer, module), w in adapter.modules.items():
                table = self._modules[(layer, module)]
                table.lora_a[slot], table.lora_b[slot] = w.a, w.b
                table.scales[slot] = w.scale
            self._take(slot, tensors + self._place_dora(slot, adapter))
            return True
        elements = sum(t.numel() for t in tensors)
        buffer = torch.empty(elements, dtype=self.dtype, device=self.device)
        offset = 0
        for (layer, module), w in adapter.modules.items():
            views = []
            for t in (w.a, w.b):
                view = buffer[offset : offset + t.numel()].view(t.shape)
                view.copy_(t, non_blocking=True)  # pinned host -> device: queued on the stream
                views.append(view)
                offset += t.numel()
            table = self._modules[(layer, module)]
            table.lora_a[slot], table.lora_b[slot] = views
            table.scales[slot] = w.scale
        self._take(slot, [buffer, *self._place_dora(slot, adapter)])
        return True

    def _place_dora(self, slot: int, adapter: LoadedAdapter) -> list[torch.Tensor]:
        """The slot's DoRA scales set in the tables (lora/dora_slots.py)."""
        return self.dora_slots.place(slot, adapter)

    def sync_norms(
        self, slots: list[int], all_reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Sum the DoRA g of split rows of `slots` over the ranks (lora/dora_slots.py)."""
        self.dora_slots.sync_norms(slots, all_reduce)

    @property
    def pending_norms(self) -> set[int]:
        """Slots whose g of split rows waits for `sync_norms`."""
        return self.dora_slots.pending

    def _take(self, slot: int, storage: list[torch.Tensor], nbytes: int | None = None) -> None:
        self.slot_generation[slot] += 1
        self._buffers[slot] = storage
        self._bytes[slot] = (
            nbytes if nbytes is not None else sum(t.numel() * t.element_size() for t in storage)
        )
        self.bytes_used += self._bytes[slot]
        self._free.discard(slot)

    def _can_share(self, t: torch.Tensor) -> bool:
        dense = t.is_contiguous() or (self.transposes_b and t.t().is_contiguous())
        return dense and t.device == self.device and t.dtype == self.dtype

    def free(self, slot: int) -> None:
        """Release the slot's memory; its tokens must no longer be scheduled."""
        self._check_slot(slot)
        if self._buffers[slot] is None:
            return
        self.slot_generation[slot] += 1
        for table in self._modules.values():
            table.clear(slot)
        self.dora_slots.free(slot)
        placement, self._placements[slot] = self._placements[slot], None
        if placement is not None and self.arena is not None:
            self.arena.free(placement)
        self._buffers[slot] = None
        self.bytes_used -= self._bytes[slot]
        self._bytes[slot] = 0
        self._free.add(slot)

    def is_loaded(self, slot: int) -> bool:
        """True when `slot` is a valid slot holding an adapter."""
        return 0 <= slot < self.num_slots and self._buffers[slot] is not None

    def free_slots(self) -> list[int]:
        """Slots holding no adapter, lowest first."""
        return sorted(self._free)

    def free_slot(self) -> int | None:
        """The lowest free slot, or None when every slot holds an adapter."""
        return min(self._free) if self._free else None

    def placement(self, slot: int) -> Placement | None:
        """The run of KV blocks the slot's adapter lies in (with an arena), else None."""
        self._check_slot(slot)
        return self._placements[slot]

    def slot_bytes(self, slot: int) -> int:
        """Device bytes the slot's adapter occupies (0 when free)."""
        self._check_slot(slot)
        return self._bytes[slot]
