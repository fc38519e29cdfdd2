"""W8A16 in Triton: a float8 e4m3 weight scaled inside the matrix product, beside its launcher.
Same meaning as FP8Linear's torch path (models/quant.py; the CPU path and the test oracle):

    y[m, n] = sum_k x[m, k] * w(n, k) (+ bias[n])        accumulated in fp32
    w(n, k) = (W8[n, k].float() * scale[n or 0]).to(x.dtype)
            = (W8[n, k].float() * scale[(n + R) // BN, (k + C) // BK]).to(x.dtype)  (block-wise;
              R, C: where a tensor-parallel slice starts in its first block)

Grid: (row blocks, column blocks); a program walks `in` in BLOCK_K steps, loads BLOCK_N x
BLOCK_K bytes of the weight, widens and scales them, and multiplies with tl.dot. The full
16-bit weight is never written: a decode step reads a byte per weight instead of the torch
path's rebuilt copy (the weight read, a 16-bit copy written, then read by the matmul).
Activations stay in their dtype (W8A16): LoRA and the base read the same unquantized x.
What it has in common with the 4-bit kernel (how x is checked and loaded, the tiles, the
launch, y's store) is in kernels/quant_gemm_common.py.
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

from loraplane.dataplane.kernels import quant_gemm_common as common

__all__ = ["w8a16_linear"]


@triton.jit  # type: ignore[untyped-decorator]
def _w8a16_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [M, K] activation dtype
    w_ptr,  # [N, K] float8 e4m3
    scale_ptr,  # [N] (PER_CHANNEL), [ceil(N / SCALE_N), ceil(K / SCALE_K)] (SCALE_N > 0) or [1]
    bias_ptr,  # [N] (read only with HAS_BIAS)
    y_ptr,  # [M, N] activation dtype
    M,
    N,
    K,
    ROW_OFF,  # block-wise scales: the slice's first row and column within their block
    COL_OFF,
    SCALE_COLS,  # block-wise scales: the scale tensor's columns
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    SCALE_N: tl.constexpr,  # > 0: block-wise scales, a block of SCALE_N rows x SCALE_K columns
    SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, m_mask, n_mask = common.tile(M, N, BLOCK_M, BLOCK_N)
    if PER_CHANNEL:
        scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]  # [BLOCK_N, 1]
    elif SCALE_N == 0:
        scale = tl.load(scale_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = common.load_x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, K)  # [BLOCK_M, BLOCK_K]
        w8 = tl.load(
            w_ptr + offs_n[:, None] * K + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K] fp8
        if SCALE_N > 0:  # each element's block factor (the tile may straddle blocks)
            block_row = (offs_n + ROW_OFF) // SCALE_N
            block_of = block_row[:, None] * SCALE_COLS + ((offs_k + COL_OFF) // SCALE_K)[None, :]
            scale = tl.load(
                scale_ptr + block_of,
                mask=n_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_K]
        w = (w8.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    common.store_tile(acc, bias_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)


def w8a16_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    block: tuple[int, int] | None = None, offset: tuple[int, int] = (0, 0),
) -> torch.Tensor:  # fmt: skip
    """y = x @ (W8 * scale)^T (+ bias); x [..., K] in fp16, bf16 or fp32, `weight` [N, K]
    float8 e4m3, `scale` fp32 per tensor ([] or [1]), per channel ([N, 1] or [N]) or, with
    `block` (rows, columns), one per block the weight touches when it starts `offset` rows
    and columns into its first block ([ceil((N + r) / rows), ceil((K + c) / columns)]); y
    [..., N] in x's dtype."""
    n, k = weight.shape
    common.check_x(x, k)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if block is not None:
        blocks = (-(-(n + offset[0]) // block[0]), -(-(k + offset[1]) // block[1]))
        if scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
            raise ValueError(f"scale must be fp32 of shape {blocks} (blocks of {block}), got"
                             f" {scale.dtype} {tuple(scale.shape)}")  # fmt: skip
    elif scale.dtype != torch.float32 or scale.numel() not in (1, n):
        raise ValueError(f"scale must be fp32 with 1 or {n} values, got {scale.dtype}"
                         f" {tuple(scale.shape)}")  # fmt: skip
    common.check_layer(x, n, bias, [weight, scale])

    def run(
        rows: torch.Tensor, y: torch.Tensor, grid: tuple[int, int], tiles: dict[str, Any]
    ) -> None:
        _w8a16_kernel[grid](
            rows, weight, scale.reshape(-1), weight if bias is None else bias, y,
            rows.shape[0], n, k, offset[0], offset[1], scale.shape[-1] if block else 1,
            PER_CHANNEL=block is None and scale.numel() == n and n > 1,
            SCALE_N=block[0] if block else 0, SCALE_K=block[1] if block else 0,
            HAS_BIAS=bias is not None, **tiles,
        )  # fmt: skip

    return common.launch(x, k, n, run)
