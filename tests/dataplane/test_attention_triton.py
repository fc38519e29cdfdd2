"""The Triton paged attention kernel against the torch path (`attention.torch_attention`).

Mixed batches (decode rows, whole prompts, tails over cached prefixes, long sequences over many
shuffled blocks, partial last blocks), GQA ratios 1 to 16 (and 3), head dims 8 to 256, sliding
window on and off, tanh soft-capping on and off (Gemma 2), split-KV, fp32 and fp16; FP8 caches
(kv_quant.py) read by fp16 and bf16 queries with their K/V scales; then the model and the
engine with the kernel forced (`LORAPLANE_ATTENTION=triton`) against the torch path. Without
CUDA the kernel runs in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set here
before Triton is imported); bf16 is checked compiled on a GPU (the interpreter's bf16 `tl.dot`
is wrong: the launcher computes bf16 products in fp32 there). With CUDA and TRITON_INTERPRET
unset, the same tests run the compiled kernel on CUDA tensors. Shapes stay small: the
interpreter is slow.
"""

from __future__ import annotations

import dataclasses
import random
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.dataplane.triton_mode import DEVICE, INTERPRETED, require_triton

require_triton()

from loraplane.dataplane import attention, kv_quant  # noqa: E402
from loraplane.dataplane.attention import AttentionMetadata, write_kv  # noqa: E402
from loraplane.dataplane.config import EngineConfig  # noqa: E402
from loraplane.dataplane.engine import Engine  # noqa: E402
from loraplane.dataplane.kernels import attention_triton as at  # noqa: E402
from loraplane.dataplane.kernels import sgmv_cpu  # noqa: E402
from loraplane.dataplane.sampling import SamplingParams  # noqa: E402
from tests.dataplane.conftest import (  # noqa: E402
    Family,
    LoadedModel,
    PagedRunner,
    Seq,
    compile_without_gpu,
)

# fixtures: the Gemma models and their adapters, built once for this module
from tests.dataplane.test_models_gemma_parity import (  # noqa: E402, F401
    gemma_families,
    gemma_models,
)

if INTERPRETED and not at.is_interpreted():
    pytest.skip(
        "attention_triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

TOLERANCE = {  # dtype -> (atol, rtol) against the torch path on fp32 copies
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
# (q_len, context_len) per sequence: decode at position 0, a decode over a partial last block,
# one over exactly full blocks, a whole prompt, a tail over a cached prefix, a chunk longer
# than a q block over a prefix, and a long decode over many blocks and key tiles
MIXED = [(1, 1), (1, 17), (1, 16), (7, 7), (5, 13), (23, 60), (1, 150)]
DECODE = [(1, c) for c in (1, 3, 40, 97, 130, 64)]


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(attention.ENV, raising=False)  # the reference is the torch path


@dataclass
class Batch:
    """A step's new tokens and a paged cache holding every earlier position."""

    q_lens: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]
    block_size: int
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KV, D]
    v: torch.Tensor  # [T, KV, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor

    def meta(self, device: torch.device | str = DEVICE) -> AttentionMetadata:
        return AttentionMetadata.build(
            self.q_lens, self.ctx_lens, self.tables, self.block_size, device
        )


def _batch(
    rows: Sequence[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Batch:
    """Random q/k/v and a cache of random earlier K/V; block tables drawn from a shuffled pool
    (with spare blocks no sequence owns)."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = [q for q, _ in rows], [c for _, c in rows]
    need = [-(-c // block_size) for c in ctx_lens]
    pool = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(pool[:n])
        pool = pool[n:]
    tokens, blocks = sum(q_lens), sum(need) + 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    return Batch(
        q_lens, ctx_lens, tables, block_size,
        q=rand(tokens, heads, dim), k=rand(tokens, kv_heads, dim), v=rand(tokens, kv_heads, dim),
        k_cache=rand(blocks, block_size, kv_heads, dim),
        v_cache=rand(blocks, block_size, kv_heads, dim),
    )  # fmt: skip


def _expected(b: Batch, window: int | None, softcap: float | None = None) -> torch.Tensor:
    """The torch path (write_kv, then attention.torch_attention) on fp32 CPU copies."""
    q, k, v, k_cache, v_cache = (t.float().cpu() for t in (b.q, b.k, b.v, b.k_cache, b.v_cache))
    meta = b.meta("cpu")
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attention.torch_attention(
        q, k_cache, v_cache, meta, q.shape[-1] ** -0.5, window, softcap
    )


def _triton(
    b: Batch,
    window: int | None,
    config: at.AttentionConfig | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The step's K/V written as the engine writes them, then the kernel."""
    meta = b.meta()
    write_kv(b.k, b.v, b.k_cache, b.v_cache, meta.slot_mapping)
    return at.paged_attention(b.q, b.k_cache, b.v_cache, meta, b.q.shape[-1] ** -0.5, window,
                              config, softcap=softcap)  # fmt: skip


def _assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == expected.shape
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(4, 4, 64, 4), (4, 2, 128, 16), (8, 2, 16, 4), (6, 2, 32, 4), (8, 2, 8, 4)],
    ids=["mha-d64", "gqa2-d128-bs16", "gqa4-d16", "gqa3-d32", "gqa4-d8"],
)
def test_mixed_batch_matches_the_torch_path(
    heads: int, kv_heads: int, dim: int, block_size: int, window: int | None, dtype: torch.dtype
) -> None:
    b = _batch(MIXED, heads, kv_heads, dim, block_size, dtype, seed=dim + heads)
    expected = _expected(b, window)
    _assert_close(_triton(b, window), expected, dtype)


# Gemma's shapes, scaled down: head_dim 256 and up to 16 query heads per KV head; rows of
# scores several units large (q scaled) so that a cap of 5 binds hard
GEMMA_ROWS = [(1, 1), (1, 19), (6, 6), (9, 33), (1, 70)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("softcap", "window"),
    [(5.0, None), (5.0, 8), (None, 8)],
    ids=["softcap5", "softcap5-window8", "window8"],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(16, 1, 256, 16), (8, 2, 256, 4), (16, 1, 32, 4)],
    ids=["gqa16-d256", "gqa4-d256", "gqa16-d32"],
)
def test_softcap_and_sliding_window_at_gemma_shapes_match_the_torch_path(
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    softcap: float | None,
    window: int | None,
    dtype: torch.dtype,
) -> None:
    b = _batch(GEMMA_ROWS, heads, kv_heads, dim, block_size, dtype, seed=heads + dim)
    b.q.mul_(4.0)
    expected = _expected(b, window, softcap)
    if softcap is not None:  # negative control: the cap changes the answer at these scores
        assert not torch.allclose(_expected(b, window), expected, atol=1e-2)
    _assert_close(_triton(b, window, softcap=softcap), expected, dtype)


@pytest.mark.parametrize("splits", [1, 4])
def test_softcap_with_split_kv_decode_and_small_tiles_matches_the_torch_path(splits: int) -> None:
    b = _batch(DECODE, 16, 1, 64, 8, torch.float32, seed=splits)
    b.q.mul_(4.0)
    cfg = at.AttentionConfig(block_m=16, tile_n=16, num_splits=splits)
    _assert_close(_triton(b, 9, cfg, softcap=3.0), _expected(b, 9, 3.0), torch.float32)


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
@pytest.mark.parametrize(
    "config",
    [
        at.AttentionConfig(block_m=16, tile_n=16),  # many q blocks per sequence, many tiles
        at.AttentionConfig(block_m=32, tile_n=128),  # a tile wider than most contexts
        at.AttentionConfig(block_m=16, tile_n=16, num_splits=4),  # split-KV on a mixed batch
    ],
    ids=["small-tiles", "wide-tile", "split4"],
)
def test_tile_sizes_and_splits_do_not_change_the_result(
    config: at.AttentionConfig, window: int | None
) -> None:
    b = _batch(MIXED, 8, 2, 16, 4, torch.float32, seed=3)
    _assert_close(_triton(b, window, config), _expected(b, window), torch.float32)


@pytest.mark.parametrize("splits", [2, 16])
@pytest.mark.parametrize("window", [None, 9], ids=["causal", "window9"])
def test_split_kv_decode_combines_partials_including_empty_splits(
    splits: int, window: int | None
) -> None:
    # with 16 splits and contexts of 1..130 most splits of a sequence have no tile at all
    b = _batch(DECODE, 4, 1, 32, 8, torch.float16, seed=splits)
    cfg = at.AttentionConfig(block_m=16, tile_n=16, num_splits=splits)
    _assert_close(_triton(b, window, cfg), _expected(b, window), torch.float16)


def _fp8(b: Batch, k_scale: float, v_scale: float) -> Batch:
    """`b` over FP8 caches holding its earlier K/V quantized with these scales."""
    k8, v8 = kv_quant.quantize(b.k_cache, k_scale), kv_quant.quantize(b.v_cache, v_scale)
    return dataclasses.replace(b, k_cache=k8, v_cache=v8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("window", "softcap", "splits", "k_scale", "v_scale"),
    [(None, None, 1, 1.0, 1.0), (5, None, 1, 0.02, 0.5), (None, 5.0, 1, 0.5, 0.02),
     (None, None, 4, 0.02, 0.5)],
    ids=["causal-s1", "window5", "softcap5", "split4"],
)  # fmt: skip
def test_fp8_cache_matches_the_torch_path(
    k_scale: float, v_scale: float, dtype: torch.dtype, window: int | None,
    softcap: float | None, splits: int,
) -> None:  # fmt: skip
    """The kernel loads fp8 tiles and dequantizes them as the torch path does (q's dtype);
    the scales put the random K/V (|x| < ~5) at the fine (0.02) and the coarse end (1.0) of
    e4m3's range."""
    rows = DECODE if splits > 1 else MIXED
    b = _fp8(_batch(rows, 8, 2, 32, 4, dtype, seed=int(1 / k_scale)), k_scale, v_scale)
    meta = b.meta()
    write_kv(b.k, b.v, b.k_cache, b.v_cache, meta.slot_mapping, k_scale, v_scale)
    config = at.AttentionConfig(block_m=16, tile_n=16, num_splits=splits)
    got = at.paged_attention(b.q, b.k_cache, b.v_cache, meta, 32**-0.5, window, config,
                             softcap, k_scale, v_scale)  # fmt: skip
    want = attention.torch_attention(b.q.float().cpu(), b.k_cache.cpu(), b.v_cache.cpu(),
                                     b.meta("cpu"), 32**-0.5, window, softcap, k_scale,
                                     v_scale)  # fmt: skip
    _assert_close(got, want, dtype)


def test_paged_attention_forced_to_triton_writes_an_fp8_cache_and_matches_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = _fp8(_batch(MIXED, 8, 2, 16, 4, torch.float16, seed=3), 0.25, 0.125)
    cpu = {name: getattr(b, name).cpu().clone() for name in ("q", "k", "v", "k_cache", "v_cache")}
    ref = dataclasses.replace(b, **cpu)  # the torch path (on the CPU: "auto" is torch there)
    want = attention.paged_attention(ref.q, ref.k, ref.v, ref.k_cache, ref.v_cache,
                                     ref.meta("cpu"), 0.25, 5, None, 0.25, 0.125)  # fmt: skip
    monkeypatch.setenv(attention.ENV, "triton")
    got = attention.paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta(), 0.25, 5,
                                    None, 0.25, 0.125)  # fmt: skip
    _assert_close(got, want.float(), torch.float16)
    slots = b.meta().slot_mapping
    stored = b.k_cache.flatten(0, 1)[slots].float() * 0.25
    assert torch.equal(stored, kv_quant.quantize(b.k, 0.25).float() * 0.25)
    assert torch.equal(b.k_cache.cpu().view(torch.uint8), ref.k_cache.view(torch.uint8))


def test_bf16_in_the_interpreter_computes_products_in_fp32() -> None:
    if not INTERPRETED:
        pytest.skip("interpreter only: the compiled bf16 path is test_bf16_on_gpu_...")
    b = _batch(MIXED, 8, 2, 16, 4, torch.bfloat16, seed=5)
    _assert_close(_triton(b, 5), _expected(b, 5), torch.bfloat16)


def test_default_config_picks_small_q_blocks_for_decode_and_no_splits_without_cuda() -> None:
    decode = _batch(DECODE, 8, 2, 16, 4, torch.float32).meta("cpu")
    mixed = _batch(MIXED, 8, 2, 16, 4, torch.float32).meta("cpu")
    cpu = torch.device("cpu")
    assert at.default_config(decode, 2, 4, 16, cpu) == at.AttentionConfig(block_m=16)
    assert at.default_config(mixed, 2, 4, 16, cpu) == at.AttentionConfig(block_m=64)
    assert at.default_config(mixed, 1, 32, 256, cpu) == at.AttentionConfig(block_m=64, tile_n=32)


def test_empty_batch_returns_an_empty_output_without_launching() -> None:
    b = _batch([(1, 1)], 4, 2, 16, 4, torch.float32)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        context_lens=torch.zeros(0, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=DEVICE),
    )
    out = at.paged_attention(b.q[:0], b.k_cache, b.v_cache, meta, 0.25)
    assert out.shape == (0, 4, 16)


def _bad(change: str) -> dict[str, Any]:
    b = _batch([(2, 5), (1, 3)], 4, 2, 16, 4, torch.float32)
    args: dict[str, Any] = {"q": b.q, "k_cache": b.k_cache, "v_cache": b.v_cache,
                            "meta": b.meta(), "scale": 0.25}  # fmt: skip
    if change == "q-2d":
        args["q"] = b.q.flatten(1)
    elif change == "q-int":
        args["q"] = b.q.to(torch.int32)
    elif change == "cache-dtype":
        args["v_cache"] = b.v_cache.half()
    elif change == "fp8-v-only":
        args["v_cache"] = b.v_cache.to(kv_quant.FP8)
    elif change == "cache-shape":
        args["v_cache"] = b.v_cache[:-1]
    elif change == "head-dim":
        args["q"] = b.q[..., :8]
    elif change == "heads":
        args["q"] = torch.cat([b.q, b.q[:, :1]], dim=1)
    elif change == "tokens":
        args["q"] = b.q[:2]
    elif change == "window":
        args["sliding_window"] = 0
    elif change == "softcap":
        args["softcap"] = -1.0
    elif change == "block-m":
        args["q"] = b.q.repeat(1, 9, 1)  # 36 query heads over 2 KV heads: groups of 18
        args["config"] = at.AttentionConfig(block_m=16, tile_n=16)
    return args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("q-2d", "q must be"),
        ("q-int", "q is torch.int32"),
        ("cache-dtype", "v_cache is torch.float16"),
        ("fp8-v-only", "v_cache is torch.float8_e4m3fn; k_cache is torch.float32"),
        ("cache-shape", "v_cache"),
        ("head-dim", "head_dim"),
        ("heads", "not a multiple"),
        ("tokens", "q has 2 tokens; meta has 3"),
        ("window", "sliding_window"),
        ("softcap", "softcap must be None or > 0"),
        ("block-m", "block_m"),
    ],
)
def test_bad_inputs_are_rejected_with_ValueError_naming_the_argument(
    change: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        at.paged_attention(**_bad(change))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_m": 8}, "block_m must be >= 16"),
        ({"tile_n": 48}, "tile_n must be a power of two"),
        ({"num_splits": 32}, "num_splits must be <= 16"),
        ({"num_stages": 0}, "num_stages"),
    ],
)
def test_bad_configs_are_rejected_naming_the_field(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        at.AttentionConfig(**kwargs)


def test_backend_is_triton_on_cuda_native_or_torch_on_cpu_unless_overridden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    native = "native" if sgmv_cpu.library() is not None else "torch"
    assert attention.backend(torch.zeros(1)) == native  # fp32: the native decode kernel
    assert attention.backend(torch.zeros(1, dtype=torch.bfloat16)) == "torch"
    if torch.cuda.is_available():
        assert attention.backend(torch.zeros(1, device="cuda")) == "triton"
    monkeypatch.setenv(attention.ENV, "torch")
    if torch.cuda.is_available():
        assert attention.backend(torch.zeros(1, device="cuda")) == "torch"
    monkeypatch.setenv(attention.ENV, " Triton ")
    assert attention.backend(torch.zeros(1)) == "triton"
    monkeypatch.setenv(attention.ENV, "flash")
    with pytest.raises(ValueError, match=attention.ENV):
        attention.backend(torch.zeros(1))


def test_paged_attention_forced_to_triton_writes_the_cache_and_matches_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = _batch(MIXED, 8, 2, 16, 4, torch.float32, seed=9)
    expected = _expected(b, 5)
    monkeypatch.setenv(attention.ENV, "triton")
    got = attention.paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta(), 0.25, 5)
    _assert_close(got, expected, torch.float32)
    slots = b.meta().slot_mapping
    assert torch.equal(b.k_cache.flatten(0, 1)[slots], b.k)
    assert torch.equal(b.v_cache.flatten(0, 1)[slots], b.v)


def _runner_schedule(model: LoadedModel, rng: random.Random) -> list[Seq]:
    """Whole prompts and a first chunk; then a tail over a cached prefix, a second chunk and
    decodes in one batch; then decodes. Tokens are fixed up front (no argmax feedback), so the
    two backends see the same inputs."""
    slots = list(model.slots.values())

    def seq(n: int, slot: int) -> Seq:
        return Seq([rng.randrange(3, 384) for _ in range(n)], slot)

    writer, short, long = seq(17, slots[0]), seq(10, -1), seq(25, slots[1])
    tail = Seq([*writer.tokens[:8], *seq(8, slots[0]).tokens], slots[0])
    runner = PagedRunner(model.model, num_blocks=48, block_size=4, seed=rng.randrange(99))
    runner.step([(writer, 13), (short, 6), (long, 10)])
    runner.share_prefix(writer, tail, 2)  # tail starts with writer's first 2 blocks cached
    runner.step([(tail, 5), (writer, 1), (short, 1), (long, 12)])
    for _ in range(3):
        runner.step([(tail, 1), (writer, 1), (short, 1), (long, 1)])
    return [writer, short, long, tail]


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_model_logits_with_triton_attention_equal_the_torch_path(
    kind: str, loaded_models: Callable[[str], LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """mistral: 8 heads over 2 KV heads, an 8-token sliding window; qwen2: 4 heads over 1."""
    model = loaded_models(kind)
    if model.model.lm_head.weight.device != DEVICE:
        pytest.skip("the loaded models live on the CPU: compare there (interpreter)")
    monkeypatch.setenv(attention.ENV, "torch")
    want = _runner_schedule(model, random.Random(kind))
    monkeypatch.setenv(attention.ENV, "triton")
    got = _runner_schedule(model, random.Random(kind))
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and len(g.logits) == len(w.logits) > 0
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_gemma_logits_with_triton_attention_equal_the_torch_path(
    kind: str,
    gemma_models: Callable[[str], LoadedModel],  # noqa: F811 - the imported fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gemma2: soft-capped scores (cap 2) and a 6-token window on every other layer, head_dim
    32 over hidden 64; gemma3_text: 4 heads over 1 KV head, 5 sliding layers : 1 full."""
    model = gemma_models(kind)
    if model.model.lm_head.weight.device != DEVICE:
        pytest.skip("the loaded models live on the CPU: compare there (interpreter)")
    monkeypatch.setenv(attention.ENV, "torch")
    want = _runner_schedule(model, random.Random(kind))
    monkeypatch.setenv(attention.ENV, "triton")
    got = _runner_schedule(model, random.Random(kind))
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and len(g.logits) == len(w.logits) > 0
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


def test_engine_with_triton_attention_generates_the_torch_paths_tokens_and_logprobs(
    families: dict[str, Family], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill (16-token budget), prefix caching and adapters, through the engine (over
    an FP8 cache: test_cuda_graphs.py, decode steps replayed)."""
    if not INTERPRETED:
        pytest.skip("the engine check runs the tiny model on CPU through the interpreter")
    family = families["llama"]
    rng = random.Random(17)
    shared = [rng.randrange(3, 380) for _ in range(12)]
    batch = [[*shared, *(rng.randrange(3, 380) for _ in range(n))] for n in (3, 9, 1)]
    batch.append([rng.randrange(3, 380) for _ in range(21)])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)

    def run() -> list[tuple[list[int], list[float]]]:
        config = EngineConfig(model=str(family.model_dir), device="cpu", dtype="float32",
                              block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
                              enable_prefix_caching=True)  # fmt: skip
        engine = Engine(config)
        refs = {n: engine.register_lora(n, family.adapters[n], "t") for n in ("r16", "r4")}
        outs = engine.generate(batch, params, [refs["r16"], refs["r16"], None, refs["r4"]])
        return [(o.token_ids, o.logprobs) for o in outs]

    monkeypatch.setenv(attention.ENV, "torch")
    want = run()
    monkeypatch.setenv(attention.ENV, "triton")
    got = run()
    for (g_tokens, g_lp), (w_tokens, w_lp) in zip(got, want, strict=True):
        assert g_tokens == w_tokens
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from loraplane.dataplane.kernels import attention_triton as at

    def compile(kernel, types, consts):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
        src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert out.asm["cubin"], (kernel, consts)
        return out

    count = 0
    for dt, precision in (("*bf16", "tf32"), ("*fp16", "tf32"), ("*fp32", "ieee")):
        types = {"out_ptr": dt, "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "q_ptr": dt,
                 "k_ptr": dt, "v_ptr": dt, "tables_ptr": "*i32", "cu_ptr": "*i32",
                 "ctx_ptr": "*i32", "scale": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
        consts = {"GROUP": 4, "HEAD_DIM": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16, "TILE_N": 64,
                  "DOT_FP32": False, "PRECISION": precision, "SOFTCAP": 0.0, "KV_FP8": False}
        # decode at Llama-3-8B's heads: split-KV, num_seqs specialised to 1
        decode = {"BLOCK_M": 16, "WINDOW": 0, "NUM_SPLITS": 4, "num_seqs": 1}
        compile(at._attention_kernel, types, {**consts, **decode})
        count += 1
        if dt == "*bf16":  # the serving dtype: prefill with a window, and the combine
            prefill = {"BLOCK_M": 64, "WINDOW": 4096, "NUM_SPLITS": 1}
            compile(at._attention_kernel, types, {**consts, **prefill})
            compile(at._combine_kernel, types, {"HEAD_DIM": 128, "HEAD_PAD": 128,
                                                "NUM_SPLITS": 4})
            # Gemma 2: head_dim 256, 2 query heads per KV head, soft-capped scores, a window
            gemma = {**consts, "GROUP": 2, "HEAD_DIM": 256, "HEAD_PAD": 256, "TILE_N": 32,
                     "BLOCK_M": 64, "WINDOW": 4096, "NUM_SPLITS": 1,
                     "SOFTCAP": 50.0 * 1.4426950408889634}
            out = compile(at._attention_kernel, types, gemma)
            assert out.metadata.shared <= 227 * 1024, out.metadata.shared  # an H100's SM
            count += 3
            # an FP8 cache read by bf16 queries: decode (split-KV) and prefill
            fp8 = {**types, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}
            compile(at._attention_kernel, fp8, {**consts, **decode, "KV_FP8": True})
            compile(at._attention_kernel, fp8, {**consts, **prefill, "KV_FP8": True})
            count += 2
    print("compiled", count)
    """
)


def test_kernels_compile_to_sm90_cubin_in_every_dtype_without_a_gpu() -> None:
    """The interpreter does not lower kernels; compile them for an H100/H200 target here."""
    assert "compiled 8" in compile_without_gpu(_COMPILE_SCRIPT, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(
    INTERPRETED, reason="needs CUDA and compiled Triton (bf16 dot is wrong when interpreted)"
)
@pytest.mark.parametrize("window", [None, 64], ids=["causal", "window64"])
@pytest.mark.parametrize(
    "rows",
    [[(1, 2048)] * 16 + [(1, 7)] * 4, [(1, 900), (200, 1200), (64, 64), (1, 1), (33, 800)]],
    ids=["decode", "mixed"],
)
def test_bf16_on_gpu_matches_the_torch_path_at_llama3_8b_heads(
    rows: list[tuple[int, int]], window: int | None
) -> None:
    b = _batch(rows, 32, 8, 128, 16, torch.bfloat16, seed=1)
    expected = _expected(b, window)
    _assert_close(_triton(b, window), expected, torch.bfloat16)
    # split-KV at the same shapes (the default picks it only when SMs would idle)
    b = _batch(rows, 32, 8, 128, 16, torch.bfloat16, seed=1)
    cfg = at.AttentionConfig(block_m=16, num_splits=8)
    _assert_close(_triton(b, window, cfg), expected, torch.bfloat16)
