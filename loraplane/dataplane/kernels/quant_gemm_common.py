"""What the weight-only quantized GEMM kernels (w4a16_triton.py, w8a16_triton.py) share: the
activation checks, the tiles, the launch over [M, N] tiles and each program's first and last
steps. Each kernel adds only how it dequantizes a weight tile:

    rows = x.reshape(-1, K)                              # [M, K] in fp16, bf16 or fp32
    for each (BLOCK_M x BLOCK_N) tile of y (grid: row blocks, column blocks):
        acc = 0 (fp32)                                   # tile(...): its rows and columns
        for each BLOCK_K step: acc += load_x_tile(...) @ dequantized weight tile^T
        store_tile(acc + bias) into y                    # [M, N] in x's dtype

`launch` builds y, picks the tiles (`blocks`) and the dot's precision, and returns early (no
launch) when x has no rows.
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

from loraplane.dataplane.kernels import interpreter

interpreter.skip_nested_patching()  # in the interpreter: one language swap a launch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # x's and y's
# (rows, y, grid, tile and precision keyword arguments) -> None: the kernel's launch
Launch = Callable[[torch.Tensor, torch.Tensor, tuple[int, int], dict[str, Any]], None]


@triton.jit  # type: ignore[untyped-decorator]
def tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """This program's tile of y: (offs_m [BLOCK_M], offs_n [BLOCK_N], their in-bounds masks)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def load_x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, K):  # type: ignore[no-untyped-def]
    """x's [BLOCK_M, BLOCK_K] tile at rows offs_m, columns offs_k (zeros outside)."""
    return tl.load(
        x_ptr + offs_m[:, None] * K + offs_k[None, :],
        mask=m_mask[:, None] & k_mask[None, :],
        other=0.0,
    )


@triton.jit  # type: ignore[untyped-decorator]
def store_tile(  # type: ignore[no-untyped-def]
    acc, bias_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS: tl.constexpr
):
    """y's [BLOCK_M, BLOCK_N] tile from the fp32 accumulator, the bias added (with HAS_BIAS)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the 16-row minimum tl.dot takes for decode steps, wider
    row tiles for prefill."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, 64


def check_x(x: torch.Tensor, k: int) -> None:
    """ValueError unless x is [..., k] in one of DTYPES."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be one of {DTYPES}, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")


def check_layer(
    x: torch.Tensor, n: int, bias: torch.Tensor | None, tensors: list[torch.Tensor | None]
) -> None:
    """ValueError unless the bias is [n] and the layer's tensors are contiguous on x's device."""
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    present = [t for t in (*tensors, bias) if t is not None]
    if not all(t.is_contiguous() and t.device == x.device for t in present):
        raise ValueError("the layer's tensors must be contiguous and on x's device")


def launch(x: torch.Tensor, k: int, n: int, run: Launch) -> torch.Tensor:
    """y [..., n] in x's dtype, its [M, n] rows written by `run(rows, y, grid, constants)`
    with rows = x as [M, k] and constants BLOCK_M, BLOCK_N, BLOCK_K and PRECISION; no launch
    when x has no rows."""
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k = blocks(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    constants = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
    }
    run(rows, y, grid, constants)
    return y.reshape(*x.shape[:-1], n)
