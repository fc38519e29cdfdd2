"""Paged attention over a flat batch: the metadata the model runner builds and the torch path.

A step's batch is T query tokens from B sequences laid end to end (`cu_seqlens_q`). Each
sequence's queries are the LAST q_len positions of its context: a prefill chunk, one decode
token, or the uncached tail of a prompt whose prefix is already in the cache. Keys and values
live in a paged cache, `[num_blocks, block_size, num_kv_heads, head_dim]` per layer, addressed
through each sequence's block table. This module is the one place attention is computed, so a
fused kernel can replace `paged_attention` without touching the model. An FP8 cache
(kv_quant.py) stores K / k_scale and V / v_scale in float8 e4m3 and is read back times the
scales, in the queries' dtype.

`LORAPLANE_ATTENTION` picks the implementation (read once per step, when the step's
`AttentionMetadata` is built, so tests can set it between steps): `auto`
(the default: the Triton kernel `kernels/attention_triton.py` on CUDA; on the CPU the torch
path, its decode queries in the native kernel `kernels/attention_cpu.py` for fp32 where the
native library loads), `native`, `torch` (the torch path throughout) or `triton`. `triton` on
CPU tensors needs `TRITON_INTERPRET=1` set before Triton is first imported; Triton is imported
only when its path is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from loraplane.dataplane import kv_quant
from loraplane.dataplane.attention_metadata import AttentionMetadata, check_options
from loraplane.dataplane.kernels import attention_cpu
from loraplane.dataplane.kernels.backends import ATTENTION_BACKENDS, ATTENTION_ENV, choose, resolve

__all__ = ["AttentionMetadata", "check_options", "paged_attention", "query_positions", "write_kv"]
ENV = ATTENTION_ENV
BACKENDS = ATTENTION_BACKENDS


def query_positions(
    q_lens: Sequence[int], context_lens: Sequence[int], device: torch.device | str = "cpu"
) -> torch.Tensor:  # [T] int64
    """The position of every query token in the flat batch (the model's RoPE input)."""
    parts = [
        torch.arange(c - q, c, dtype=torch.int64) for q, c in zip(q_lens, context_lens, strict=True)
    ]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(device)


def write_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k_cache.flat[slot_mapping[t]] = k[t] (and v), for every new token t; into an FP8 cache
    kv_quant.quantize(k[t], k_scale) (and v with v_scale)."""
    slots = slot_mapping.long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        if kv_quant.is_fp8(cache):  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            quantized = kv_quant.quantize(x, scale).view(torch.uint8)
            flat.view(torch.uint8).index_copy_(0, slots, quantized)
        else:
            flat.index_copy_(0, slots, x.to(cache.dtype))


def _mask(q_len: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[q_len, ctx] bool: query at position p sees keys j <= p (and j > p - window)."""
    if q_len == 1 and (window is None or ctx <= window):
        return None
    keys = torch.arange(ctx, device=device)
    queries = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > queries - window
    return allowed


def backend(q: torch.Tensor, meta: AttentionMetadata | None = None) -> str:
    """The implementation `paged_attention` uses for queries `q`: native (the torch path with
    its decode queries in the native CPU kernel), torch or triton; the choice `meta` read for
    its step, else `LORAPLANE_ATTENTION` now."""
    if meta is not None:
        return resolve(meta.backend, q, _cpu_auto)
    return choose(ENV, BACKENDS, q, cpu_auto=_cpu_auto)


def _cpu_auto(q: torch.Tensor) -> str:
    """`auto` off CUDA: the native kernel for fp32 CPU queries where the library loads."""
    return "native" if attention_cpu.available(q) else "torch"


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], RoPE applied
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal grouped-query attention through the paged cache.

    write_kv(k, v) at meta.slot_mapping (an FP8 cache: k / k_scale and v / v_scale, in e4m3)
    for each sequence i with queries q[s:e] and context length c:
        K, V = cache rows of block_tables[i] for positions 0..c-1 (FP8: times k_scale, v_scale)
        S = q K^T * scale;  S = softcap * tanh(S / softcap) when softcap is set (Gemma 2)
        out[s:e] = softmax(S + causal/sliding mask) V, queries at positions c-(e-s)..c-1
    A sliding window w lets the query at position p see keys p-w+1..p only (Mistral, Gemma).
    The attention itself runs in the Triton kernel or in `torch_attention`, as
    `backend(q, meta)` says.
    """
    check_options(sliding_window, softcap)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    name = backend(q, meta)
    if name == "triton":
        from loraplane.dataplane.kernels import attention_triton

        return attention_triton.paged_attention(
            q, k_cache, v_cache, meta, scale, sliding_window, softcap=softcap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return torch_attention(
        q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_scale, v_scale,
        native=name == "native",
    )  # fmt: skip


def _attend(
    queries: torch.Tensor,  # [..., heads, q_len, head_dim]
    keys: torch.Tensor,  # [..., kv_heads, ctx, head_dim], queries' dtype
    values: torch.Tensor,  # [..., kv_heads, ctx, head_dim], queries' dtype
    allowed: torch.Tensor | None,  # bool, broadcastable to [..., heads, q_len, ctx]
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [..., heads, q_len, head_dim]
    """SDPA, or without soft-capping (which SDPA cannot do) the same steps spelled out in the
    order transformers' eager Gemma 2 attention takes them: scores, cap, mask, fp32 softmax
    cast back to the queries' dtype, then V."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
        )
    # the G query heads of a KV head share its K/V: stack their rows instead of copying K/V
    *lead, heads, q_len, dim = queries.shape
    kv_heads, ctx = keys.shape[-3], keys.shape[-2]
    group = heads // kv_heads
    stacked = queries.reshape(*lead, kv_heads, group * q_len, dim)
    scores = torch.matmul(stacked, keys.transpose(-1, -2)) * scale  # [..., KV, G*q, ctx]
    scores = (torch.tanh(scores / softcap) * softcap).view(*lead, kv_heads, group, q_len, ctx)
    if allowed is not None:  # its head dimension (size 1) becomes (KV, G)
        scores = scores.masked_fill(~(allowed.unsqueeze(-3) if allowed.dim() > 2 else allowed),
                                    float("-inf"))  # fmt: skip
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    out = torch.matmul(probs.view(*lead, kv_heads, group * q_len, ctx), values)
    return out.view(*lead, heads, q_len, dim)


def torch_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's K in
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's V in
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    native: bool = False,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """`paged_attention` after its write_kv, in torch: the CPU path and the Triton kernel's
    oracle. Single-token queries share one padded gather + SDPA (with `native`, one call of
    the native CPU kernel instead, where it takes the tensors); the other sequences share one
    SDPA per (query length, context length), e.g. prompts of one length with nothing cached
    (`_attend_alike`). The gathered rows of an FP8 cache are dequantized (kv_quant.dequantize)
    to q's dtype."""
    out = torch.empty_like(q)
    cu, ctx_lens = meta.host_cu_seqlens_q, meta.host_context_lens
    plan = _decode_plan(meta, k_cache.shape[1], sliding_window, q.device)
    if plan is not None:  # one batched call for all single-token queries
        _decode_attention(
            q, k_cache, v_cache, plan, out, scale, softcap, (k_scale, v_scale), native
        )
    batched = set(plan.seqs) if plan is not None else set()
    alike: dict[tuple[int, int], list[int]] = {}  # (query length, context length) -> sequences
    for i, ctx in enumerate(ctx_lens):
        if i not in batched:
            alike.setdefault((cu[i + 1] - cu[i], ctx), []).append(i)
    for (q_len, ctx), seqs in alike.items():
        _attend_alike(q, k_cache, v_cache, meta, seqs, q_len, ctx, out, scale, sliding_window,
                      softcap, (k_scale, v_scale))  # fmt: skip
    return out


def _attend_alike(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],  # sequences of `q_len` queries each over `ctx` keys
    q_len: int,
    ctx: int,
    out: torch.Tensor,  # [T, num_heads, head_dim]: their rows written
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    kv_scales: tuple[float, float],
) -> None:
    """The attention of sequences that have the same query and context lengths, in one SDPA
    over a batch of them: one mask serves them all. A call per sequence cost about 0.25 ms of
    dispatch on the CPU, most of a prefill's attention at tens of short prompts (32 prompts of
    32 tokens, 9 heads: 9.2 ms a layer one by one, 1.8 batched, 2-core AVX2 EPYC). The batched
    call rounds differently from the single ones, by a float's last bits."""
    n, device = len(seqs), q.device
    num_blocks = -(-ctx // k_cache.shape[1])
    blocks = meta.block_tables[torch.tensor(seqs, device=device), :num_blocks].long()  # [n, nb]
    # [n, kv_heads, ctx, head_dim]
    keys = k_cache[blocks].flatten(1, 2)[:, :ctx].transpose(1, 2)
    values = v_cache[blocks].flatten(1, 2)[:, :ctx].transpose(1, 2)
    cu = meta.host_cu_seqlens_q
    if n == 1:
        rows: torch.Tensor | slice = slice(cu[seqs[0]], cu[seqs[0]] + q_len)
        queries = q[rows].unsqueeze(0)
    else:
        starts = torch.tensor([cu[i] for i in seqs], device=device)
        rows = (starts[:, None] + torch.arange(q_len, device=device)).flatten()
        queries = q.index_select(0, rows).view(n, q_len, *q.shape[1:])
    mask = _mask(q_len, ctx, sliding_window, device)
    keys = kv_quant.dequantize(keys, kv_scales[0], q.dtype)
    values = kv_quant.dequantize(values, kv_scales[1], q.dtype)
    attended = _attend(queries.transpose(1, 2), keys, values, mask, scale, softcap)
    attended = attended.transpose(1, 2)  # [n, q_len, heads, head_dim]
    if isinstance(rows, slice):
        out[rows] = attended[0]
    else:
        out.index_copy_(0, rows, attended.reshape(n * q_len, *q.shape[1:]))


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    """The layer-independent part of `_decode_attention` for one step: every layer reuses it."""

    seqs: list[int]  # sequences whose single query is their last position
    tables: torch.Tensor  # [B, width] long: their block tables, -1 padding -> block 0
    rows: torch.Tensor  # [B] int64: their query rows in the flat batch
    allowed: torch.Tensor  # [B, width * block_size] bool: the keys each one sees
    # the native kernel's inputs (kernels/attention_cpu.py): the tables and context lengths as
    # int32, and the largest block id they name (checked against the cache before a read)
    tables32: torch.Tensor  # [B, width] int32
    lens32: torch.Tensor  # [B] int32
    top_block: int
    window: int | None


def _decode_plan(
    meta: AttentionMetadata, block_size: int, sliding_window: int | None, device: torch.device
) -> _DecodePlan | None:
    """The step's plan for its single-token queries (None: fewer than two), memoized on `meta`
    when its tensors are on the CPU (a CUDA graph's metadata is refilled in place)."""
    key = ("decode", block_size, sliding_window)
    memo = meta.memo if meta.block_tables.device.type == "cpu" else {}
    if key in memo:
        return memo[key]  # type: ignore[return-value]
    cu, ctx_lens = meta.host_cu_seqlens_q, meta.host_context_lens
    seqs = [i for i in range(len(ctx_lens)) if cu[i + 1] - cu[i] == 1]
    plan = None
    if len(seqs) > 1:
        lens = [ctx_lens[i] for i in seqs]
        width = -(-max(lens) // block_size)
        index = torch.tensor(seqs, device=device)
        tables = meta.block_tables[index, :width].long().clamp_min(0)  # -1 pads -> 0
        positions = torch.arange(width * block_size, device=device)  # [width*bs]
        ctx = torch.tensor(lens, device=device)[:, None]  # [B, 1]
        allowed = positions < ctx  # [B, width*bs]
        if sliding_window is not None:
            allowed &= positions > ctx - 1 - sliding_window
        rows = torch.tensor([cu[i] for i in seqs], device=device)
        top = int(tables.max()) if device.type == "cpu" else -1  # (CPU only: no sync)
        plan = _DecodePlan(seqs, tables, rows, allowed, tables.to(torch.int32),
                           ctx.view(-1).to(torch.int32), top, sliding_window)  # fmt: skip
    memo[key] = plan
    return plan


def _decode_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: _DecodePlan,
    out: torch.Tensor,  # [T, num_heads, head_dim], written at the plan's rows
    scale: float,
    softcap: float | None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    native: bool = False,
) -> None:
    """Attention of many one-token queries in one call: with `native`, the CPU kernel reads
    their keys in place (kernels/attention_cpu.py); else their contexts are gathered from the
    cache into a padded [B, max_ctx] batch and the padding is masked out."""
    if (
        native
        and kv_scales == (1.0, 1.0)
        and 0 <= plan.top_block < k_cache.shape[0]
        and attention_cpu.decode(
            q,
            k_cache,
            v_cache,
            plan.tables32,
            plan.lens32,
            plan.rows,
            out,
            scale,
            softcap,
            plan.window,
        )
    ):
        return
    tables, rows, allowed = plan.tables, plan.rows, plan.allowed
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, width*bs, head_dim]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    queries = q[rows].unsqueeze(2)  # [B, heads, 1, head_dim]
    keys = kv_quant.dequantize(keys, kv_scales[0], q.dtype)
    values = kv_quant.dequantize(values, kv_scales[1], q.dtype)
    attended = _attend(
        queries, keys, values, allowed[:, None, None, :], scale, softcap
    )  # [B, heads, 1, head_dim]
    out[rows] = attended.squeeze(2)
