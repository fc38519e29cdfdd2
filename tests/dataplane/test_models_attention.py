"""AttentionMetadata checks and paged_attention against dense causal attention."""

from __future__ import annotations

import pytest
import torch

from loraplane.dataplane.attention import (
    AttentionMetadata,
    paged_attention,
    query_positions,
)


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention over one whole sequence: q [L, H, D], k/v [L, KV, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q.shape[0])
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_build_maps_each_new_token_to_its_block_and_offset() -> None:
    # seq 0: 3 cached + 2 new in blocks [7, 2]; seq 1: 1 new token at position 4 in [5, 0]
    meta = AttentionMetadata.build([2, 1], [5, 5], [[7, 2], [5, 0]], block_size=4)
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 0 * 4 + 0]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 3]
    assert meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert query_positions([2, 1], [5, 5]).tolist() == [3, 4, 4]


def test_block_tables_are_padded_with_minus_one() -> None:
    meta = AttentionMetadata.build([1, 6], [1, 6], [[3], [4, 1]], block_size=4)
    assert meta.block_tables.tolist() == [[3, -1], [4, 1]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cu_seqlens_q": [1, 3]}, "must start at 0"),
        ({"context_lens": [1]}, "smaller than its 2 query tokens"),
        ({"slot_mapping": [0, 1, 2]}, "slot_mapping has shape"),
        ({"cu_seqlens_q": [0, 0]}, "0 query tokens"),
        ({"context_lens": [2, 2]}, "context_lens has shape"),
    ],
)
def test_inconsistent_metadata_is_rejected_naming_the_field(
    kwargs: dict[str, list[int]], message: str
) -> None:
    fields = {"cu_seqlens_q": [0, 2], "context_lens": [2], "slot_mapping": [0, 1]}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        AttentionMetadata(
            cu_seqlens_q=torch.tensor(fields["cu_seqlens_q"]),
            context_lens=torch.tensor(fields["context_lens"]),
            block_tables=torch.zeros(len(fields["context_lens"]), 1, dtype=torch.int32),
            slot_mapping=torch.tensor(fields["slot_mapping"]),
        )


def test_build_refuses_a_block_table_too_short_for_the_context() -> None:
    with pytest.raises(ValueError, match="too few for context_lens"):
        AttentionMetadata.build([5], [5], [[0]], block_size=4)


def test_float_index_tensors_are_rejected() -> None:
    with pytest.raises(ValueError, match="slot_mapping must be an int32 or int64"):
        AttentionMetadata(
            torch.tensor([0, 1]),
            torch.tensor([1]),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0.0]),
        )


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "softcap2"])
@pytest.mark.parametrize("window", [None, 3])
def test_chunked_paged_attention_equals_dense_causal_attention(
    window: int | None, softcap: float | None
) -> None:
    torch.manual_seed(0)
    length, heads, kv_heads, dim, block_size = 11, 4, 2, 8, 4
    q = torch.randn(length, heads, dim) * 3  # scores of several units: a cap of 2 binds
    k, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    expected = _dense(q, k, v, window, softcap)
    k_cache = torch.zeros(6, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    table = [4, 0, 5]
    out = []
    # the same sequence in three steps: a 5-token chunk, a 4-token chunk, then 2 decode steps
    for start, end in [(0, 5), (5, 9), (9, 10), (10, 11)]:
        meta = AttentionMetadata.build([end - start], [end], [table], block_size)
        out.append(
            paged_attention(
                q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, dim**-0.5,
                window, softcap,
            )
        )  # fmt: skip
    torch.testing.assert_close(torch.cat(out), expected, atol=1e-5, rtol=1e-5)
    if softcap is not None:  # negative control: the cap changes the result
        assert not torch.allclose(_dense(q, k, v, window), expected, atol=1e-3)
    assert torch.equal(k_cache[4], k[:4]) and torch.equal(v_cache[5, :3], v[8:11])


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "softcap2"])
@pytest.mark.parametrize("window", [None, 4])
def test_batched_decode_rows_equal_dense_attention_of_each_sequence(
    window: int | None, softcap: float | None
) -> None:
    """Several one-token queries share one padded gather (the batched decode path)."""
    torch.manual_seed(1)
    heads, kv_heads, dim, block_size = 8, 1, 16, 4
    lengths, tables = [1, 6, 13], [[3], [0, 7], [1, 5, 2, 6]]
    seqs = [
        (
            torch.randn(n, heads, dim) * 3,
            torch.randn(n, kv_heads, dim),
            torch.randn(n, kv_heads, dim),
        )
        for n in lengths
    ]
    k_cache = torch.zeros(8, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    for (q, k, v), n, table in zip(seqs, lengths, tables, strict=True):  # the cached prefixes
        if n > 1:
            meta = AttentionMetadata.build([n - 1], [n - 1], [table], block_size)
            paged_attention(q[: n - 1], k[: n - 1], v[: n - 1], k_cache, v_cache, meta, 1.0)
    meta = AttentionMetadata.build([1, 1, 1], lengths, tables, block_size)
    last = [torch.cat([t[-1:] for t in part]) for part in zip(*seqs, strict=True)]
    got = paged_attention(*last, k_cache, v_cache, meta, dim**-0.5, window, softcap)
    for i, (q, k, v) in enumerate(seqs):
        expected = _dense(q, k, v, window, softcap)[-1]
        torch.testing.assert_close(got[i], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("window", "softcap", "message"),
    [(0, None, "sliding_window must be None or >= 1"), (None, 0.0, "softcap must be None or > 0")],
)
def test_bad_window_or_softcap_is_rejected_naming_it(
    window: int | None, softcap: float | None, message: str
) -> None:
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    cache = torch.zeros(1, 4, 2, 8)
    meta = AttentionMetadata.build([1], [1], [[0]], 4)
    with pytest.raises(ValueError, match=message):
        paged_attention(q, k, k, cache, cache.clone(), meta, 1.0, window, softcap)
