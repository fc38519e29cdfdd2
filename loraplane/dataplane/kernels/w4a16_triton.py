"""W4A16 in Triton: a 4-bit weight dequantized tile by tile inside the matrix product, beside
its launcher. Same meaning as the torch path of models/quant_w4.py (the CPU path and the test
oracle), over the same packed layout:

    for each row m of x and output column n:
        y[m, n] = sum_k x[m, k] * w(n, k) (+ bias[n])          accumulated in fp32
        w(n, k) = ((u[n, k] - z[n, g]) * s[n, g]).to(x.dtype),  g = g_idx[k] or k // group_size
        u[n, k] = (qweight[n, k // 8] >> 4 * (k % 8)) & 0xF;    z = qzeros[n, g] or 8

Grid: (row blocks, column blocks); a program walks `in` in BLOCK_K steps, unpacks BLOCK_N x
BLOCK_K nibbles from their int32 words (each word read by the eight lanes that share it, from
cache), scales them by their groups' scales and zeros, and multiplies with tl.dot. The full
weight is never written: per call the device reads half a byte per weight (plus the groups'
scales) instead of rebuilding a 16-bit copy as the torch path does.
Shared with the 8-bit kernel (w8a16_triton.py) through kernels/quant_gemm_common.py: the
checks of x, the tiles, the launch, and each program's loads of x and its store.
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

from loraplane.dataplane.kernels import quant_gemm_common as common

__all__ = ["w4a16_linear"]


@triton.jit  # type: ignore[untyped-decorator]
def _w4a16_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [M, K] activation dtype
    qweight_ptr,  # [N, K / 8] int32
    scales_ptr,  # [N, G] float
    qzeros_ptr,  # [N, G] uint8 (read only with HAS_ZEROS)
    g_idx_ptr,  # [K] int32 (read only with HAS_G_IDX)
    bias_ptr,  # [N] (read only with HAS_BIAS)
    y_ptr,  # [M, N] activation dtype
    M,
    N,
    K,
    G,
    group_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, m_mask, n_mask = common.tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = common.load_x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, K)  # [BLOCK_M, BLOCK_K]
        w_mask = n_mask[:, None] & k_mask[None, :]
        words = tl.load(
            qweight_ptr + offs_n[:, None] * (K // 8) + (offs_k // 8)[None, :], mask=w_mask, other=0
        )  # [BLOCK_N, BLOCK_K]: each word once per nibble it holds
        u = (words >> ((offs_k % 8) * 4)[None, :]) & 0xF
        # each column's group: act-order's map, else contiguous groups
        g = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0) if HAS_G_IDX else offs_k // group_size
        at = offs_n[:, None] * G + g[None, :]  # [BLOCK_N, BLOCK_K]
        s = tl.load(scales_ptr + at, mask=w_mask, other=0.0).to(tl.float32)
        z = tl.load(qzeros_ptr + at, mask=w_mask, other=0).to(tl.float32) if HAS_ZEROS else 8.0
        w = ((u.to(tl.float32) - z) * s).to(x_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    common.store_tile(acc, bias_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)


def w4a16_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W^T (+ bias) with W in quant_w4's packed layout (module docstring); x is
    [..., K] in fp16, bf16 or fp32, y [..., N] in x's dtype."""
    n, words = qweight.shape
    k = words * 8
    common.check_x(x, k)
    if qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32, got {qweight.dtype}")
    groups = scales.shape[1]
    # with an act-order map, any count of groups (a tensor-parallel slice of the inputs
    # keeps the whole layer's: models/quant_w4.W4Linear.hold_groups)
    if scales.shape[0] != n or (g_idx is None and k != groups * group_size):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit [{n}, {k} / {group_size}]")
    if qzeros is not None and (qzeros.shape != scales.shape or qzeros.dtype != torch.uint8):
        raise ValueError(f"qzeros must be uint8 {tuple(scales.shape)}, got {qzeros.dtype}"
                         f" {tuple(qzeros.shape)}")  # fmt: skip
    if g_idx is not None and g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
    common.check_layer(x, n, bias, [qweight, scales, qzeros, g_idx])

    def run(
        rows: torch.Tensor, y: torch.Tensor, grid: tuple[int, int], tiles: dict[str, Any]
    ) -> None:
        _w4a16_kernel[grid](
            rows, qweight, scales, qweight if qzeros is None else qzeros,
            qweight if g_idx is None else g_idx, qweight if bias is None else bias, y,
            rows.shape[0], n, k, groups, group_size,
            HAS_ZEROS=qzeros is not None, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
            **tiles,
        )  # fmt: skip

    return common.launch(x, k, n, run)
