"""The FP8 KV cache (`kv_cache_dtype="fp8"`, kv_quant.py) on the torch path.

The cache's round trip is quantize-dequantize of K/V; the engine over an FP8 cache generates
what the same engine generates over a full-precision cache holding fake-quantized K/V (the
oracle: every other step identical), in mixed batches of adapters with prefix caching and
preemption, with adapters inside the KV blocks too, and with the checkpoint's scales; it stays
close to the unquantized cache. The Triton kernel over FP8 caches is checked against this path
in test_attention_triton.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.dataplane import attention, kv_quant, model_runner
from loraplane.dataplane.attention import AttentionMetadata, write_kv
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.models.loader import load_model
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import prompts

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)


def _meta(q_lens: list[int], ctx_lens: list[int], block_size: int) -> AttentionMetadata:
    tables, first = [], 0
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(list(range(first, first + n))[::-1])  # blocks out of order
        first += n
    return AttentionMetadata.build(q_lens, ctx_lens, tables, block_size, "cpu")


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_write_then_read_is_quantize_dequantize_and_saturates(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(9, 2, 16, generator=gen) * 20
    v = torch.randn(9, 2, 16, generator=gen) * 20
    k[0, 0, 0], v[0, 0, 0] = 1e6, -1e6  # far past 448 * scale: saturates, no NaN
    cache = torch.zeros(2, 6, 4, 2, 16, dtype=FP8)
    slots = torch.tensor([3, 0, 22, 7, 8, 9, 15, 1, 4])
    write_kv(k, v, cache[0], cache[1], slots, scale, 2 * scale)
    assert cache.element_size() == 1
    got_k = kv_quant.dequantize(cache[0].flatten(0, 1)[slots], scale, torch.float32)
    got_v = kv_quant.dequantize(cache[1].flatten(0, 1)[slots], 2 * scale, torch.float32)
    for got, x, s in ((got_k, k, scale), (got_v, v, 2 * scale)):
        # an independent spelling of quantize-dequantize: e4m3 keeps 3 mantissa bits, so
        # the round trip is within half an ulp (2^-4 relative) below 448 * s, saturated above
        ref = torch.where(x.abs() > 448 * s, torch.sign(x) * 448 * s, x)
        normal = ref.abs() >= 2**-6 * s
        assert torch.isfinite(got).all()
        assert (got - ref)[normal].abs().le(ref[normal].abs() * 2**-4 + 1e-6).all()
        assert (got - ref)[~normal].abs().le(2**-10 * s + 1e-9).all()  # subnormals
        assert got.flatten()[0] == torch.sign(x.flatten()[0]) * 448 * s
        assert torch.equal(got, kv_quant.quantize(x, s).float() * s)


def test_torch_attention_over_fp8_equals_attention_over_the_dequantized_cache() -> None:
    gen = torch.Generator().manual_seed(1)
    q_lens, ctx_lens, bs = [1, 1, 5, 3], [9, 4, 5, 14], 4
    meta = _meta(q_lens, ctx_lens, bs)
    blocks = sum(-(-c // bs) for c in ctx_lens)
    k8 = (torch.randn(blocks, bs, 2, 16, generator=gen) * 40).to(FP8)
    v8 = (torch.randn(blocks, bs, 2, 16, generator=gen) * 40).to(FP8)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen)
    for window, cap in ((None, None), (3, None), (None, 5.0)):
        got = attention.torch_attention(q, k8, v8, meta, 0.25, window, cap, 0.01, 0.02)
        k, v = k8.float() * 0.01, v8.float() * 0.02
        want = attention.torch_attention(q, k, v, meta, 0.25, window, cap)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _engine(family: Family, **overrides: Any) -> tuple[Engine, dict[str, Any]]:
    settings: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                                "max_loras": len(family.adapters), "num_kv_blocks": 256,
                                "max_num_batched_tokens": 32}  # fmt: skip
    settings.update(overrides)
    engine = Engine(EngineConfig(model=str(family.model_dir), **settings))
    return engine, {n: engine.register_lora(n, p, "t") for n, p in family.adapters.items()}


def _generate(family: Family, names: list[str | None], batch: list[list[int]], **overrides: Any
              ) -> tuple[list[tuple[list[int], list[float]]], Engine]:  # fmt: skip
    """Greedy tokens and their log-probabilities; the second half of the batch arrives two
    steps later, when the first half's full prompt blocks are in the prefix cache."""
    engine, refs = _engine(family, **overrides)
    out: dict[str, tuple[list[int], list[float]]] = {str(i): ([], []) for i in range(len(batch))}
    half = len(batch) // 2
    for i, (prompt, name) in enumerate(zip(batch, names, strict=True)):
        if i == half:
            for _ in range(2):
                for o in engine.step():
                    out[o.request_id][0].extend(o.token_ids)
                    out[o.request_id][1].extend(o.logprobs or [])
        engine.add_request(str(i), prompt, GREEDY, refs[name] if name else None)
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
    return [out[str(i)] for i in range(len(batch))], engine


def _fake_quant_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle's cache writes: K/V quantized and dequantized, stored in full precision."""
    real = attention.write_kv

    def write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:  # fmt: skip
        assert not kv_quant.is_fp8(k_cache)
        fk = kv_quant.quantize(k, k_scale).float() * k_scale
        fv = kv_quant.quantize(v, v_scale).float() * v_scale
        real(fk, fv, k_cache, v_cache, slots)

    monkeypatch.setattr(attention, "write_kv", write)


def _batch() -> tuple[list[str | None], list[list[int]]]:
    shared = prompts(1, seed=31, low=12, high=12)[0]  # 3 full blocks of 4, shared by r16 rows
    names: list[str | None] = ["r16", None, "r4", "r16", "r64", None, "r16"]
    rest = prompts(len(names), seed=32, low=3, high=20)
    batch = [[*shared, *p[:5]] if n == "r16" else p for n, p in zip(names, rest, strict=True)]
    return names, batch


def test_engine_over_fp8_generates_what_fake_quantized_kv_does_in_mixed_batches(
    families: dict[str, Family], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapters and base rows, chunked prefill, prefix caching, then preemption."""
    family = families["llama"]
    names, batch = _batch()
    got, engine = _generate(family, names, batch, kv_cache_dtype="fp8")
    assert engine.runner.kv_cache.dtype == FP8
    assert engine.block_manager.cache_hit_tokens > 0
    squeezed, small = _generate(family, names, batch, kv_cache_dtype="fp8", num_kv_blocks=24)
    assert small.stats.preemptions > 0
    # adapters stored in the FP8 cache's blocks (viewed as fp32): the same tokens
    shared, arena = _generate(family, names, batch, kv_cache_dtype="fp8", kv_lora_shared=True,
                              lora_memory=1 << 20)  # fmt: skip
    assert arena.runner.pool.arena is not None
    auto, _ = _generate(family, names, batch)
    _fake_quant_write(monkeypatch)
    want, _ = _generate(family, names, batch)
    for g, s, sh, w in zip(got, squeezed, shared, want, strict=True):
        assert g[0] == w[0] == s[0] == sh[0]
        torch.testing.assert_close(torch.tensor(g[1]), torch.tensor(w[1]), atol=1e-5, rtol=0)
    # against the unquantized cache: the tiny model's K/V (|x| < ~4) keep ~2 significant
    # digits. Its greedy rows hold near-ties (two tokens within 0.01), so a row may take the
    # other one later: up to where each row diverges, the tokens' log-probabilities agree
    # within 0.05, and the first tokens are equal
    diffs = []
    for g, a in zip(got, auto, strict=True):
        pairs = enumerate(zip(g[0], a[0], strict=True))
        same = next((i for i, (x, y) in pairs if x != y), len(g[0]))  # the first divergence
        assert same >= 1
        diffs += [abs(x - y) for x, y in zip(g[1][:same], a[1][:same], strict=True)]
    print(f"fp8 vs auto: max |d logprob| {max(diffs):.4f} over {len(diffs)} tokens")
    assert 0 < max(diffs) < 0.05


def test_checkpoint_kv_scales_are_read_and_used(
    families: dict[str, Family], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compressed-tensors' self_attn.k_scale / v_scale, AutoFP8's kv_scale; 1.0 where absent."""
    family = families["llama"]
    model_dir = tmp_path / "scaled"
    shutil.copytree(family.model_dir, model_dir)
    (weights,) = model_dir.glob("*.safetensors")
    state = load_file(weights)
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == 2
    scales = [(0.02, 1.0), (0.05, 0.05)]  # layer 0: K's only; layer 1: through kv_scale
    state["model.layers.0.self_attn.k_scale"] = torch.tensor([0.02])
    state["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.05)
    save_file(state, weights, metadata={"format": "pt"})
    model = load_model(model_dir, torch.float32, "cpu")
    for i, layer in enumerate(model.model.decoder_layers):
        attn = layer.self_attn
        assert (attn.k_scale, attn.v_scale) == pytest.approx(scales[i]), i
    scaled = Family("llama", model_dir, family.adapters)
    names, batch = _batch()
    got, _ = _generate(scaled, names[:3], batch[:3], kv_cache_dtype="fp8")
    plain, _ = _generate(family, names[:3], batch[:3], kv_cache_dtype="fp8")
    assert [g[1] for g in got] != [p[1] for p in plain]  # the scales changed the rounding
    _fake_quant_write(monkeypatch)
    want, _ = _generate(scaled, names[:3], batch[:3])
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0]
        torch.testing.assert_close(torch.tensor(g[1]), torch.tensor(w[1]), atol=1e-5, rtol=0)


def test_fp8_halves_the_block_bytes_and_doubles_the_auto_sized_cache(
    families: dict[str, Family], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(families["llama"].model_dir, torch.bfloat16, "cpu")
    auto = model.kv_cache_block_bytes(16)
    model.kv_cache_dtype = kv_quant.cache_dtype("fp8", torch.bfloat16, torch.device("cpu"))
    assert model.kv_cache_block_bytes(16) * 2 == auto
    model.allocate_kv_cache(3, 16)
    assert model.kv_cache is not None and model.kv_cache.dtype == FP8
    assert model.kv_cache.numel() == 3 * model.kv_cache_block_bytes(16)
    # a cache sized from memory: twice the blocks in the same budget
    monkeypatch.setattr(model_runner, "CPU_KV_BUDGET", 40 * auto)
    blocks = {}
    for dtype in ("auto", "fp8"):
        config = EngineConfig(model=str(families["llama"].model_dir), device="cpu",
                              dtype="bfloat16", block_size=16, kv_cache_dtype=dtype)  # fmt: skip
        blocks[dtype] = model_runner.ModelRunner(config).num_blocks
    assert blocks == {"auto": 40, "fp8": 80}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: EngineConfig(model="m", kv_cache_dtype="int8"), "kv_cache_dtype must be one of"),
        (lambda: EngineConfig(model="m", kv_cache_dtype="fp8_e5m2"), "auto, fp8"),
        (lambda: kv_quant.cache_dtype("int4", torch.float16, torch.device("cpu")), "auto or fp8"),
        (lambda: kv_quant.scale_value("l.k_scale", torch.ones(4)), "only per-tensor"),
        (lambda: kv_quant.scale_value("l.v_scale", torch.tensor(0.0)), "positive and finite"),
        (lambda: kv_quant.scale_value("l.v_scale", torch.tensor(float("nan"))), "positive"),
        (lambda: kv_quant.read_scales({(7, "k"): 1.0}, 2), "names layer 7; the model has 2"),
        (
            lambda: kv_quant.storage_view(torch.zeros(2, 1, 1, 4, 1, 6, dtype=FP8), torch.float32),
            "head_dim must be a multiple of 4",
        ),
    ],
    ids=["int8", "e5m2", "cache-dtype", "per-head", "zero", "nan", "layer", "arena-view"],
)
def test_bad_kv_cache_settings_and_scales_are_refused_with_a_reason(
    call: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_scale_names_follow_what_quantizers_write() -> None:
    assert kv_quant.scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_quant.scale_target("model.layers.12.self_attn.v_proj.output_scale") == (12, "v")
    assert kv_quant.scale_target("model.layers.0.self_attn.k_proj.k_scale") == (0, "k")
    assert kv_quant.scale_target("model.layers.5.self_attn.kv_scale") == (5, "kv")
    for other in ("model.layers.0.self_attn.k_proj.weight_scale",
                  "model.layers.0.self_attn.k_proj.input_scale", "model.norm.weight"):  # fmt: skip
        assert kv_quant.scale_target(other) is None
