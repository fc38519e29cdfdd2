"""Per-step LoRA metadata: which adapter slot each token uses, grouped into segments.

Tokens are stably sorted by slot and cut into segments of equal slot, so each adapter's A and B
are read once per segment (SGMV), not once per token. Base-model tokens (slot -1) are left out
entirely. Built once per step on the host and shared by every LoRA layer of the model.

Everything a LoRA launch needs beyond the segments is computed here, once per step, so the
layers do no per-call work that grows with the segments and read no environment: the longest
segment, the launch rule (SGMV or BGMV, `kernels/launch.py`), the `LORAPLANE_SGMV` choice and
a bit mask of the slots the step uses (checked against a module's targeted slots in O(1)).
The batches derived from the step's (each sparse layer's routed rows, `lora/experts.py`) take
the step's `LORAPLANE_SGMV` choice instead of reading it again.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplane.dataplane.kernels.backends import SGMV_BACKENDS, SGMV_ENV, read_choice
from loraplane.dataplane.kernels.launch import BGMV, choose_launch

BASE_SLOT = -1


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """Segments of a flat batch's tokens by adapter slot.

    Segment s covers `token_order[seg_bounds[s]:seg_bounds[s + 1]]`, all using slot
    `seg_slots[s]`. The host tuples drive the torch path; the `*_t` tensors, on the model's
    device, are what kernels read.
    """

    num_tokens: int  # T: tokens in the step, base tokens included
    token_order: torch.Tensor  # [N] int64: indices of adapter tokens, sorted by slot (stable)
    seg_slots: tuple[int, ...]  # [S] slot of each segment, ascending
    seg_bounds: tuple[int, ...]  # [S + 1] segment offsets into token_order
    seg_slots_t: torch.Tensor  # [S] int32
    seg_bounds_t: torch.Tensor  # [S + 1] int32
    token_slots: torch.Tensor  # [N] int64: the slot of each token of token_order
    # Set only for a batch a CUDA graph is captured with (cuda_graphs.py): its tokens live
    # on the device alone (the tensors are static buffers refilled before each replay, the
    # host tuples are empty; token_slots -1 past the step's own tokens) and every launch is a
    # BGMV one sized for this many tokens (the graph's rows)
    static_max_seg_len: int | None = None
    # LORAPLANE_SGMV (auto, native, torch, ...): read here when the batch is built, unless
    # given: a batch made from the step's (a sparse layer's routed rows) takes the step's
    backend: str = ""
    # computed when the batch is built (once per step), read by every LoRA layer:
    max_seg_len: int = field(init=False)  # the longest segment (a static batch: its rows)
    launch: str = field(init=False)  # "sgmv" or "bgmv" (kernels/launch.py; static: bgmv)
    slot_mask: int = field(init=False)  # bit k set when a segment uses slot k
    # the native CPU kernel's per-step arguments (sgmv_cpu.lora_apply fills it on first use)
    native_args: tuple[int, ...] | None = field(init=False, default=None, repr=False)
    # the same as the int64 words the fused linear-and-LoRA call reads, and their address
    # (set with native_args where the kernel takes the batch: cpu_linear.apply_lora)
    native_step: tuple[Any, int] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        bounds = self.seg_bounds
        if self.static_max_seg_len is not None:
            longest, launch = self.static_max_seg_len, BGMV
        else:
            longest = int(max(map(operator.sub, bounds[1:], bounds[:-1]), default=0))
            launch = choose_launch(len(self.seg_slots), bounds[-1], longest)
        mask = 0
        for slot in self.seg_slots:
            mask |= 1 << slot
        object.__setattr__(self, "max_seg_len", longest)
        object.__setattr__(self, "launch", launch)
        if not self.backend:
            object.__setattr__(self, "backend", read_choice(SGMV_ENV, SGMV_BACKENDS))
        object.__setattr__(self, "slot_mask", mask)

    @classmethod
    def from_token_slots(
        cls, token_slots: torch.Tensor | Sequence[int], device: torch.device | str = "cpu"
    ) -> LoRABatch:
        """Group tokens by slot; `token_slots[t]` is token t's slot, or -1 for the base model."""
        slots = torch.as_tensor(token_slots, dtype=torch.int64).cpu()
        if slots.dim() != 1:
            raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(slots.shape)}")
        if slots.numel() and int(slots.min()) < BASE_SLOT:
            raise ValueError(f"token_slots must be >= {BASE_SLOT}, got {int(slots.min())}")
        order = torch.argsort(slots, stable=True)
        num_base = int((slots == BASE_SLOT).sum())
        order = order[num_base:]  # -1 sorts first: drop the base tokens
        sorted_slots = slots[order]
        seg_slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        bounds = [0]
        for count in counts.tolist():
            bounds.append(bounds[-1] + int(count))
        return cls(
            num_tokens=int(slots.numel()),
            token_order=order.to(device),
            seg_slots=tuple(int(s) for s in seg_slots.tolist()),
            seg_bounds=tuple(bounds),
            seg_slots_t=seg_slots.to(device=device, dtype=torch.int32),
            seg_bounds_t=torch.tensor(bounds, dtype=torch.int32, device=device),
            token_slots=sorted_slots.to(device),
        )

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        """(slot, start, end) per segment, start/end indexing token_order."""
        b = self.seg_bounds
        return [(slot, b[i], b[i + 1]) for i, slot in enumerate(self.seg_slots)]

    @property
    def num_lora_tokens(self) -> int:
        """N: tokens that use an adapter."""
        return self.seg_bounds[-1]

    @property
    def is_empty(self) -> bool:
        """True when no token uses an adapter (LoRA layers then add nothing); never for a
        static batch, whose contents the host does not know."""
        return not self.seg_slots and self.static_max_seg_len is None
