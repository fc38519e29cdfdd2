"""Paged decode attention on the CPU through the native library (`sgmv_cpu.c`,
`loraplane_decode_attention_f32`): a step's single-token queries read K and V in place from the
paged cache, where the torch path (`attention._decode_attention`) first gathers every
sequence's blocks into a padded copy and masks the padding.

`decode` takes fp32 CPU tensors with dense caches and answers False for anything else (an FP8
cache, bf16, a strided view), so the caller runs the torch path. The library is the one the
LoRA kernel loads (`sgmv_cpu.library`: prebuilt or compiled here; None where neither can be).
"""

from __future__ import annotations

import torch

from loraplane.dataplane.kernels import sgmv_cpu


def available(q: torch.Tensor) -> bool:
    """Whether `decode` can serve queries like `q` (fp32 on the CPU, the library loaded)."""
    return q.dtype == torch.float32 and q.device.type == "cpu" and sgmv_cpu.library() is not None


def decode(
    q: torch.Tensor,  # [T, heads, dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, dim]
    tables: torch.Tensor,  # [B, width] int32: each sequence's blocks (padding never read)
    context_lens: torch.Tensor,  # [B] int32
    rows: torch.Tensor,  # [B] int64: each sequence's query row in q and out
    out: torch.Tensor,  # [T, heads, dim], written at `rows`
    scale: float,
    softcap: float | None,
    window: int | None,
) -> bool:
    """out[rows[b]] = attention of q[rows[b]] over sequence b's context; False (nothing
    written) when the tensors are not ones the kernel takes."""
    lib = sgmv_cpu.library()
    if lib is None or not _fits(q, k_cache, v_cache, tables, context_lens, rows, out):
        return False
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[3] != dim:
        return False
    status = lib.loraplane_decode_attention_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
        tables.data_ptr(), tables.stride(0), context_lens.data_ptr(), rows.data_ptr(),
        rows.shape[0], heads, kv_heads, dim, scale, softcap or 0.0, window or 0,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    return bool(status == 0)


def _fits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    floats = (q, k_cache, v_cache, out)
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in floats)
        and q.dim() == 3
        and out.shape == q.shape
        and k_cache.dim() == 4
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and out.stride(2) == 1
        and out.stride(1) == out.shape[2]
        and tables.dtype == torch.int32
        and tables.dim() == 2
        and tables.stride(1) == 1
        and context_lens.dtype == torch.int32
        and context_lens.is_contiguous()
        and rows.dtype == torch.int64
        and rows.is_contiguous()
        and tables.shape[0] == context_lens.shape[0] == rows.shape[0]
    )


__all__ = ["available", "decode"]
