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
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

__all__ = ["w4a16_linear"]
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * K + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
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
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the 16-row minimum tl.dot takes for decode steps, wider
    row tiles for prefill."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, 64


def w4a16_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W^T (+ bias) with W in quant_w4's packed layout (module docstring); x is
    [..., K] in fp16, bf16 or fp32, y [..., N] in x's dtype."""
    n, words = qweight.shape
    k = words * 8
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {_DTYPES}, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32, got {qweight.dtype}")
    groups = scales.shape[1]
    if scales.shape[0] != n or k != groups * group_size:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit [{n}, {k} / {group_size}]")
    if qzeros is not None and (qzeros.shape != scales.shape or qzeros.dtype != torch.uint8):
        raise ValueError(f"qzeros must be uint8 {tuple(scales.shape)}, got {qzeros.dtype}"
                         f" {tuple(qzeros.shape)}")  # fmt: skip
    if g_idx is not None and g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    tensors = [t for t in (qweight, scales, qzeros, g_idx, bias) if t is not None]
    if not all(t.is_contiguous() and t.device == x.device for t in tensors):
        raise ValueError("the layer's tensors must be contiguous and on x's device")
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k = _blocks(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        rows, qweight, scales, qweight if qzeros is None else qzeros,
        qweight if g_idx is None else g_idx, qweight if bias is None else bias, y,
        m, n, k, groups, group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_ZEROS=qzeros is not None,
        HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
