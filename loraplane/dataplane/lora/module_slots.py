"""`ModuleSlots`: every slot's A, B, scale (and DoRA scale) for one (layer, module) of the
pool (lora/pool.py), the table a LoRA layer and its kernels read by slot id."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from loraplane.dataplane.kernels import sgmv_cpu
    from loraplane.dataplane.kernels.sgmv_torch import CheckedPair
    from loraplane.dataplane.kernels.slot_weights import SlotWeights


class ModuleSlots:
    """Every slot's A, B and scale for one (layer, module); None where a slot does not adapt it."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.lora_a: list[torch.Tensor | None] = [None] * num_slots  # slot -> [r, in]
        # slot -> [out, r]; on a pool with b_transposed, the transpose of a dense [r, out]
        self.lora_b: list[torch.Tensor | None] = [None] * num_slots
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)  # [num_slots]
        # the CPU kernel's per-slot memo of checked shapes (sgmv_torch.lora_apply_grouped)
        self.checked: list[CheckedPair | None] = [None] * num_slots
        # the slot table CUDA graphs read (cuda_graphs.py keeps it current), None without them
        self.graph_table: SlotWeights | None = None
        # the native CPU kernel's slot table (sgmv_cpu.lora_apply makes it on first use)
        self.native: sgmv_cpu.NativeTable | None = None
        # DoRA: slot -> its per-row scale g [out] fp32 (lora/dora.py), None for plain LoRA;
        # bit k of dora_mask set when slot k has one
        self.dora: list[torch.Tensor | None] = [None] * num_slots
        self.dora_mask = 0
        # the base projection the LoRA layer wraps (install_lora): DoRA's norm reads its weight
        self.base: nn.Module | None = None
        # ||W_i||^2 per row of that weight [out] fp64, once a DoRA adapter needed it (every
        # later one starts from it: lora/dora.py), and the weight's fingerprint
        # (dora.base_print: the norm cache's key)
        self.base_sq: torch.Tensor | None = None
        self.base_print: bytes | None = None

    def clear(self, slot: int) -> None:
        """Forget the slot's tensors (the pool frees its buffer)."""
        self.lora_a[slot] = None
        self.lora_b[slot] = None
        self.checked[slot] = None
        self.dora[slot] = None
        self.dora_mask &= ~(1 << slot)
        self.scales[slot] = 0.0
        if self.native is not None:
            self.native.forget(slot)
