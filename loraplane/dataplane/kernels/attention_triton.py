"""Paged attention in Triton: one varlen kernel for prefill chunks, cached-prefix tails and
decode rows in the same launch, beside its launcher.

Same meaning as `attention.torch_attention` (the CPU path and the test oracle): sequence
i's q_len queries are the last q_len positions of its context, its keys and values live in the
paged cache `[num_blocks, block_size, num_kv_heads, head_dim]` at the blocks of its block
table, and attention is causal (plus an optional sliding window and an optional tanh
soft-cap of the scores, Gemma 2's) and grouped-query. An FP8 cache (kv_quant.py) is read as
fp8 tiles dequantized on load: times k_scale / v_scale in fp32, rounded to q's dtype, as the torch
path dequantizes the rows it gathers.

Grid and tiling (G = num_heads // num_kv_heads query heads per KV head):
- (q block, kv head, kv split). A q block is BLOCK_Q = BLOCK_M // G consecutive queries of one
  sequence times the G query heads that share a KV head, so each K/V tile read from memory
  serves BLOCK_M rows of scores (GQA packing: a decode row is G rows, not 1).
- Sequence i's q blocks are numbered from cu_seqlens_q[i] // BLOCK_Q + i, so a program finds
  its sequence by binary search over cu_seqlens_q and the host never builds a per-block table;
  programs past their sequence's last q block exit at once (the grid is T // BLOCK_Q + B).
- A program walks its sequence's keys in tiles of TILE_N positions through the block table,
  from the first key its sliding window can see to its last query's position (causal: later
  keys are never read), with an online softmax (running max and sum, fp32, base 2).
- Split-KV (decode only, when B x KV heads programs would leave SMs idle): the tiles of a
  q block are shared out over NUM_SPLITS programs that write unnormalised partials (acc, max,
  sum; fp32) which a second kernel combines per (token, head).
"""

# Triton's convention: compile-time (tl.constexpr) kernel parameters are in capitals.
# ruff: noqa: N803

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]  # Triton ships no type information
import triton.language as tl  # type: ignore[import-untyped]

from loraplane.dataplane import kv_quant
from loraplane.dataplane.attention_metadata import AttentionMetadata, check_options
from loraplane.dataplane.kernels import interpreter

interpreter.skip_nested_patching()  # in the interpreter: one language swap a launch

__all__ = ["AttentionConfig", "default_config", "paged_attention"]
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x * log2(e))
_MAX_SPLITS = 16


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile sizes and launch parameters (powers of two; >= 16 where they feed tl.dot)."""

    block_m: int = 64  # score rows per program: queries x the query heads of one KV head
    tile_n: int = 64  # key positions per loop step
    num_splits: int = 1  # programs sharing one q block's keys (split-KV, then a combine)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n", "num_splits", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        for name in ("block_m", "tile_n"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name} must be >= 16 (tl.dot), got {getattr(self, name)}")
        if self.num_splits > _MAX_SPLITS:
            raise ValueError(f"num_splits must be <= {_MAX_SPLITS}, got {self.num_splits}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splits only add work
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def default_config(
    meta: AttentionMetadata, num_kv_heads: int, group: int, head_dim: int, device: torch.device
) -> AttentionConfig:
    """Small q blocks when every row decodes, 64-row blocks otherwise; split-KV when a decode
    batch has too few (sequence, KV head) programs to fill the GPU twice over."""
    decode_only = meta.num_tokens == meta.num_seqs  # every q_len is >= 1
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group))
    tile_n = 64 if head_dim <= 128 else 32
    splits = 1
    programs = meta.num_seqs * num_kv_heads
    target = 2 * _num_sms(device)
    if decode_only and programs < target:
        tiles = triton.cdiv(max(meta.host_context_lens), tile_n)
        while splits * 2 <= _MAX_SPLITS and programs * splits < target and tiles >= 8 * splits:
            splits *= 2
    return AttentionConfig(block_m=block_m, tile_n=tile_n, num_splits=splits)


# The kernels. Triton's JIT reads the parameters' annotations itself (`tl.constexpr` marks
# compile-time ones), so runtime parameters stay bare: hence a `no-untyped-def` ignore per
# jitted function (plus `untyped-decorator` where some parameters carry `tl.constexpr`).


@triton.jit  # type: ignore[untyped-decorator]
def _find_seq(cu_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]
    # the last sequence i whose first q block, cu[i] // BLOCK_Q + i, is <= q_block
    lo = q_block * 0  # int32 tensors, whatever the arguments were specialised to
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]
    # tanh from exp2 (no tl.tanh; libdevice's is CUDA-only): odd, and exp2 of a non-positive
    # number never overflows; absolute error ~1e-7, well inside the fp32 tolerance
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit  # type: ignore[untyped-decorator]
def _attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, H, D] (NUM_SPLITS == 1)
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_PAD] fp32, unnormalised (NUM_SPLITS > 1)
    part_ml_ptr,  # [T, H, NUM_SPLITS, 2] fp32: running max (base 2) and sum
    q_ptr,  # [T, H, D]
    k_ptr,  # [num_blocks, block_size, KV, D], q's dtype or fp8 e4m3 (KV_FP8)
    v_ptr,  # [num_blocks, block_size, KV, D]
    tables_ptr,  # [B, max_blocks] int
    cu_ptr,  # [B + 1] int
    ctx_ptr,  # [B] int
    scale,  # fp32: softmax scale * log2(e); without SOFTCAP, scale / softcap with it
    k_scale,  # fp32: an FP8 cache's K dequantization scale (KV_FP8; else not read)
    v_scale,  # fp32: its V scale
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,  # 0: full causal attention
    SOFTCAP: tl.constexpr,  # 0.0: no soft-capping; else softcap * log2(e)
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # compute the products in fp32 (bf16 under the interpreter)
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds fp8 e4m3: dequantize each tile on load
):
    block_q: tl.constexpr = BLOCK_M // GROUP  # queries per program
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(cu_ptr, q_block, num_seqs, block_q)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    local = q_block - (q_start // block_q + seq)
    if local * block_q >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    qi = local * block_q + rows // GROUP  # [BLOCK_M]: query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]: query head
    row_mask = (rows // GROUP < block_q) & (qi < q_len)
    pos = ctx - q_len + qi  # [BLOCK_M]: each row's query position in the context
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM
    token = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    # keys this q block can see: [first, last]; tiles of them shared out over the splits
    first_q = ctx - q_len + local * block_q
    last = tl.minimum(first_q + block_q, ctx) - 1
    first = 0
    if WINDOW > 0:
        first = tl.maximum(first_q - WINDOW + 1, 0)
    tile_lo = first // TILE_N
    tile_hi = last // TILE_N + 1
    per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
    tile_start = tile_lo + split * per_split
    tile_end = tl.minimum(tile_start + per_split, tile_hi)

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_PAD), dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    for t in range(tile_start, tile_end):
        keys = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key positions
        k_mask = keys <= last
        block = tl.load(table + keys // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        k_rows = k_ptr + block * stride_kb + offset * stride_kp + kv_head * stride_kh
        v_rows = v_ptr + block * stride_vb + offset * stride_vp + kv_head * stride_vh
        k_t = tl.load(
            k_rows[None, :] + offs_d[:, None],
            mask=d_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [HEAD_PAD, TILE_N]
        v = tl.load(
            v_rows[:, None] + offs_d[None, :],
            mask=k_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_PAD]
        if KV_FP8:  # as kv_quant.dequantize: the product in fp32, rounded to q's dtype
            k_t = (k_t.to(tl.float32) * k_scale).to(q_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * v_scale).to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * scale  # [BLOCK_M, TILE_N]
        if SOFTCAP > 0.0:  # softcap * tanh(s / softcap), in base 2 like the other scores
            scores = _tanh(scores) * SOFTCAP
        allowed = (keys[None, :] <= pos[:, None]) & k_mask[None, :]
        if WINDOW > 0:
            allowed &= keys[None, :] > pos[:, None] - WINDOW
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        s = s * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if NUM_SPLITS == 1:  # every row of a real query saw at least its own position: s > 0
        out = acc / tl.where(row_mask, s, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:  # partials; an empty split leaves max -inf and sum 0, which the combine ignores
        slot = (token * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(
            part_acc_ptr + slot[:, None] * HEAD_PAD + offs_d[None, :],
            acc,
            mask=row_mask[:, None],
        )
        tl.store(part_ml_ptr + slot * 2, m, mask=row_mask)
        tl.store(part_ml_ptr + slot * 2 + 1, s, mask=row_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _combine_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_PAD] fp32
    part_ml_ptr,  # [T, H, NUM_SPLITS, 2] fp32
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = token * num_heads + head
    splits = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + (base * NUM_SPLITS + splits) * 2)  # [NUM_SPLITS]
    s = tl.load(part_ml_ptr + (base * NUM_SPLITS + splits) * 2 + 1)
    m_max = tl.max(m, axis=0)  # finite: the split holding the query's own position saw it
    weight = tl.exp2(m - m_max)  # 0 for empty splits (m = -inf)
    total = tl.sum(weight * s, axis=0)
    offs_d = tl.arange(0, HEAD_PAD)
    acc = tl.load(
        part_acc_ptr + (base * NUM_SPLITS + splits)[:, None] * HEAD_PAD + offs_d[None, :]
    )  # [NUM_SPLITS, HEAD_PAD]
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# The launcher.


def is_interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_attention_kernel).__name__ == "InterpretedFunction"


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(
            f"q must be [T, num_heads, head_dim] with unit last stride, got {tuple(q.shape)}"
        )
    if q.dtype not in _DTYPES:
        raise ValueError(f"q is {q.dtype}; supported: fp16, bf16, fp32")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.stride(3) != 1:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim] with unit "
                f"last stride, got {tuple(cache.shape)}"
            )
        if cache.dtype != q.dtype and not kv_quant.is_fp8(cache):
            raise ValueError(f"{name} is {cache.dtype}; q is {q.dtype} (or an fp8 e4m3 cache)")
        if cache.device != q.device:
            raise ValueError(f"{name} is on {cache.device}; q is on {q.device}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache is {v_cache.dtype}; k_cache is {k_cache.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"the cache's head_dim is {k_cache.shape[3]}; q's is {q.shape[2]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
        )
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens; meta has {meta.num_tokens}")
    for name in ("cu_seqlens_q", "context_lens", "block_tables"):
        t = getattr(meta, name)
        if t.device != q.device:
            raise ValueError(f"meta.{name} is on {t.device}; q is on {q.device}")
        if not t.is_contiguous() and name != "block_tables":
            raise ValueError(f"meta.{name} must be contiguous")
    if meta.block_tables.stride(1) != 1:
        raise ValueError("meta.block_tables must have unit column stride")
    if q.device.type != "cuda" and not is_interpreted():
        raise ValueError(
            f"q is on {q.device}: the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 "
            "set before Triton is first imported"
        )


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's K in
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's V in
    meta: AttentionMetadata,  # tensors on q's device
    scale: float,
    sliding_window: int | None = None,
    config: AttentionConfig | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    """Causal grouped-query attention of a flat varlen batch through the paged cache.

    Semantics (those of the torch path `attention.torch_attention(q, k_cache, v_cache, meta,
    scale, sliding_window, softcap, k_scale, v_scale)`, the test oracle):
        G = num_heads // num_kv_heads
        for each sequence i, queries q[s:e] with s, e = cu_seqlens_q[i], cu_seqlens_q[i+1],
                context c = context_lens[i]:
            K, V = the cache rows of positions 0..c-1 (position j: block
                   block_tables[i, j // block_size], offset j % block_size); an fp8 cache's
                   as (K8.float() * k_scale).to(q.dtype), V with v_scale
            for query t in s..e-1 at position p = c - (e - s) + (t - s), head h:
                allowed j: j <= p, and j > p - sliding_window when a window is set
                s_j = scale * q[t, h] . K[j, h // G]
                s_j = softcap * tanh(s_j / softcap) when softcap is set (Gemma 2)
                out[t, h] = softmax_j(s_j) @ V[:, h // G]
    The caller has written this step's K/V into the cache (slot_mapping); the kernel reads the
    cache only. Products accumulate in fp32 and the softmax is in fp32; for fp16/bf16 the
    probabilities are rounded to the input dtype before the product with V (as flash attention
    does). Rows of a sequence may be a prefill chunk, the uncached tail of a cached prefix, or
    one decode token, all in one launch.
    """
    _check(q, k_cache, v_cache, meta)
    check_options(sliding_window, softcap)
    tokens, num_heads, head_dim = q.shape
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    cfg = config or default_config(meta, num_kv_heads, group, head_dim, q.device)
    if cfg.block_m < group:
        raise ValueError(f"block_m ({cfg.block_m}) must cover the {group} heads of a KV head")
    block_q = cfg.block_m // group
    head_pad = max(16, triton.next_power_of_2(head_dim))
    splits = cfg.num_splits
    if splits > 1:
        part_acc = torch.empty(tokens, num_heads, splits, head_pad, dtype=torch.float32,
                               device=q.device)  # fmt: skip
        part_ml = torch.empty(tokens, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not read: NUM_SPLITS == 1 stores the result directly
    grid = (tokens // block_q + meta.num_seqs, num_kv_heads, splits)
    interpreted_bf16 = is_interpreted() and q.dtype == torch.bfloat16
    _attention_kernel[grid](
        out, part_acc, part_ml, q, k_cache, v_cache,
        meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
        scale / softcap if softcap else scale * _LOG2E, float(k_scale), float(v_scale),
        meta.num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, WINDOW=sliding_window or 0,
        SOFTCAP=float(softcap * _LOG2E) if softcap else 0.0,
        NUM_SPLITS=splits, DOT_FP32=interpreted_bf16,
        PRECISION="ieee" if q.dtype == torch.float32 or interpreted_bf16 else "tf32",
        KV_FP8=kv_quant.is_fp8(k_cache), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(tokens, num_heads)](
            out, part_acc, part_ml, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=splits,
        )  # fmt: skip
    return out
