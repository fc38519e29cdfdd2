"""SGMV LoRA in Triton: shrink, expand and a fused apply, each kernel beside its launcher.

Same meaning as `sgmv_torch` (the CPU path and the test oracle); the weights are passed as a
`SlotWeights` table of per-slot data pointers and ranks instead of Python lists, because the
pool keeps each adapter in its own buffer at its own rank (rank-exact).

Grid and tiling (S segments, m = token block within a segment):
- shrink: (m block x rank block, segment, k split). A program multiplies BLOCK_M tokens of its
  segment by BLOCK_R rows of the slot's A over a 1/SPLIT_K slice of `in`; partial sums are
  atomically added to the fp32 intermediate h [N, R] when SPLIT_K > 1.
- expand: (m block x out block, segment). A program loops over its slot's rank in BLOCK_R steps,
  so it reads each B element of its tile once, and adds scale * h B^T into its tokens' rows of
  y. Every (token, column) belongs to exactly one program: no atomics on y.
- fused: (m block x out block, segment); the rank-sized intermediate stays in registers, at the
  price of recomputing the shrink of its tokens in every out block (cheap at decode, where
  the launches, not the flops, dominate; the unfused pair is the better choice for prefill).
Rank-exact: programs whose rank block starts at or past their slot's rank exit at once, and rank
loops run to the slot's own rank; a rank-8 slot never touches rank-64 padding. Slots with rank
0 (the module is not targeted) exit at once. Programs past their segment's end exit at once.
DoRA (lora/dora.py): where the expand (or fused) kernel writes y, a slot with a per-row scale g
in the table (`SlotWeights.g_ptrs`) has its rows rescaled in the same store, the base layer's
bias left out as PEFT does: y = g * (y + delta - bias) + bias (`dora_triton.dora_epilogue`,
shared with `bgmv_triton`); plain slots' rows are stored as before. The epilogue is compiled in
only when the table asks for it (`SlotWeights.dora`).

These kernels serve steps with long segments (prefill chunks, decodes of adapters with several
rows each); steps whose segments are a token or so, and every captured decode graph, launch the
per-token BGMV kernels of `bgmv_triton` instead, whose grid is the tokens rather than segments
x token blocks of the longest segment (`kernels/launch.py` has the rule, decided once per step).
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

from loraplane.dataplane.kernels.dora_triton import check_bias, dora_epilogue, epilogue_args
from loraplane.dataplane.kernels.launch import sgmv_block_m
from loraplane.dataplane.kernels.slot_weights import SlotWeights

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
__all__ = ["KernelConfig", "SlotWeights", "default_config", "lora_apply", "sgmv_expand",
           "sgmv_shrink"]  # fmt: skip
_TARGET_PROGRAMS = 512  # enough programs to fill ~132 SMs a few times over at decode
_MAX_ALIGN = 16  # bytes: the widest vector load the hints below can unlock


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Tile sizes (powers of two, >= 16 where they feed tl.dot) and the shrink's k split."""

    block_m: int = 16  # tokens per program
    block_k: int = 128  # shrink: in-features per loop step
    block_r: int = 16  # rank per loop step / per shrink program
    block_n: int = 128  # expand: out-features per program
    split_k: int = 1  # shrink: programs sharing one reduction over in

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k", "block_r", "block_n", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        for name in ("block_m", "block_k", "block_r", "block_n"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name} must be >= 16 (tl.dot), got {getattr(self, name)}")


def default_config(
    num_segments: int, max_seg_len: int, in_features: int, max_rank: int
) -> KernelConfig:
    """Tiles for a launch: small token blocks at decode, a k split to fill the GPU."""
    block_m = sgmv_block_m(max_seg_len)
    block_k = 128
    block_r = 16
    programs = num_segments * triton.cdiv(max_seg_len, block_m) * triton.cdiv(max_rank, block_r)
    k_steps = triton.cdiv(in_features, block_k)
    split_k = 1
    while split_k * 2 <= k_steps and programs * split_k < _TARGET_PROGRAMS:
        split_k *= 2
    return KernelConfig(block_m=block_m, block_k=block_k, block_r=block_r, split_k=split_k)


# The kernels. Triton is untyped, and its JIT reads the parameters' annotations itself
# (`tl.constexpr` marks compile-time ones), so runtime parameters stay bare: hence a
# `no-untyped-def` ignore per jitted function (plus `untyped-decorator` where some parameters
# carry `tl.constexpr`), and nothing else.


@triton.jit  # type: ignore[untyped-decorator]
def _shrink_tile(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, in]
    a_ptr,  # slot's A [rank, in]
    rows,  # [BLOCK_M] int64: rows of x
    m_mask,  # [BLOCK_M]
    offs_r,  # [BLOCK_R]: rows of A
    r_mask,  # [BLOCK_R]
    k_start,
    k_end,
    in_features,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # -> [BLOCK_M, BLOCK_R] fp32: x[rows, k_start:k_end] @ A[offs_r, k_start:k_end]^T
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + rows[:, None] * in_features + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        a_t = tl.load(
            a_ptr + offs_r[None, :] * in_features + offs_k[:, None],
            mask=r_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]
        acc += tl.dot(x, a_t, input_precision=PRECISION)
    return acc


@triton.jit
def _load_b_t(b_ptr, rank, offs_n, n_mask, offs_r, r_mask):  # type: ignore[no-untyped-def]
    # -> [BLOCK_R, BLOCK_N]: B[offs_n, offs_r]^T, B being [out, rank] (row stride = rank)
    return tl.load(
        b_ptr + offs_n[None, :] * rank + offs_r[:, None],
        mask=n_mask[None, :] & r_mask[:, None],
        other=0.0,
    )


@triton.jit  # type: ignore[untyped-decorator]
def _add_rows(  # type: ignore[no-untyped-def]
    y_ptr, rows, m_mask, offs_n, n_mask, delta, scale, out_features,
    g_ptrs_ptr, bias_ptr, slot, DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # y[rows, offs_n] += delta * scale, summed in fp32, then DoRA's rescale (dora_epilogue); each
    # (row, column) has one writer
    y = y_ptr + rows[:, None] * out_features + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    out = tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta * scale
    out = dora_epilogue(
        out, g_ptrs_ptr, bias_ptr, slot, offs_n[None, :], n_mask[None, :], DORA, HAS_BIAS
    )
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, in]
    h_ptr,  # [N, R] fp32, zeroed when SPLIT_K > 1
    token_order_ptr,  # [N] int64
    seg_slots_ptr,  # [S] int32
    seg_bounds_ptr,  # [S + 1] int32
    a_ptrs_ptr,  # [L] int64
    ranks_ptr,  # [L] int32
    in_features,
    h_stride,
    num_r_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PTR_ALIGN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_mr = tl.program_id(0)
    seg = tl.program_id(1)
    pid_k = tl.program_id(2)
    pid_m = pid_mr // num_r_blocks
    r_start = (pid_mr % num_r_blocks) * BLOCK_R
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
    if r_start >= rank:  # untargeted slot, or past this slot's own rank
        return
    seg_end = tl.load(seg_bounds_ptr + seg + 1)
    m_start = tl.load(seg_bounds_ptr + seg) + pid_m * BLOCK_M
    if m_start >= seg_end:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    rows = tl.load(token_order_ptr + offs_m, mask=m_mask, other=0)
    offs_r = r_start + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_ptr = tl.load(a_ptrs_ptr + slot).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_ptr = tl.multiple_of(a_ptr, PTR_ALIGN)
    k_chunk = tl.cdiv(tl.cdiv(in_features, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_chunk
    k_end = tl.minimum(k_start + k_chunk, in_features)
    acc = _shrink_tile(
        x_ptr, a_ptr, rows, m_mask, offs_r, r_mask, k_start, k_end, in_features,
        BLOCK_M, BLOCK_K, BLOCK_R, PRECISION,
    )  # fmt: skip
    h = h_ptr + offs_m[:, None] * h_stride + offs_r[None, :]
    mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(h, acc, mask=mask)
    else:
        tl.atomic_add(h, acc, mask=mask, sem="relaxed")


@triton.jit  # type: ignore[untyped-decorator]
def _expand_kernel(  # type: ignore[no-untyped-def]
    h_ptr,  # [N, R] fp32
    y_ptr,  # [T, out]
    token_order_ptr,  # [N] int64
    seg_slots_ptr,  # [S] int32
    seg_bounds_ptr,  # [S + 1] int32
    b_ptrs_ptr,  # [L] int64
    ranks_ptr,  # [L] int32
    scales_ptr,  # [L] fp32
    g_ptrs_ptr,  # [L] int64: DoRA's g per slot, 0 for none
    bias_ptr,  # [out]: the base layer's bias (HAS_BIAS)
    out_features,
    h_stride,
    num_n_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PTR_ALIGN: tl.constexpr,
    RANK_MULTIPLE: tl.constexpr,
    PRECISION: tl.constexpr,
    DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    seg = tl.program_id(1)
    pid_m = pid_mn // num_n_blocks
    n_start = (pid_mn % num_n_blocks) * BLOCK_N
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # this module is not targeted by the slot's adapter
        return
    rank = tl.multiple_of(rank, RANK_MULTIPLE)
    seg_end = tl.load(seg_bounds_ptr + seg + 1)
    m_start = tl.load(seg_bounds_ptr + seg) + pid_m * BLOCK_M
    if m_start >= seg_end:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    b_ptr = tl.load(b_ptrs_ptr + slot).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_ptr = tl.multiple_of(b_ptr, PTR_ALIGN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):  # to the slot's own rank
        offs_r = r + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h = tl.load(
            h_ptr + offs_m[:, None] * h_stride + offs_r[None, :],
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        b_t = _load_b_t(b_ptr, rank, offs_n, n_mask, offs_r, r_mask)
        acc += tl.dot(h.to(y_ptr.dtype.element_ty), b_t, input_precision=PRECISION)
    rows = tl.load(token_order_ptr + offs_m, mask=m_mask, other=0)
    scale = tl.load(scales_ptr + slot)
    _add_rows(y_ptr, rows, m_mask, offs_n, n_mask, acc, scale, out_features,
              g_ptrs_ptr, bias_ptr, slot, DORA, HAS_BIAS)  # fmt: skip


@triton.jit  # type: ignore[untyped-decorator]
def _fused_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, in]
    y_ptr,  # [T, out]
    token_order_ptr,  # [N] int64
    seg_slots_ptr,  # [S] int32
    seg_bounds_ptr,  # [S + 1] int32
    a_ptrs_ptr,  # [L] int64
    b_ptrs_ptr,  # [L] int64
    ranks_ptr,  # [L] int32
    scales_ptr,  # [L] fp32
    g_ptrs_ptr,  # [L] int64: DoRA's g per slot, 0 for none
    bias_ptr,  # [out]: the base layer's bias (HAS_BIAS)
    in_features,
    out_features,
    num_n_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PTR_ALIGN: tl.constexpr,
    RANK_MULTIPLE: tl.constexpr,
    PRECISION: tl.constexpr,
    DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    seg = tl.program_id(1)
    pid_m = pid_mn // num_n_blocks
    n_start = (pid_mn % num_n_blocks) * BLOCK_N
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    rank = tl.multiple_of(rank, RANK_MULTIPLE)
    seg_end = tl.load(seg_bounds_ptr + seg + 1)
    m_start = tl.load(seg_bounds_ptr + seg) + pid_m * BLOCK_M
    if m_start >= seg_end:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    rows = tl.load(token_order_ptr + offs_m, mask=m_mask, other=0)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    a_ptr = tl.load(a_ptrs_ptr + slot).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_ptr = tl.multiple_of(a_ptr, PTR_ALIGN)
    b_ptr = tl.load(b_ptrs_ptr + slot).to(tl.pointer_type(y_ptr.dtype.element_ty))
    b_ptr = tl.multiple_of(b_ptr, PTR_ALIGN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):  # to the slot's own rank; h never leaves the chip
        offs_r = r + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h = _shrink_tile(
            x_ptr, a_ptr, rows, m_mask, offs_r, r_mask, 0, in_features, in_features,
            BLOCK_M, BLOCK_K, BLOCK_R, PRECISION,
        )  # fmt: skip
        b_t = _load_b_t(b_ptr, rank, offs_n, n_mask, offs_r, r_mask)
        acc += tl.dot(h.to(y_ptr.dtype.element_ty), b_t, input_precision=PRECISION)
    scale = tl.load(scales_ptr + slot)
    _add_rows(y_ptr, rows, m_mask, offs_n, n_mask, acc, scale, out_features,
              g_ptrs_ptr, bias_ptr, slot, DORA, HAS_BIAS)  # fmt: skip


# Launchers.


def _precision(dtype: torch.dtype) -> str:
    # fp32 weights get exact fp32 products (the tensor cores' tf32 would be ~1e-3 off the
    # reference); fp16/bf16 products are exact in fp32 accumulators either way.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_features(name: str, t: torch.Tensor, weights: SlotWeights, features: int) -> None:
    """ValueError naming `name` unless `t` is a contiguous 2-D tensor of the weights' dtype
    and device with `features` columns (shared with `bgmv_triton`)."""
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-D tensor, got shape {tuple(t.shape)}")
    if t.dtype != weights.dtype:
        raise ValueError(f"{name} is {t.dtype}; the weights are {weights.dtype}")
    if t.device != weights.device:
        raise ValueError(f"{name} is on {t.device}; the weights are on {weights.device}")
    if weights.max_rank and t.shape[1] != features:
        raise ValueError(f"{name} has {t.shape[1]} features; the weights want {features}")


def _check_segments(
    token_order: torch.Tensor,
    seg_slots: torch.Tensor,
    seg_bounds: torch.Tensor,
    max_seg_len: int,
    weights: SlotWeights,
) -> None:
    for name, t, dtype in (
        ("token_order", token_order, torch.int64),
        ("seg_slots", seg_slots, torch.int32),
        ("seg_bounds", seg_bounds, torch.int32),
    ):
        if t.dim() != 1 or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D {dtype} tensor")
        if t.device != weights.device:
            raise ValueError(f"{name} is on {t.device}; the weights are on {weights.device}")
    if seg_bounds.numel() != seg_slots.numel() + 1:
        raise ValueError(
            f"seg_bounds needs {seg_slots.numel() + 1} entries, got {seg_bounds.numel()}"
        )
    if max_seg_len < 0 or max_seg_len > token_order.numel():
        raise ValueError(f"max_seg_len must be in 0..{token_order.numel()}, got {max_seg_len}")


def check_scales(scales: torch.Tensor, weights: SlotWeights) -> None:
    """ValueError unless `scales` is a contiguous fp32 [L] tensor on the weights' device."""
    if (
        scales.dim() != 1
        or scales.dtype != torch.float32
        or not scales.is_contiguous()
        or scales.numel() != weights.num_slots
    ):
        raise ValueError(f"scales must be a contiguous fp32 tensor [{weights.num_slots}]")
    if scales.device != weights.device:
        raise ValueError(f"scales is on {scales.device}; the weights are on {weights.device}")


def _nothing_to_do(
    token_order: torch.Tensor, seg_slots: torch.Tensor, weights: SlotWeights, max_seg_len: int
) -> bool:
    return (
        token_order.numel() == 0
        or seg_slots.numel() == 0
        or weights.max_rank == 0
        or max_seg_len == 0
    )


def _grid_rows(max_seg_len: int, cfg: KernelConfig) -> int:
    return int(triton.cdiv(max_seg_len, cfg.block_m))


def _launch_shrink(
    x: torch.Tensor,  # [T, in]
    h: torch.Tensor,  # [N, R] fp32, zeroed
    segs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # token_order, seg_slots, seg_bounds
    weights: SlotWeights,
    cfg: KernelConfig,
    max_seg_len: int,
) -> None:
    num_r_blocks = triton.cdiv(weights.max_rank, cfg.block_r)
    grid = (_grid_rows(max_seg_len, cfg) * num_r_blocks, segs[1].numel(), cfg.split_k)
    _shrink_kernel[grid](
        x, h, *segs, weights.a_ptrs, weights.ranks,
        weights.in_features, h.stride(0), num_r_blocks,
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r, SPLIT_K=cfg.split_k,
        PTR_ALIGN=weights.ptr_align, PRECISION=_precision(x.dtype),
    )  # fmt: skip


def _launch_expand(
    y: torch.Tensor,  # [T, out]
    h: torch.Tensor,  # [N, >= R] fp32
    segs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weights: SlotWeights,
    scales: torch.Tensor,  # [L] fp32
    cfg: KernelConfig,
    max_seg_len: int,
    bias: torch.Tensor | None,  # [out]
) -> None:
    num_n_blocks = triton.cdiv(weights.out_features, cfg.block_n)
    grid = (_grid_rows(max_seg_len, cfg) * num_n_blocks, segs[1].numel())
    g_ptrs, bias_arg, consts = epilogue_args(weights, bias, y)
    _expand_kernel[grid](
        h, y, *segs, weights.b_ptrs, weights.ranks, scales, g_ptrs, bias_arg,
        weights.out_features, h.stride(0), num_n_blocks,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
        PTR_ALIGN=weights.ptr_align, RANK_MULTIPLE=weights.rank_multiple,
        PRECISION=_precision(y.dtype), **consts,
    )  # fmt: skip


def _launch_fused(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    segs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weights: SlotWeights,
    scales: torch.Tensor,  # [L] fp32
    cfg: KernelConfig,
    max_seg_len: int,
    bias: torch.Tensor | None,  # [out]
) -> None:
    num_n_blocks = triton.cdiv(weights.out_features, cfg.block_n)
    grid = (_grid_rows(max_seg_len, cfg) * num_n_blocks, segs[1].numel())
    g_ptrs, bias_arg, consts = epilogue_args(weights, bias, y)
    _fused_kernel[grid](
        x, y, *segs, weights.a_ptrs, weights.b_ptrs, weights.ranks, scales, g_ptrs, bias_arg,
        weights.in_features, weights.out_features, num_n_blocks,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=cfg.block_r,
        PTR_ALIGN=weights.ptr_align, RANK_MULTIPLE=weights.rank_multiple,
        PRECISION=_precision(y.dtype), **consts,
    )  # fmt: skip


def _config(
    config: KernelConfig | None, seg_slots: torch.Tensor, max_seg_len: int, weights: SlotWeights
) -> KernelConfig:
    if config is not None:
        return config
    return default_config(seg_slots.numel(), max_seg_len, weights.in_features, weights.max_rank)


def sgmv_shrink(
    x: torch.Tensor,  # [T, in]
    token_order: torch.Tensor,  # [N] int64: rows of x, grouped by segment
    seg_slots: torch.Tensor,  # [S] int32: the slot of each segment
    seg_bounds: torch.Tensor,  # [S + 1] int32: segment s is token_order[bounds[s]:bounds[s+1]]
    weights: SlotWeights,  # per-slot A [r_k, in] pointers and ranks
    max_seg_len: int,  # the longest segment's length (sizes the grid)
    config: KernelConfig | None = None,
) -> torch.Tensor:  # [N, R] fp32, R = weights.max_rank
    """Project each adapter token onto its adapter's rank space (fp32 result).

    h = zeros(N, R)
    for s, k in enumerate(seg_slots):
        for n in range(seg_bounds[s], seg_bounds[s + 1]):
            h[n, :rank(k)] = x[token_order[n]] @ A_k.T    # nothing where rank(k) == 0

    R is the table's largest rank, not the batch's; columns past a slot's rank stay zero.
    Returns without launching when there is nothing to compute.
    """
    check_features("x", x, weights, weights.in_features)
    _check_segments(token_order, seg_slots, seg_bounds, max_seg_len, weights)
    h = torch.zeros(token_order.numel(), weights.max_rank, dtype=torch.float32, device=x.device)
    if not _nothing_to_do(token_order, seg_slots, weights, max_seg_len):
        cfg = _config(config, seg_slots, max_seg_len, weights)
        _launch_shrink(x, h, (token_order, seg_slots, seg_bounds), weights, cfg, max_seg_len)
    return h


def sgmv_expand(
    y: torch.Tensor,  # [T, out], updated in place
    h: torch.Tensor,  # [N, R] fp32 from sgmv_shrink
    token_order: torch.Tensor,  # [N] int64
    seg_slots: torch.Tensor,  # [S] int32
    seg_bounds: torch.Tensor,  # [S + 1] int32
    weights: SlotWeights,  # per-slot B [out, r_k] pointers and ranks
    scales: torch.Tensor,  # [L] fp32: each slot's scale
    max_seg_len: int,
    config: KernelConfig | None = None,
    *,
    bias: torch.Tensor | None = None,  # [out]: the base layer's, left out of DoRA's scaling
) -> torch.Tensor:  # y
    """Add each adapter token's scaled up-projection into its row of y; rescale a DoRA
    slot's rows (a g in the table).

    for s, k in enumerate(seg_slots):
        for n in range(seg_bounds[s], seg_bounds[s + 1]):
            t = token_order[n]
            y[t] += (h[n, :rank(k)] @ B_k.T) * scales[k]   # nothing if rank(k) == 0
            if g_k is not None:                            # DoRA, in the same store
                y[t] = g_k * (y[t] - bias) + bias          # bias: 0 when None

    h is rounded to the weights' dtype before the product (as the torch path's h is).
    Returns y without launching when there is nothing to compute.
    """
    check_features("y", y, weights, weights.out_features)
    _check_segments(token_order, seg_slots, seg_bounds, max_seg_len, weights)
    check_scales(scales, weights)
    check_bias(bias, weights)
    if (
        h.dim() != 2
        or h.dtype != torch.float32
        or h.stride(1) != 1
        or h.shape[0] != token_order.numel()
        or h.shape[1] < weights.max_rank
    ):
        raise ValueError(
            f"h must be fp32 [{token_order.numel()}, >= {weights.max_rank}] with unit column "
            f"stride, got {h.dtype} {tuple(h.shape)}"
        )
    if h.device != weights.device:
        raise ValueError(f"h is on {h.device}; the weights are on {weights.device}")
    if not _nothing_to_do(token_order, seg_slots, weights, max_seg_len):
        cfg = _config(config, seg_slots, max_seg_len, weights)
        segs = (token_order, seg_slots, seg_bounds)
        _launch_expand(y, h, segs, weights, scales, cfg, max_seg_len, bias)
    return y


def lora_apply(
    y: torch.Tensor,  # [T, out], the base layer's output; updated in place
    x: torch.Tensor,  # [T, in], the base layer's input
    token_order: torch.Tensor,  # [N] int64
    seg_slots: torch.Tensor,  # [S] int32
    seg_bounds: torch.Tensor,  # [S + 1] int32
    weights: SlotWeights,
    scales: torch.Tensor,  # [L] fp32
    max_seg_len: int,
    *,
    fused: bool = False,
    config: KernelConfig | None = None,
    bias: torch.Tensor | None = None,  # [out]: the base layer's, left out of DoRA's scaling
) -> torch.Tensor:  # y
    """y[t] += scales[k] * B_k (A_k x[t]) for every adapter token t of slot k; then, where
    slot k has DoRA's g in the table, y[t] = g_k * (y[t] - bias) + bias, in the same store
    (PEFT's DoRA: lora/dora.py; `bias` None counts as 0).

    fused=False:  h = sgmv_shrink(x, ...); sgmv_expand(y, h, ...)   # two launches (+ memset)
    fused=True:   one launch; h stays in registers, recomputed in every out block
    Returns y without launching when no token uses a slot that targets this module (as far
    as the host can tell: slots untargeted on the device exit in the kernel).
    """
    check_features("x", x, weights, weights.in_features)
    check_features("y", y, weights, weights.out_features)
    _check_segments(token_order, seg_slots, seg_bounds, max_seg_len, weights)
    check_scales(scales, weights)
    check_bias(bias, weights)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows, y has {y.shape[0]}")
    if _nothing_to_do(token_order, seg_slots, weights, max_seg_len):
        return y
    cfg = _config(config, seg_slots, max_seg_len, weights)
    segs = (token_order, seg_slots, seg_bounds)
    if fused:
        _launch_fused(y, x, segs, weights, scales, cfg, max_seg_len, bias)
    else:
        # the expand reads a segment's h only to its slot's rank, which one shrink program
        # writes unless the k loop is split (then programs add into zeros): no memset launch
        # per call otherwise (a zeroed h was ~18 us of host time per layer call on an H200)
        alloc = torch.zeros if cfg.split_k > 1 else torch.empty
        h = alloc(token_order.numel(), weights.max_rank, dtype=torch.float32, device=x.device)
        _launch_shrink(x, h, segs, weights, cfg, max_seg_len)
        _launch_expand(y, h, segs, weights, scales, cfg, max_seg_len, bias)
    return y
