"""DoRA's per-row scales g in a pool's slots (lora/dora.py says what g is).

The pool hands each DoRA module's g to the LoRA layers through its slot tables
(`ModuleSlots.dora`): the host copy's where `LoRAPool.host_form` computed it (read in place on
CPU, copied to the device in one piece where the copies lie back to back), else computed here
from the slot's A and B and the base weight.

Under tensor parallelism a column-parallel rank holds whole rows of W and computes its rows' g
alone; a row-parallel one (`summed`: o_proj, down_proj) holds a slice of every row's columns,
so its g is a placeholder until `sync_norms`: every rank computes the square of each row's
norm over its columns (`dora.norm_sq`), one all-reduce sums them, and g is written in place,
in the step that fills the slot, before its forward (the slots named by rank 0's step
message, `pending` on rank 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraplane.dataplane.lora import dora, host_form
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights

Key = tuple[int, str]  # (layer, module)


class DoRASlots:
    """The g of every DoRA module in a pool's slots."""

    def __init__(
        self, modules: dict[Key, ModuleSlots], device: torch.device, summed: frozenset[str]
    ) -> None:
        self._modules = modules
        self.device = device
        self.summed = summed
        # (slot, key) -> (m, s) of a DoRA module whose g waits for `sync_norms`
        self._late: dict[tuple[int, Key], tuple[torch.Tensor, float]] = {}
        self.pending: set[int] = set()  # slots whose summed g is not computed yet

    def is_summed(self, key: Key) -> bool:
        """Whether module `key`'s DoRA g needs every rank's slice (`summed`)."""
        return key[1].rpartition(".")[2] in self.summed

    def free(self, slot: int) -> None:
        """Forget the slot's g waiting for a sum (the tables clear their own)."""
        for late in [k for k in self._late if k[0] == slot]:
            del self._late[late]
        self.pending.discard(slot)

    def place(self, slot: int, adapter: LoadedAdapter) -> list[torch.Tensor]:
        """Each DoRA module's per-row scale g [out] (fp32, on the device), set in the tables:
        the host copy's (`host_form`), read in place on CPU, else copied in one piece where
        they lie back to back; computed here from the slot's A and B and the base weight
        only for an adapter `host_form` did not make. The list of them."""
        items = [(key, w) for key, w in adapter.modules.items() if w.magnitude is not None]
        late = [(key, w) for key, w in items if self.is_summed(key)]
        items = [(key, w) for key, w in items if not self.is_summed(key)]
        return self._place_local(slot, items) + self._place_late(slot, late)

    def _place_late(
        self, slot: int, items: list[tuple[tuple[int, str], LoRAWeights]]
    ) -> list[torch.Tensor]:
        """A g to be summed over the ranks per module (`sync_norms` fills it in place)."""
        scales = []
        for key, w in items:
            assert w.magnitude is not None
            g = torch.ones(int(w.b.shape[0]), dtype=torch.float32, device=self.device)
            table = self._modules[key]
            table.dora[slot] = g
            table.dora_mask |= 1 << slot
            self._late[(slot, key)] = (w.magnitude, w.scale)
            scales.append(g)
        if items:
            self.pending.add(slot)
        return scales

    def sync_norms(
        self, slots: list[int], all_reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Compute the summed g of `slots` (every rank calls it with the same slots, in the
        same order, rank 0 naming them: `pending`): this rank's square of each row's
        norm over its columns (`dora.norm_sq`), one all-reduce of them all, then g from the
        sums, written into the slot's g in place."""
        work = [(slot, key) for slot in slots for s, key in sorted(self._late) if s == slot]
        self.pending.difference_update(slots)
        if not work:
            return
        squares = []
        for slot, key in work:
            weight, a, b, base_sq = self._dora_inputs(slot, key)
            squares.append(dora.norm_sq(weight, a, b, self._late[(slot, key)][1], base_sq))
        summed = all_reduce(torch.cat(squares))
        at = 0
        for (slot, key), part in zip(work, squares, strict=True):
            g = self._modules[key].dora[slot]
            assert g is not None
            g.copy_(dora.scale_of(summed[at : at + part.numel()], self._late[(slot, key)][0]))
            at += part.numel()

    def _place_local(
        self, slot: int, items: list[tuple[tuple[int, str], LoRAWeights]]
    ) -> list[torch.Tensor]:
        """The g of DoRA modules this rank computes alone (see `place`)."""
        if not items:
            return []
        hosted = [w.g for _, w in items if isinstance(w, dora.DoRAWeights)]
        if len(hosted) < len(items):
            scales = [self._compute_dora(slot, key, w) for key, w in items]
        elif all(g.device == self.device for g in hosted):
            scales = hosted  # host copies are never written: the slot reads them in place
        elif (run := host_form._one_run(hosted)) is not None:
            whole, start = run
            flat = whole.to(self.device, non_blocking=True)  # pinned host -> device
            at = [int(g.storage_offset()) - start for g in hosted]
            scales = [flat[o : o + g.numel()] for g, o in zip(hosted, at, strict=True)]
        else:
            scales = [g.to(self.device, non_blocking=True) for g in hosted]
        for ((layer, module), _), g in zip(items, scales, strict=True):
            table = self._modules[(layer, module)]
            table.dora[slot] = g
            table.dora_mask |= 1 << slot
        return scales

    def _compute_dora(self, slot: int, key: tuple[int, str], w: LoRAWeights) -> torch.Tensor:
        """g [out] fp32 of one module, from the slot's A and B as placed (engine thread)."""
        if w.magnitude is None:
            raise ValueError(f"layer {key[0]} {key[1]}: no DoRA magnitude")
        weight, a, b, base_sq = self._dora_inputs(slot, key)
        return dora.dora_scale(weight, a, b, w.scale, w.magnitude, base_sq)

    def _dora_inputs(
        self, slot: int, key: tuple[int, str]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W, the slot's A and B, ||W_i||^2) of one module: this rank's, with tensor
        parallelism. The rows' norms are computed once per module, by its first DoRA slot."""
        table = self._modules[key]
        a, b = table.lora_a[slot], table.lora_b[slot]
        weight = dora.base_weight(table.base)
        if a is None or b is None or weight is None:
            raise ValueError(f"layer {key[0]} {key[1]}: no base weight for DoRA")
        if table.base_sq is None:
            table.base_sq = dora.row_norms_sq(weight)
        return weight, a, b, table.base_sq
