"""DoRA's per-row rescale as the Triton LoRA kernels' epilogue (`sgmv_triton`, `bgmv_triton`).

PEFT's DoRA layer computes y = g * (W x + s B (A x)) + b (lora/dora.py); the base layer's
output already holds b, so a DoRA row's stored value is

    y[t, n] = g_k[n] * (y[t, n] + delta[t, n] - b[n]) + b[n]      # k: the row's slot

where the kernel that stores y (the SGMV and BGMV expand and fused kernels) would store
y + delta. `dora_epilogue` does it in fp32 before the one rounding to y's dtype; g_k comes from
the slot table (`SlotWeights.g_ptrs`: slot k's g [out] fp32, 0 for a plain slot, whose rows
are stored unchanged). The epilogue is compiled in only when the table says so
(`SlotWeights.dora`: a DoRA slot in the table, or a CUDA graph's table, captured before the
adapters it replays are known), so steps without DoRA launch the kernels as they were.
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

from loraplane.dataplane.kernels import interpreter
from loraplane.dataplane.kernels.slot_weights import SlotWeights

interpreter.skip_nested_patching()  # in the interpreter: one language swap a launch

__all__ = ["check_bias", "dora_epilogue", "epilogue_args"]


@triton.jit  # type: ignore[untyped-decorator]
def dora_epilogue(  # type: ignore[no-untyped-def]
    out,  # [BLOCK_N] or [BLOCK_M, BLOCK_N] fp32: a slot's rows of y with the update added
    g_ptrs_ptr,  # [L] int64: each slot's DoRA g [out] fp32, 0 for a plain slot
    bias_ptr,  # [out]: the base layer's bias (read only when HAS_BIAS)
    slot,
    offs_n,  # [BLOCK_N]: the columns
    n_mask,  # [BLOCK_N]
    DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # -> out, a DoRA slot's rows rescaled: g * (out - bias) + bias (PEFT: bias not scaled)
    if DORA:
        g_addr = tl.load(g_ptrs_ptr + slot)
        if g_addr != 0:
            g = tl.load(g_addr.to(tl.pointer_type(tl.float32)) + offs_n, mask=n_mask, other=1.0)
            if HAS_BIAS:
                b = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                out = (out - b) * g + b
            else:
                out = out * g
    return out


def check_bias(bias: torch.Tensor | None, weights: SlotWeights) -> None:
    """ValueError unless `bias` is None or a contiguous [out] tensor of the weights' dtype
    and device (what a DoRA slot's rescale leaves out). Checked only where the kernels read
    it: a table with DoRA slots (`SlotWeights.dora`)."""
    if bias is None or not weights.dora:
        return
    if bias.dim() != 1 or not bias.is_contiguous() or bias.dtype != weights.dtype:
        raise ValueError(f"bias must be a contiguous 1-D {weights.dtype} tensor")
    if weights.max_rank and bias.numel() != weights.out_features:
        raise ValueError(f"bias has {bias.numel()} rows; the weights want {weights.out_features}")
    if bias.device != weights.device:
        raise ValueError(f"bias is on {bias.device}; the weights are on {weights.device}")


def epilogue_args(
    weights: SlotWeights, bias: torch.Tensor | None, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, bool]]:
    """The DoRA epilogue's kernel arguments: the g pointer table, the bias (y in its place
    when there is none: never read then), and the DORA / HAS_BIAS constants."""
    consts = {"DORA": weights.dora, "HAS_BIAS": weights.dora and bias is not None}
    return weights.g_ptrs, bias if bias is not None else y, consts
