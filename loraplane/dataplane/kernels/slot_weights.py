"""Per-slot weight tables for the Triton SGMV kernels: data pointers, ranks and strides.

The pool keeps each adapter in its own buffer at its own rank (rank-exact), so a kernel cannot
index one stacked tensor by slot; it reads each slot's A and B through these tables instead,
and a DoRA slot's per-row scale g (lora/dora.py) the same way: the kernels' epilogue rescales
that slot's rows where it writes y (`g_ptrs`, 0 for a plain slot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplane.dataplane.devices import torch_device

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_ALIGN = 16  # bytes: the widest vector load the kernels' alignment hints can unlock


@dataclass(frozen=True, slots=True)
class SlotWeights:
    """Where each slot's A and B live on the device, for one (layer, module).

    Holds raw data pointers, not the tensors: the pool must keep the weights allocated while the
    table is used, and the table must be rebuilt when a slot's weights change (see
    `dispatch.slot_weights`). A slot with rank 0 does not adapt this module; a slot with
    g_ptr 0 is plain LoRA here (a DoRA slot's rows are rescaled by its g where the expand
    writes y, when `dora` compiled that epilogue in).
    """

    a_ptrs: torch.Tensor  # [L] int64: data_ptr of slot k's A [r_k, in], 0 when untargeted
    b_ptrs: torch.Tensor  # [L] int64: data_ptr of slot k's B [out, r_k], 0 when untargeted
    ranks: torch.Tensor  # [L] int32: r_k, 0 when untargeted
    a_ptrs_host: tuple[int, ...]  # [L]: the same pointers and ranks, on the host
    b_ptrs_host: tuple[int, ...]  # [L]
    ranks_host: tuple[int, ...]  # [L]
    in_features: int  # 0 when no slot is targeted
    out_features: int
    dtype: torch.dtype
    device: torch.device
    ptr_align: int  # bytes every A/B pointer is a multiple of (capped at 16)
    rank_multiple: int  # every nonzero rank is a multiple of this (capped at 8)
    g_ptrs: torch.Tensor  # [L] int64: data_ptr of slot k's DoRA g [out] fp32, 0 for none
    g_ptrs_host: tuple[int, ...]  # [L]
    # launch the kernels with the DoRA epilogue: some slot has a g (a CUDA graph's table:
    # always, as the adapters it will replay are not known when it is captured)
    dora: bool

    @property
    def num_slots(self) -> int:
        """L: the pool's slots (num_slots)."""
        return len(self.ranks_host)

    @property
    def max_rank(self) -> int:
        """R: the largest rank of any targeted slot (0 when none is)."""
        return max(self.ranks_host, default=0)

    @classmethod
    def build(
        cls,
        lora_a: Sequence[torch.Tensor | None],  # per slot: [r_k, in], or None
        lora_b: Sequence[torch.Tensor | None],  # per slot: [out, r_k], or None
        dtype: torch.dtype,
        device: torch.device | str,
        dora: Sequence[torch.Tensor | None] | None = None,  # per slot: DoRA's g [out] fp32
    ) -> SlotWeights:
        """Check every slot's A and B (contiguous, dtype, device, shapes), and a DoRA slot's g
        (contiguous fp32 [out] on the device, on a slot with A and B), and tabulate them."""
        device = torch_device(device)  # "cuda" -> "cuda:0", as tensors report
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype}")
        if len(lora_a) != len(lora_b):
            raise ValueError(f"lora_a has {len(lora_a)} slots, lora_b {len(lora_b)}")
        scales = list(dora) if dora is not None else [None] * len(lora_a)
        if len(scales) != len(lora_a):
            raise ValueError(f"dora has {len(scales)} slots, lora_a {len(lora_a)}")
        a_ptrs, b_ptrs, ranks = [], [], []
        in_features = out_features = 0
        for k, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
            if a is None or b is None:
                if a is not None or b is not None:
                    raise ValueError(f"slot {k}: lora_a and lora_b must both be set or both None")
                a_ptrs.append(0)
                b_ptrs.append(0)
                ranks.append(0)
                continue
            for name, t in ((f"lora_a[{k}]", a), (f"lora_b[{k}]", b)):
                if t.dim() != 2 or not t.is_contiguous():
                    raise ValueError(f"{name} must be a contiguous 2-D tensor")
                if t.dtype != dtype or t.device != device:
                    raise ValueError(f"{name} is {t.dtype} on {t.device}; want {dtype} on {device}")
            rank = a.shape[0]
            if rank < 1 or b.shape[1] != rank:
                raise ValueError(f"slot {k}: A {tuple(a.shape)} and B {tuple(b.shape)} disagree")
            if in_features == 0:
                in_features, out_features = a.shape[1], b.shape[0]
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise ValueError(
                    f"slot {k}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                    f"in_features {in_features}, out_features {out_features}"
                )
            a_ptrs.append(a.data_ptr())
            b_ptrs.append(b.data_ptr())
            ranks.append(rank)
        g_ptrs = [_g_ptr(k, g, lora_b[k], device) for k, g in enumerate(scales)]
        targeted = [p for p in a_ptrs + b_ptrs if p]
        nonzero = [r for r in ranks if r]
        return cls(
            a_ptrs=torch.tensor(a_ptrs, dtype=torch.int64, device=device),
            b_ptrs=torch.tensor(b_ptrs, dtype=torch.int64, device=device),
            ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
            a_ptrs_host=tuple(a_ptrs),
            b_ptrs_host=tuple(b_ptrs),
            ranks_host=tuple(ranks),
            in_features=in_features,
            out_features=out_features,
            dtype=dtype,
            device=device,
            ptr_align=math.gcd(_MAX_ALIGN, *targeted),
            rank_multiple=math.gcd(8, *nonzero),
            g_ptrs=torch.tensor(g_ptrs, dtype=torch.int64, device=device),
            g_ptrs_host=tuple(g_ptrs),
            dora=any(g_ptrs),
        )


def _g_ptr(
    k: int, g: torch.Tensor | None, b: torch.Tensor | None, device: torch.device
) -> int:  # slot k's g data_ptr, 0 without one
    if g is None:
        return 0
    if b is None:
        raise ValueError(f"dora[{k}]: a DoRA scale on a slot that does not adapt the module")
    if g.dim() != 1 or not g.is_contiguous() or g.dtype != torch.float32 or g.device != device:
        raise ValueError(
            f"dora[{k}] must be a contiguous 1-D fp32 tensor on {device}, got {g.dtype} "
            f"{tuple(g.shape)} on {g.device}"
        )
    if g.numel() != b.shape[0]:
        raise ValueError(f"dora[{k}] has {g.numel()} rows; B has {b.shape[0]}")
    return g.data_ptr()
