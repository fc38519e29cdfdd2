"""Paged attention over a flat batch: the metadata the model runner builds and the torch path.

A step's batch is T query tokens from B sequences laid end to end (`cu_seqlens_q`). Each
sequence's queries are the LAST q_len positions of its context: a prefill chunk, one decode
token, or the uncached tail of a prompt whose prefix is already in the cache. Keys and values
live in a paged cache, `[num_blocks, block_size, num_kv_heads, head_dim]` per layer, addressed
through each sequence's block table. This module is the one place attention is computed, so a
fused kernel can replace `paged_attention` without touching the model.

`LORAPLANE_ATTENTION` picks the implementation (read at each call, so tests can set it): `auto`
(the default: the Triton kernel `kernels/attention_triton.py` on CUDA, the torch path here on
CPU), `torch` or `triton`. `triton` on CPU tensors needs `TRITON_INTERPRET=1` set before Triton
is first imported; Triton is imported only when its path is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812

from loraplane.dataplane.kernels.backends import choose

_INT_DTYPES = (torch.int32, torch.int64)
ENV = "LORAPLANE_ATTENTION"
BACKENDS = ("auto", "torch", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch and where its K/V live in the cache.

    `host_cu_seqlens_q` / `host_context_lens` are the same numbers as Python ints; pass them when
    the tensors are on a GPU so the torch path never waits on the device (they are read back
    once otherwise).
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int: query offsets into the flat batch, starts at 0
    context_lens: torch.Tensor  # [B] int: cached prefix + this step's new tokens, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    host_cu_seqlens_q: list[int] = field(default_factory=list)
    host_context_lens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("cu_seqlens_q", "context_lens", "block_tables", "slot_mapping"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype not in _INT_DTYPES:
                raise ValueError(f"{name} must be an int32 or int64 tensor")
        if self.cu_seqlens_q.dim() != 1 or self.cu_seqlens_q.numel() < 1:
            raise ValueError("cu_seqlens_q must be 1-D with B + 1 entries")
        batch = self.cu_seqlens_q.numel() - 1
        if self.context_lens.shape != (batch,):
            raise ValueError(
                f"context_lens has shape {tuple(self.context_lens.shape)}, expected ({batch},)"
            )
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != batch:
            raise ValueError(
                f"block_tables has shape {tuple(self.block_tables.shape)}, expected ({batch}, N)"
            )
        if not self.host_cu_seqlens_q:
            self.host_cu_seqlens_q = [int(v) for v in self.cu_seqlens_q.tolist()]
        if not self.host_context_lens:
            self.host_context_lens = [int(v) for v in self.context_lens.tolist()]
        cu, ctx = self.host_cu_seqlens_q, self.host_context_lens
        if len(cu) != batch + 1 or len(ctx) != batch:
            raise ValueError("host_cu_seqlens_q / host_context_lens do not match the tensors")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_q must start at 0, got {cu[0]}")
        for i in range(batch):
            q_len = cu[i + 1] - cu[i]
            if q_len < 1:
                raise ValueError(f"cu_seqlens_q: sequence {i} has {q_len} query tokens")
            if ctx[i] < q_len:
                raise ValueError(
                    f"context_lens[{i}] = {ctx[i]} is smaller than its {q_len} query tokens"
                )
        if self.slot_mapping.shape != (cu[-1],):
            raise ValueError(
                f"slot_mapping has shape {tuple(self.slot_mapping.shape)}, expected ({cu[-1]},)"
            )

    @property
    def num_seqs(self) -> int:
        """B: sequences in the step."""
        return len(self.host_context_lens)

    @property
    def num_tokens(self) -> int:
        """T: query tokens in the flat batch."""
        return self.host_cu_seqlens_q[-1]

    @classmethod
    def build(
        cls,
        q_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences given as host lists (what a model runner holds).

        Sequence i's queries are context positions `context_lens[i] - q_lens[i]` to
        `context_lens[i] - 1`; its block table must cover `context_lens[i]` tokens.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not len(q_lens) == len(context_lens) == len(block_tables):
            raise ValueError("q_lens, context_lens and block_tables must have one entry per seq")
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.full((len(block_tables), max(width, 1)), -1, dtype=torch.int32)
        slots: list[torch.Tensor] = []
        for i, (q_len, ctx, table) in enumerate(
            zip(q_lens, context_lens, block_tables, strict=True)
        ):
            if len(table) * block_size < ctx:
                raise ValueError(
                    f"block_tables[{i}] has {len(table)} blocks of {block_size}: too few for "
                    f"context_lens[{i}] = {ctx}"
                )
            if any(b < 0 for b in table):
                raise ValueError(f"block_tables[{i}] holds a negative block id")
            row = torch.tensor(list(table), dtype=torch.int64)
            tables[i, : len(table)] = row.to(torch.int32)
            pos = torch.arange(ctx - q_len, ctx, dtype=torch.int64)
            slots.append(row[pos // block_size] * block_size + pos % block_size)
        cu = [0]
        for q_len in q_lens:
            cu.append(cu[-1] + q_len)
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        return cls(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            slot_mapping=slot_mapping.to(device),
            host_cu_seqlens_q=cu,
            host_context_lens=list(context_lens),
        )


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
) -> None:
    """k_cache.flat[slot_mapping[t]] = k[t] (and v), for every new token t."""
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


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


def backend(q: torch.Tensor) -> str:
    """The implementation `paged_attention` uses for queries `q`: torch or triton."""
    return choose(ENV, BACKENDS, q)


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
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal grouped-query attention through the paged cache.

    write_kv(k, v) at meta.slot_mapping
    for each sequence i with queries q[s:e] and context length c:
        K, V = cache rows of block_tables[i] for positions 0..c-1
        S = q K^T * scale;  S = softcap * tanh(S / softcap) when softcap is set (Gemma 2)
        out[s:e] = softmax(S + causal/sliding mask) V, queries at positions c-(e-s)..c-1
    A sliding window w lets the query at position p see keys p-w+1..p only (Mistral, Gemma).
    The attention itself runs in the Triton kernel or in `torch_attention`, as `backend(q)` says.
    """
    check_options(sliding_window, softcap)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if backend(q) == "triton":
        from loraplane.dataplane.kernels import attention_triton

        return attention_triton.paged_attention(
            q, k_cache, v_cache, meta, scale, sliding_window, softcap=softcap
        )
    return torch_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap)


def check_options(sliding_window: int | None, softcap: float | None) -> None:
    """ValueError unless the window is None or >= 1 and the soft-cap None or > 0."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")


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
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """`paged_attention` after its write_kv, in torch: the CPU path and the Triton kernel's
    oracle. Single-token queries share one padded gather + SDPA; others get an SDPA each."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu, ctx_lens = meta.host_cu_seqlens_q, meta.host_context_lens
    decodes = [i for i in range(len(ctx_lens)) if cu[i + 1] - cu[i] == 1]
    if len(decodes) > 1:  # one batched call for all single-token queries
        _decode_attention(q, k_cache, v_cache, meta, decodes, out, scale, sliding_window, softcap)
    batched = set(decodes) if len(decodes) > 1 else set()
    for i, ctx in enumerate(ctx_lens):
        if i in batched:
            continue
        start, end = cu[i], cu[i + 1]
        num_blocks = -(-ctx // block_size)
        blocks = meta.block_tables[i, :num_blocks].long()
        keys = k_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)  # [kv_heads, ctx, head_dim]
        values = v_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        queries = q[start:end].transpose(0, 1)  # [heads, q_len, head_dim]
        mask = _mask(end - start, ctx, sliding_window, q.device)
        attended = _attend(queries, keys.to(q.dtype), values.to(q.dtype), mask, scale, softcap)
        out[start:end] = attended.transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    seqs: list[int],  # sequences whose single query is their last position
    out: torch.Tensor,  # [T, num_heads, head_dim], written at those sequences' rows
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Attention of many one-token queries in one call: their contexts are gathered from the
    cache into a padded [B, max_ctx] batch and the padding is masked out."""
    block_size = k_cache.shape[1]
    cu, ctx_lens = meta.host_cu_seqlens_q, meta.host_context_lens
    lens = [ctx_lens[i] for i in seqs]
    width = -(-max(lens) // block_size)
    index = torch.tensor(seqs, device=q.device)
    tables = meta.block_tables[index, :width].long().clamp_min(0)  # [B, width]; -1 pads -> 0
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, width*bs, head_dim]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    rows = torch.tensor([cu[i] for i in seqs], device=q.device)
    queries = q[rows].unsqueeze(2)  # [B, heads, 1, head_dim]
    positions = torch.arange(width * block_size, device=q.device)  # [width*bs]
    ctx = torch.tensor(lens, device=q.device)[:, None]  # [B, 1]
    allowed = positions < ctx  # [B, width*bs]
    if sliding_window is not None:
        allowed &= positions > ctx - 1 - sliding_window
    attended = _attend(
        queries, keys.to(q.dtype), values.to(q.dtype), allowed[:, None, None, :], scale, softcap
    )  # [B, heads, 1, head_dim]
    out[rows] = attended.squeeze(2)
