"""The native CPU decode attention (kernels/attention_cpu.py) against the torch path.

Both run inside `attention.torch_attention`: with `native=True` its single-token queries go to
the C kernel, which reads K and V in place through the block tables; the torch path gathers
and masks. Prefill queries in the same batch take the torch path either way.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplane.dataplane import attention
from loraplane.dataplane.attention import AttentionMetadata
from loraplane.dataplane.kernels import attention_cpu, sgmv_cpu
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import make_engine, prompts

pytestmark = pytest.mark.skipif(sgmv_cpu.library() is None, reason="no native CPU library")


def _batch(
    q_lens: list[int], ctx_lens: list[int], heads: int, kv_heads: int, dim: int, seed: int,
    block_size: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:  # fmt: skip
    """Queries, caches in shuffled blocks and their metadata (tables padded with -1)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-c // block_size) for c in ctx_lens]
    blocks = sum(widths) + 3
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables = torch.full((len(ctx_lens), max(widths) + 2), -1, dtype=torch.int32)
    for i, width in enumerate(widths):
        tables[i, :width] = torch.tensor(order[:width], dtype=torch.int32)
        order = order[width:]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, dim, generator=gen)
    meta = AttentionMetadata(
        torch.tensor(cu, dtype=torch.int32), torch.tensor(ctx_lens, dtype=torch.int32), tables,
        torch.zeros(cu[-1], dtype=torch.int64),
    )  # fmt: skip
    return q, k_cache, v_cache, meta


def _both(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    native = attention.torch_attention(q, k, v, meta, 0.125, native=True, **kw)  # type: ignore[arg-type]
    meta.memo.clear()
    plain = attention.torch_attention(q, k, v, meta, 0.125, native=False, **kw)  # type: ignore[arg-type]
    return native, plain


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 32), (4, 1, 128), (8, 4, 256)]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_queries_equal_the_torch_path(
    heads: int, kv_heads: int, dim: int, threads: int
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(heads * dim)
        ctx = [1, 2, 5, 17, *[rng.randint(1, 60) for _ in range(12)]]
        q, k, v, meta = _batch([1] * len(ctx), ctx, heads, kv_heads, dim, seed=dim)
        native, plain = _both(q, k, v, meta)
        torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 30.0), (8, 50.0), (64, None)])
def test_sliding_window_and_softcap_equal_the_torch_path(
    window: int | None, softcap: float | None
) -> None:
    ctx = [3, 9, 16, 31, 40, 7]
    q, k, v, meta = _batch([1] * len(ctx), ctx, 8, 2, 64, seed=3)
    native, plain = _both(q, k, v, meta, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-5)


def test_a_batch_mixing_prefill_chunks_and_decode_queries() -> None:
    q_lens, ctx = [1, 5, 1, 1, 12, 1], [9, 20, 1, 33, 12, 4]
    q, k, v, meta = _batch(q_lens, ctx, 9, 3, 64, seed=5)
    native, plain = _both(q, k, v, meta)
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-5)


def _one_by_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    window: int | None, softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """Each sequence's attention on its own, spelled out (scores, cap, mask, softmax, V)."""
    out = torch.empty_like(q)
    cu, ctxs = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist()
    block_size, group = k.shape[1], q.shape[1] // k.shape[2]
    for i, ctx in enumerate(ctxs):
        blocks = meta.block_tables[i, : -(-ctx // block_size)].long()
        keys = k[blocks].flatten(0, 1)[:ctx].repeat_interleave(group, 1).transpose(0, 1)
        values = v[blocks].flatten(0, 1)[:ctx].repeat_interleave(group, 1).transpose(0, 1)
        queries = q[cu[i] : cu[i + 1]].transpose(0, 1)  # [heads, q_len, dim]
        scores = queries @ keys.transpose(1, 2) * 0.125
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(ctx - queries.shape[1], ctx)[:, None]
        seen = torch.arange(ctx) <= pos
        if window is not None:
            seen &= torch.arange(ctx) > pos - window
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[cu[i] : cu[i + 1]] = (probs @ values).transpose(0, 1)
    return out


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (4, None), (None, 30.0)])
def test_sequences_of_equal_lengths_share_one_attention_call_with_the_same_result(
    window: int | None, softcap: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # three prompts of 5 with nothing cached, two chunks of 3 over 7 keys, a prompt of its
    # own and two decode queries: 3 calls for the prompts and chunks, not 6
    q_lens, ctx = [5, 3, 5, 1, 5, 3, 6, 1], [5, 7, 5, 9, 5, 7, 6, 4]
    q, k, v, meta = _batch(q_lens, ctx, 6, 2, 16, seed=11)
    calls = []
    attend = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a: calls.append(a[0].shape) or attend(*a))
    got = attention.torch_attention(q, k, v, meta, 0.125, window, softcap, native=True)
    assert sorted(tuple(s) for s in calls) == [(1, 6, 6, 16), (2, 6, 3, 16), (3, 6, 5, 16)]
    want = _one_by_one(q, k, v, meta, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_kernel_is_what_answers_and_a_wrong_answer_would_show() -> None:
    ctx = [6, 11, 23]
    q, k, v, meta = _batch([1] * 3, ctx, 4, 2, 32, seed=7)
    _, plain = _both(q, k, v, meta)
    # the kernel itself writes every decode row of a zeroed output
    plan = attention._decode_plan(meta, k.shape[1], None, q.device)
    assert plan is not None
    out = torch.zeros_like(q)
    assert attention_cpu.decode(q, k, v, plan.tables32, plan.lens32, plan.rows, out, 0.125,
                                None, None)  # fmt: skip
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    wrong = torch.zeros_like(q)  # another scale: the comparison can fail
    attention_cpu.decode(q, k, v, plan.tables32, plan.lens32, plan.rows, wrong, 0.5, None, None)
    assert not torch.allclose(wrong, plain, atol=1e-3)


def test_tensors_the_kernel_does_not_take_go_to_the_torch_path() -> None:
    q, k, v, meta = _batch([1, 1], [5, 9], 4, 2, 32, seed=9)
    plan = attention._decode_plan(meta, k.shape[1], None, q.device)
    assert plan is not None
    args = (plan.tables32, plan.lens32, plan.rows)
    out = torch.zeros_like(q)
    assert not attention_cpu.decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args,
                                    out.bfloat16(), 0.1, None, None)  # fmt: skip
    strided = torch.randn(k.shape[0], k.shape[1], 4, 32)[:, :, ::2]  # a view, not dense
    assert not attention_cpu.decode(q, strided, v, *args, out, 0.1, None, None)
    assert not attention_cpu.decode(q, k, v, plan.tables.contiguous(), *args[1:], out, 0.1,
                                    None, None)  # int64 tables  # fmt: skip
    assert not attention_cpu.decode(q[:, :3], k, v, *args, out, 0.1, None, None)
    assert torch.count_nonzero(out) == 0
    # a table naming a block the cache does not have: never read, the torch path answers
    # (which fails loudly on it) instead of the kernel reading out of bounds
    meta.block_tables[1, 0] = k.shape[0] + 5
    meta.memo.clear()
    with pytest.raises(IndexError):
        attention.torch_attention(q, k, v, meta, 0.1, native=True)


def test_the_engine_decodes_the_same_with_the_native_and_the_torch_decode_attention(
    families: dict[str, Family], monkeypatch: pytest.MonkeyPatch
) -> None:
    family = families["mistral"]  # a sliding window
    engine, refs = make_engine(family)
    names: list[str | None] = [*family.adapters, None]
    batch = prompts(len(names), seed=21, high=40)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
    loras = [refs[n] if n else None for n in names]
    calls = []
    original = attention_cpu.decode

    def counted(*args: object, **kwargs: object) -> bool:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_cpu, "decode", counted)
    native = engine.generate(batch, params, loras)
    assert calls
    monkeypatch.setenv(attention.ENV, "torch")
    calls.clear()
    plain = engine.generate(batch, params, loras)
    assert not calls
    for a, b in zip(native, plain, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-4)  # fmt: skip


def test_a_steps_metadata_keeps_the_choice_it_was_built_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(attention.ENV, "torch")
    q, _, _, meta = _batch([1, 1], [5, 9], 4, 2, 32, seed=3)
    monkeypatch.setenv(attention.ENV, "native")
    assert attention.backend(q, meta) == "torch"  # read when the step's metadata was built
    assert attention.backend(q) == "native"  # no metadata: read now
    monkeypatch.setenv(attention.ENV, "fast")
    with pytest.raises(ValueError, match="LORAPLANE_ATTENTION must be one of"):
        _batch([1], [5], 4, 2, 32, seed=4)


def test_the_engine_reads_the_choice_once_per_step_not_per_layer(
    families: dict[str, Family], monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplane.dataplane import attention_metadata
    from loraplane.dataplane.models import llama

    engine, refs = make_engine(families["llama"])
    layers = engine.runner.model.config.num_layers
    assert layers > 1
    reads: list[str] = []
    calls: list[int] = []
    read_choice, paged = attention_metadata.read_choice, llama.paged_attention

    def counted_read(env: str, backends: tuple[str, ...]) -> str:
        reads.append(env)
        return read_choice(env, backends)

    def counted_call(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return paged(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_metadata, "read_choice", counted_read)
    monkeypatch.setattr(llama, "paged_attention", counted_call)
    monkeypatch.setattr(attention, "choose", None)  # a per-call read would now fail
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.generate(prompts(2, seed=5, high=40), params, [refs[next(iter(refs))], None])
    assert reads and set(reads) == {attention.ENV}
    assert len(calls) == len(reads) * layers  # one read per step, every layer's call served
