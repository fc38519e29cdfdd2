"""The decoder layer's small operations through the native library (kernels/cpu_ops.py): RMSNorm
after the residual's add, and rotate-half RoPE on q and k, against the torch operations they
replace, and in the engine against the torch path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from loraplane.dataplane.kernels import cpu_ops, sgmv_cpu
from loraplane.dataplane.kernels.backends import Switch
from loraplane.dataplane.models.rope import apply_rotary
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import assert_same_outputs, mixed_batch

pytestmark = pytest.mark.skipif(sgmv_cpu.library() is None, reason="no native CPU library here")


@pytest.fixture(autouse=True)
def _native_mode() -> Iterator[None]:
    before = cpu_ops.mode()
    cpu_ops.set_mode("auto")
    yield
    cpu_ops.set_mode(before)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _tables(tokens: int, rot: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    freqs = torch.arange(tokens).float()[:, None] * torch.rand(rot // 2, generator=g)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (8, 576), (300, 1024)])
def test_rms_norm_equals_torchs(rows: int, dim: int, threads: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    weight = torch.rand(dim, generator=g) + 0.5
    total = x + residual
    normed, summed = cpu_ops.rms_norm(x.clone(), weight, 1e-6, residual)
    assert torch.equal(summed, total)  # the residual's sum, exactly
    expected = F.rms_norm(total, (dim,), weight, 1e-6)
    torch.testing.assert_close(normed, expected, rtol=2e-6, atol=2e-6)
    alone, same = cpu_ops.rms_norm(x, weight, 1e-6)
    assert same is x
    torch.testing.assert_close(alone, F.rms_norm(x, (dim,), weight, 1e-6), rtol=2e-6, atol=2e-6)


def test_rms_norm_reads_rows_further_apart_and_writes_the_sum_where_asked() -> None:
    g = torch.Generator().manual_seed(3)
    wide, residual = torch.randn(8, 100, generator=g), torch.randn(8, 64, generator=g)
    x = wide[:, 10:74]  # rows 100 floats apart
    weight = torch.rand(64, generator=g)
    expected = F.rms_norm(x + residual, (64,), weight, 1e-5)
    total, outside = x + residual, torch.cat((wide[:, :10], wide[:, 74:]), dim=1)
    normed, summed = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    assert summed is x and torch.equal(wide[:, 10:74], total)  # written in place
    assert torch.equal(torch.cat((wide[:, :10], wide[:, 74:]), dim=1), outside)  # untouched
    torch.testing.assert_close(normed, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "rot"),
    [(1, 9, 3, 64, 64), (8, 8, 2, 32, 32), (40, 4, 1, 128, 64), (257, 6, 2, 16, 16)],
    ids=["one-token", "decode", "partial-rotary", "prefill"],
)
def test_rope_is_apply_rotary_bit_for_bit(
    tokens: int, heads: int, kv_heads: int, head_dim: int, rot: int, threads: int
) -> None:
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, head_dim, generator=g)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g)
    cos, sin = _tables(tokens, rot, tokens)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert cpu_ops.rope(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def test_rope_rotates_views_of_a_fused_qkv_output_and_leaves_v() -> None:
    g = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    before = qkv.clone()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    cos, sin = _tables(tokens, dim, 5)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert cpu_ops.rope(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, before[:, (heads + kv_heads) * dim :])


def test_a_wrong_table_would_show() -> None:
    """The comparison above can fail: sin and cos swapped give other values."""
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(4, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    cos, sin = _tables(4, 8, 6)
    expected = apply_rotary(q, cos, sin)
    assert cpu_ops.rope(q, k, sin.contiguous(), cos.contiguous())
    assert not torch.allclose(q, expected, atol=1e-3)


def test_what_the_native_path_does_not_take_goes_to_torch() -> None:
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(4, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    cos, sin = _tables(4, 8, 7)
    for a, b, c, s in [
        (q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16()),  # not fp32
        (q.transpose(0, 1).contiguous().transpose(0, 1), k, cos, sin),  # heads not dense
        (q, k, cos[:, :3].contiguous(), sin[:, :3].contiguous()),  # an odd rotary width
        (q, k[:3], cos, sin),  # tokens differ
    ]:
        kept = a.clone()
        assert not cpu_ops.rope(a, b, c, s)
        assert torch.equal(a, kept)  # nothing written
    x, weight = torch.randn(4, 8, generator=g).bfloat16(), torch.ones(8, dtype=torch.bfloat16)
    normed, _ = cpu_ops.rms_norm(x, weight, 1e-5)
    assert torch.equal(normed, F.rms_norm(x, (8,), weight, 1e-5))
    cpu_ops.set_mode("torch")
    assert not cpu_ops.rope(q, k, cos, sin)


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.ENV, "fast")
    with pytest.raises(ValueError, match="LORAPLANE_CPU_OPS must be one of auto, torch"):
        Switch(cpu_ops.ENV)
    with pytest.raises(ValueError, match="mode must be one of"):
        cpu_ops.set_mode("native")


def test_the_engine_decodes_the_same_with_the_native_and_the_torch_operations(
    families: dict[str, Family], monkeypatch: pytest.MonkeyPatch
) -> None:
    # qwen2: q/k/v bias, tied embeddings, 4 heads over 1 KV head
    engine, batch, params, loras = mixed_batch(families["qwen2"], seed=23)
    lib = sgmv_cpu.library()
    calls: dict[str, int] = {"loraplane_rms_norm_f32": 0, "loraplane_rope_f32": 0}
    for name in calls:
        original = getattr(lib, name)

        def counted(*args: object, _name: str = name, _original: object = original) -> None:
            calls[_name] += 1
            _original(*args)  # type: ignore[operator]

        monkeypatch.setattr(lib, name, counted)
    native = engine.generate(batch, params, loras)
    assert all(calls.values()), calls
    cpu_ops.set_mode("torch")
    seen = dict(calls)
    plain = engine.generate(batch, params, loras)
    assert calls == seen  # the torch path called nothing native
    assert_same_outputs(native, plain)
