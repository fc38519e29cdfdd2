"""BGMV LoRA in Triton: one program per token, for decode steps and captured decode graphs.

Same meaning as `sgmv_torch.lora_apply` (the CPU path and the test oracle) and as the SGMV
kernels of `sgmv_triton`, over the same `SlotWeights` table, rank-exact; the token dimension of
the grid is the tokens themselves, not segments x token blocks, so a launch over N tokens is N
programs per column block whatever the segments (`kernels/launch.py` says when each is used).

Grid and tiling (N tokens of `token_order`, each with its slot in `token_slots`):
- shrink: (token, rank block, k split). A program multiplies its token's row of x by BLOCK_R
  rows of its slot's A over a 1/SPLIT_K slice of `in` (a reduction over BLOCK_K columns per
  step, in fp32); partial sums are atomically added to the fp32 h [N, R] when SPLIT_K > 1.
- expand: (token, out block). A program loops over its slot's rank in BLOCK_R steps and adds
  scale * h B^T into its token's row of y; every (token, column) has one writer: no atomics.
- fused: (token, out block); the rank-sized h stays in registers, recomputed in every out block.
One token per program leaves nothing for tl.dot (16-row tiles): products are element-wise in
fp32 and reduced with tl.sum, exact as the SGMV kernels' fp32 accumulators are.
Rank-exact: programs whose rank block starts at or past their slot's rank exit at once, rank
loops run to the slot's own rank. Tokens of slot -1 (base model, or a graph's padding rows) and
slots of rank 0 (the module is not targeted) exit at once.
DoRA: a token whose slot has a per-row scale g in the table has its row rescaled where the
expand (or fused) kernel stores it, bias left out: y = g * (y + delta - bias) + bias (the
epilogue `dora_triton.dora_epilogue`). A CUDA graph's table always compiles it in, and its g
pointers are refreshed with the A and B pointers (cuda_graphs.py), so a decode step with DoRA
rows replays like any other.
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

from loraplane.dataplane.kernels.dora_triton import check_bias, dora_epilogue, epilogue_args
from loraplane.dataplane.kernels.sgmv_triton import KernelConfig, check_features, check_scales
from loraplane.dataplane.kernels.slot_weights import SlotWeights

__all__ = ["bgmv_expand", "bgmv_shrink", "default_config", "grids", "lora_apply"]
_TARGET_PROGRAMS = 512  # enough shrink programs to fill ~132 SMs a few times over


def default_config(num_tokens: int, in_features: int, max_rank: int) -> KernelConfig:
    """Tiles for a launch over `num_tokens` tokens: a k split while the shrink has few
    programs (block_m is unused: one token per program)."""
    block_k, block_r = 128, 16
    programs = num_tokens * triton.cdiv(max_rank, block_r)
    k_steps = triton.cdiv(in_features, block_k)
    split_k = 1
    while split_k * 2 <= k_steps and programs * split_k < _TARGET_PROGRAMS:
        split_k *= 2
    return KernelConfig(block_k=block_k, block_r=block_r, split_k=split_k)


def grids(
    num_tokens: int, weights: SlotWeights, cfg: KernelConfig
) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """(shrink grid, expand grid) of a launch; the fused kernel's grid is the expand's."""
    num_r_blocks = triton.cdiv(weights.max_rank, cfg.block_r)
    num_n_blocks = triton.cdiv(weights.out_features, cfg.block_n)
    return (num_tokens, num_r_blocks, cfg.split_k), (num_tokens, num_n_blocks)


@triton.jit  # type: ignore[untyped-decorator]
def _row_times_a(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, in]
    a_ptr,  # slot's A [rank, in]
    row,  # the token's row of x
    offs_r,  # [BLOCK_R]: rows of A
    r_mask,  # [BLOCK_R]
    k_start,
    k_end,
    in_features,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # -> [BLOCK_R] fp32: A[offs_r, k_start:k_end] @ x[row, k_start:k_end]
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + row * in_features + offs_k, mask=k_mask, other=0.0)  # [BLOCK_K]
        a = tl.load(
            a_ptr + offs_r[:, None] * in_features + offs_k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def _b_times_h(b_ptr, rank, offs_n, n_mask, offs_r, r_mask, h):  # type: ignore[no-untyped-def]
    # -> [BLOCK_N] fp32: B[offs_n, offs_r] @ h, B being [out, rank] (row stride = rank)
    b = tl.load(
        b_ptr + offs_n[:, None] * rank + offs_r[None, :],
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_R]
    return tl.sum(b.to(tl.float32) * h[None, :], axis=1)


@triton.jit  # type: ignore[untyped-decorator]
def _add_row(  # type: ignore[no-untyped-def]
    y_ptr, row, offs_n, n_mask, delta, scale, out_features,
    g_ptrs_ptr, bias_ptr, slot, DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # y[row, offs_n] += delta * scale, summed in fp32, then DoRA's rescale (dora_epilogue); each
    # (row, column) has one writer
    y = y_ptr + row * out_features + offs_n
    out = tl.load(y, mask=n_mask, other=0.0).to(tl.float32) + delta * scale
    out = dora_epilogue(out, g_ptrs_ptr, bias_ptr, slot, offs_n, n_mask, DORA, HAS_BIAS)
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _bgmv_shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, in]
    h_ptr,  # [N, R] fp32, zeroed when SPLIT_K > 1
    token_order_ptr,  # [N] int64: each program's row of x
    token_slots_ptr,  # [N] int64: its slot, -1 for none
    a_ptrs_ptr,  # [L] int64
    ranks_ptr,  # [L] int32
    in_features,
    h_stride,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PTR_ALIGN: tl.constexpr,
):
    n = tl.program_id(0)
    r_start = tl.program_id(1) * BLOCK_R
    pid_k = tl.program_id(2)
    slot = tl.load(token_slots_ptr + n)
    if slot < 0:  # a base-model token, or a graph's padding row
        return
    rank = tl.load(ranks_ptr + slot)
    if r_start >= rank:  # untargeted slot, or past this slot's own rank
        return
    row = tl.load(token_order_ptr + n)
    offs_r = r_start + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_ptr = tl.load(a_ptrs_ptr + slot).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_ptr = tl.multiple_of(a_ptr, PTR_ALIGN)
    k_chunk = tl.cdiv(tl.cdiv(in_features, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_chunk
    k_end = tl.minimum(k_start + k_chunk, in_features)
    acc = _row_times_a(
        x_ptr, a_ptr, row, offs_r, r_mask, k_start, k_end, in_features, BLOCK_K, BLOCK_R
    )
    h = h_ptr + n * h_stride + offs_r
    if SPLIT_K == 1:
        tl.store(h, acc, mask=r_mask)
    else:
        tl.atomic_add(h, acc, mask=r_mask, sem="relaxed")


@triton.jit  # type: ignore[untyped-decorator]
def _bgmv_expand_kernel(  # type: ignore[no-untyped-def]
    h_ptr,  # [N, R] fp32
    y_ptr,  # [T, out]
    token_order_ptr,  # [N] int64
    token_slots_ptr,  # [N] int64
    b_ptrs_ptr,  # [L] int64
    ranks_ptr,  # [L] int32
    scales_ptr,  # [L] fp32
    g_ptrs_ptr,  # [L] int64: DoRA's g per slot, 0 for none
    bias_ptr,  # [out]: the base layer's bias (HAS_BIAS)
    out_features,
    h_stride,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PTR_ALIGN: tl.constexpr,
    RANK_MULTIPLE: tl.constexpr,
    DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    n = tl.program_id(0)
    n_start = tl.program_id(1) * BLOCK_N
    slot = tl.load(token_slots_ptr + n)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # this module is not targeted by the slot's adapter
        return
    rank = tl.multiple_of(rank, RANK_MULTIPLE)
    row = tl.load(token_order_ptr + n)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    b_ptr = tl.load(b_ptrs_ptr + slot).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_ptr = tl.multiple_of(b_ptr, PTR_ALIGN)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):  # to the slot's own rank
        offs_r = r + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h = tl.load(h_ptr + n * h_stride + offs_r, mask=r_mask, other=0.0)  # [BLOCK_R]
        # rounded to the weights' dtype first, as the torch path's h is
        h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
        acc += _b_times_h(b_ptr, rank, offs_n, n_mask, offs_r, r_mask, h)
    scale = tl.load(scales_ptr + slot)
    _add_row(y_ptr, row, offs_n, n_mask, acc, scale, out_features,
             g_ptrs_ptr, bias_ptr, slot, DORA, HAS_BIAS)  # fmt: skip


@triton.jit  # type: ignore[untyped-decorator]
def _bgmv_fused_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, in]
    y_ptr,  # [T, out]
    token_order_ptr,  # [N] int64
    token_slots_ptr,  # [N] int64
    a_ptrs_ptr,  # [L] int64
    b_ptrs_ptr,  # [L] int64
    ranks_ptr,  # [L] int32
    scales_ptr,  # [L] fp32
    g_ptrs_ptr,  # [L] int64: DoRA's g per slot, 0 for none
    bias_ptr,  # [out]: the base layer's bias (HAS_BIAS)
    in_features,
    out_features,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PTR_ALIGN: tl.constexpr,
    RANK_MULTIPLE: tl.constexpr,
    DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    n = tl.program_id(0)
    n_start = tl.program_id(1) * BLOCK_N
    slot = tl.load(token_slots_ptr + n)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    rank = tl.multiple_of(rank, RANK_MULTIPLE)
    row = tl.load(token_order_ptr + n)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    a_ptr = tl.load(a_ptrs_ptr + slot).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_ptr = tl.multiple_of(a_ptr, PTR_ALIGN)
    b_ptr = tl.load(b_ptrs_ptr + slot).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_ptr = tl.multiple_of(b_ptr, PTR_ALIGN)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):  # to the slot's own rank; h never leaves the chip
        offs_r = r + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h = _row_times_a(
            x_ptr, a_ptr, row, offs_r, r_mask, 0, in_features, in_features, BLOCK_K, BLOCK_R
        )
        h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
        acc += _b_times_h(b_ptr, rank, offs_n, n_mask, offs_r, r_mask, h)
    scale = tl.load(scales_ptr + slot)
    _add_row(y_ptr, row, offs_n, n_mask, acc, scale, out_features,
             g_ptrs_ptr, bias_ptr, slot, DORA, HAS_BIAS)  # fmt: skip


# Launchers.


def _check_tokens(
    token_order: torch.Tensor, token_slots: torch.Tensor, weights: SlotWeights
) -> None:
    for name, t in (("token_order", token_order), ("token_slots", token_slots)):
        if t.dim() != 1 or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int64 tensor")
        if t.device != weights.device:
            raise ValueError(f"{name} is on {t.device}; the weights are on {weights.device}")
    if token_slots.numel() != token_order.numel():
        raise ValueError(
            f"token_slots has {token_slots.numel()} entries, token_order {token_order.numel()}"
        )


def _launch_shrink(
    x: torch.Tensor,  # [T, in]
    h: torch.Tensor,  # [N, R] fp32 (zeroed when split_k > 1)
    tokens: tuple[torch.Tensor, torch.Tensor],  # token_order, token_slots
    weights: SlotWeights,
    cfg: KernelConfig,
) -> None:
    grid, _ = grids(tokens[0].numel(), weights, cfg)
    _bgmv_shrink_kernel[grid](
        x, h, *tokens, weights.a_ptrs, weights.ranks, weights.in_features, h.stride(0),
        BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r, SPLIT_K=cfg.split_k,
        PTR_ALIGN=weights.ptr_align,
    )  # fmt: skip


def _launch_expand(
    y: torch.Tensor,  # [T, out]
    h: torch.Tensor,  # [N, >= R] fp32
    tokens: tuple[torch.Tensor, torch.Tensor],
    weights: SlotWeights,
    scales: torch.Tensor,  # [L] fp32
    cfg: KernelConfig,
    bias: torch.Tensor | None,  # [out]
) -> None:
    _, grid = grids(tokens[0].numel(), weights, cfg)
    g_ptrs, bias_arg, consts = epilogue_args(weights, bias, y)
    _bgmv_expand_kernel[grid](
        h, y, *tokens, weights.b_ptrs, weights.ranks, scales, g_ptrs, bias_arg,
        weights.out_features, h.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, PTR_ALIGN=weights.ptr_align,
        RANK_MULTIPLE=weights.rank_multiple, **consts,
    )  # fmt: skip


def _intermediate(num_tokens: int, weights: SlotWeights, cfg: KernelConfig) -> torch.Tensor:
    # [N, R] fp32; uninitialised when one program writes each entry the expand reads
    alloc = torch.zeros if cfg.split_k > 1 else torch.empty
    return alloc(num_tokens, weights.max_rank, dtype=torch.float32, device=weights.device)


def bgmv_shrink(
    x: torch.Tensor,  # [T, in]
    token_order: torch.Tensor,  # [N] int64: rows of x
    token_slots: torch.Tensor,  # [N] int64: the slot of each, -1 for none
    weights: SlotWeights,  # per-slot A [r_k, in] pointers and ranks
    config: KernelConfig | None = None,
) -> torch.Tensor:  # [N, R] fp32, R = weights.max_rank
    """Project each token onto its slot's rank space (fp32 result).

    h = zeros(N, R)
    for n in range(N):
        k = token_slots[n]
        if k >= 0:
            h[n, :rank(k)] = x[token_order[n]] @ A_k.T     # nothing where rank(k) == 0

    Columns past a slot's rank, and rows of slot -1, are zero.
    """
    check_features("x", x, weights, weights.in_features)
    _check_tokens(token_order, token_slots, weights)
    num = token_order.numel()
    h = torch.zeros(num, weights.max_rank, dtype=torch.float32, device=x.device)
    if num and weights.max_rank:
        cfg = config or default_config(num, weights.in_features, weights.max_rank)
        _launch_shrink(x, h, (token_order, token_slots), weights, cfg)
    return h


def bgmv_expand(
    y: torch.Tensor,  # [T, out], updated in place
    h: torch.Tensor,  # [N, R] fp32 from bgmv_shrink
    token_order: torch.Tensor,  # [N] int64
    token_slots: torch.Tensor,  # [N] int64
    weights: SlotWeights,  # per-slot B [out, r_k] pointers and ranks
    scales: torch.Tensor,  # [L] fp32: each slot's scale
    config: KernelConfig | None = None,
    *,
    bias: torch.Tensor | None = None,  # [out]: the base layer's, left out of DoRA's scaling
) -> torch.Tensor:  # y
    """Add each token's scaled up-projection into its row of y; rescale a DoRA slot's rows.

    for n in range(N):
        k = token_slots[n]
        if k >= 0 and rank(k) > 0:
            t = token_order[n]
            y[t] += (h[n, :rank(k)] @ B_k.T) * scales[k]
            if g_k is not None:                       # DoRA, in the same store
                y[t] = g_k * (y[t] - bias) + bias     # bias: 0 when None

    h is rounded to the weights' dtype before the product (as the torch path's h is).
    """
    check_features("y", y, weights, weights.out_features)
    _check_tokens(token_order, token_slots, weights)
    check_scales(scales, weights)
    check_bias(bias, weights)
    num = token_order.numel()
    if (
        h.dim() != 2
        or h.dtype != torch.float32
        or h.stride(1) != 1
        or h.shape[0] != num
        or (h.shape[1] < weights.max_rank)
    ):
        raise ValueError(
            f"h must be fp32 [{num}, >= {weights.max_rank}] with unit column stride, got "
            f"{h.dtype} {tuple(h.shape)}"
        )
    if num and weights.max_rank:
        cfg = config or default_config(num, weights.in_features, weights.max_rank)
        _launch_expand(y, h, (token_order, token_slots), weights, scales, cfg, bias)
    return y


def lora_apply(
    y: torch.Tensor,  # [T, out], the base layer's output; updated in place
    x: torch.Tensor,  # [T, in], the base layer's input
    token_order: torch.Tensor,  # [N] int64: rows of x and y
    token_slots: torch.Tensor,  # [N] int64: the slot of each, -1 for none
    weights: SlotWeights,
    scales: torch.Tensor,  # [L] fp32
    *,
    fused: bool = False,
    config: KernelConfig | None = None,
    bias: torch.Tensor | None = None,  # [out]: the base layer's, left out of DoRA's scaling
) -> torch.Tensor:  # y
    """y[t] += scales[k] * B_k (A_k x[t]) for every token t = token_order[n] of slot
    k = token_slots[n] >= 0, then y[t] = g_k * (y[t] - bias) + bias where slot k has DoRA's
    g: the meaning of `sgmv_triton.lora_apply`, one program per token.

    fused=False:  h = bgmv_shrink(...); bgmv_expand(y, h, ...)   # two launches
    fused=True:   one launch; h stays in registers, recomputed in every out block
    Returns y without launching when there are no tokens or no slot targets this module.
    """
    check_features("x", x, weights, weights.in_features)
    check_features("y", y, weights, weights.out_features)
    _check_tokens(token_order, token_slots, weights)
    check_scales(scales, weights)
    check_bias(bias, weights)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows, y has {y.shape[0]}")
    num = token_order.numel()
    if num == 0 or weights.max_rank == 0:
        return y
    cfg = config or default_config(num, weights.in_features, weights.max_rank)
    tokens = (token_order, token_slots)
    if fused:
        _, grid = grids(num, weights, cfg)
        g_ptrs, bias_arg, consts = epilogue_args(weights, bias, y)
        _bgmv_fused_kernel[grid](
            x, y, *tokens, weights.a_ptrs, weights.b_ptrs, weights.ranks, scales, g_ptrs,
            bias_arg, weights.in_features, weights.out_features,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r,
            PTR_ALIGN=weights.ptr_align, RANK_MULTIPLE=weights.rank_multiple, **consts,
        )  # fmt: skip
        return y
    h = _intermediate(num, weights, cfg)
    _launch_shrink(x, h, tokens, weights, cfg)
    _launch_expand(y, h, tokens, weights, scales, cfg, bias)
    return y
