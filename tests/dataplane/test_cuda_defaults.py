"""The CUDA defaults tested together, on CPU through Triton's interpreter.

On CUDA an engine runs with adapters inside the KV cache (the arena, `kv_lora_shared`), the
Triton SGMV kernels (`LORAPLANE_SGMV` auto -> triton) and the Triton attention kernel
(`LORAPLANE_ATTENTION` auto -> triton), eagerly or replaying decode graphs. Here the same
engine runs on CPU tensors with those choices forced, the graphs "replayed" by
`replay_eagerly`, over one workload that mixes adapters of ranks 8 to 32 with base-model rows,
hits the prefix cache and preempts sequences; its greedy tokens must be the torch path's
(arena off) and HF + PEFT's. Then alignment: the arena never hands out a view off 16 bytes
(what the kernels' pointer hints and the graphs' slot tables rely on), refuses a cache that
cannot keep that promise, and a slot breaking it runs eagerly instead of being replayed.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane import attention
from loraplane.dataplane.block_manager import BlockManager
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.cuda_graphs import PTR_ALIGN, replay_eagerly
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora.arena import ALIGN_BYTES, ArenaAlignmentError, KVArena
from loraplane.dataplane.lora.loader import LoadedAdapter, LoRAWeights
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import hf_greedy, prompts

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

# the shared prefix: two full blocks of 4 tokens, which the late r16 request finds cached
PREFIX = prompts(1, seed=41, low=8, high=8)[0]
# (prompt, adapter, tokens to generate, the step it arrives at): ranks 8 (q/v), 16 (all
# modules) and 32 (MLP only) beside base-model rows; the last two arrive once the first
# request's prompt is in the prefix cache
REQUESTS: list[tuple[list[int], str | None, int, int]] = [
    ([*PREFIX, 7, 8, 9], "r16", 6, 0),
    (prompts(1, seed=42, low=9, high=9)[0], "r8-qv", 7, 0),
    (prompts(1, seed=43, low=6, high=6)[0], None, 5, 0),
    (prompts(1, seed=44, low=10, high=10)[0], "r32-mlp", 6, 0),
    ([*PREFIX, 10, 11], "r16", 5, 2),
    ([*PREFIX, 7, 8, 9], None, 4, 2),
]


def _engine(family: Family, **overrides: Any) -> Engine:
    """The tiny Llama (2 layers, hidden 64) with a KV share small enough to preempt."""
    settings: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                                "num_kv_blocks": 14, "max_num_seqs": 6,
                                "max_num_batched_tokens": 64, "enable_prefix_caching": True,
                                "enable_lora_prefetch": False}  # fmt: skip
    settings.update(overrides)
    return Engine(EngineConfig(model=str(family.model_dir), **settings))


def _shared(family: Family, **overrides: Any) -> Engine:
    """The engine with adapters in the arena, whose adapter memory holds exactly the
    workload's adapters: blocks they do not hold are all the KV there is."""
    device = overrides.get("device", "cpu")
    probe = _engine(family, kv_lora_shared=True, device=device, cuda_graphs=False)
    names = {n for _, n, _, _ in REQUESTS if n}
    need = sum(probe.loras.device_bytes(probe.register_lora(n, family.adapters[n])) for n in names)
    return _engine(family, kv_lora_shared=True, lora_memory=need, **overrides)


def _run(engine: Engine, family: Family) -> list[list[int]]:
    """Every request of REQUESTS, each added at its step; the greedy tokens, in order."""
    refs = {n: engine.register_lora(n, family.adapters[n], "t") for _, n, _, _ in REQUESTS if n}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(REQUESTS))}
    step = 0
    while step == 0 or engine.has_unfinished:
        assert step < 500, "the workload did not finish in 500 steps (a stuck request?)"
        for i, (prompt, name, n, at) in enumerate(REQUESTS):
            if at == step:
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                engine.add_request(str(i), prompt, params, refs[name] if name else None)
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.token_ids)
        step += 1
    return [tokens[str(i)] for i in range(len(REQUESTS))]


def _in_arena(engine: Engine) -> None:
    """Every resident adapter's tensors are views of the KV cache, each on 16 bytes."""
    pool, cache = engine.runner.pool, engine.runner.kv_cache
    start, end = cache.data_ptr(), cache.data_ptr() + cache.numel() * cache.element_size()
    placed = 0
    for slots in pool.modules.values():
        for a, b in zip(slots.lora_a, slots.lora_b, strict=True):
            for t in (a, b):
                if t is not None:
                    assert start <= t.data_ptr() < end and t.data_ptr() % ALIGN_BYTES == 0
                    placed += 1
    assert placed > 0


@pytest.fixture
def family(tiny_llama_dir: Path, peft_adapters: dict[str, Path]) -> Family:
    """The tiny Llama and the workload's adapters."""
    names = {n for _, n, _, _ in REQUESTS if n}
    return Family("llama", tiny_llama_dir, {n: peft_adapters[n] for n in names})


def _peft_tokens(family: Family) -> list[list[int]]:
    """HF + PEFT's greedy tokens for every request of REQUESTS."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(family.model_dir)
    (first, *rest) = family.adapters
    model = peft.PeftModel.from_pretrained(base, family.adapters[first], adapter_name=first)
    for name in rest:
        model.load_adapter(family.adapters[name], adapter_name=name)
    model.eval()
    return [hf_greedy(model, prompt, name, n) for prompt, name, n, _ in REQUESTS]


@pytest.fixture
def reference(family: Family, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The torch path's tokens (torch SGMV and attention, adapters in buffers of their own),
    under preemption and prefix cache hits, checked against HF + PEFT."""
    monkeypatch.setenv(dispatch.ENV, "torch")
    monkeypatch.setenv(attention.ENV, "torch")
    engine = _engine(family, kv_lora_shared=False)
    want = _run(engine, family)
    assert engine.stats.preemptions > 0 and engine.block_manager.cache_hit_tokens > 0
    assert want == _peft_tokens(family)
    return want


def test_arena_triton_sgmv_and_attention_give_torch_and_peft_tokens_eager_and_from_graphs(
    family: Family, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference fixture checked the torch path against PEFT; here the CUDA defaults,
    eager and with graphs, each under preemption and prefix cache hits."""
    if not INTERPRETED:
        pytest.skip("runs the tiny model on CPU through Triton's interpreter")
    pytest.importorskip("triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setenv(attention.ENV, "triton")
    probe = torch.empty(0)
    assert (dispatch.backend(probe), attention.backend(probe)) == ("triton", "triton")
    for graphs in (False, True):
        engine = _shared(family)
        assert engine.runner.pool.arena is not None
        if graphs:
            assert engine.enable_cuda_graphs(capture=replay_eagerly)
        assert _run(engine, family) == reference, f"graphs={graphs}"
        stats = engine.stats, engine.block_manager
        assert stats[0].preemptions > 0 and stats[1].cache_hit_tokens > 0, f"graphs={graphs}"
        _in_arena(engine)
        if graphs:
            decode = engine.runner.cuda_graphs
            assert decode is not None and decode.replays > 0 and decode.fallbacks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_on_cuda_the_defaults_give_torch_and_peft_tokens_eager_and_from_captured_graphs(
    family: Family, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> None:
    """The same workload on a GPU with nothing forced: fp32 (IEEE dots, no TF32), the
    backends' own choice (compiled Triton SGMV/BGMV and attention), adapters in the arena, and
    real CUDA graphs captured and replayed; the tokens of the CPU torch path and HF + PEFT."""
    monkeypatch.delenv(dispatch.ENV, raising=False)  # set to torch by the reference fixture
    monkeypatch.delenv(attention.ENV, raising=False)
    probe = torch.empty(0, device="cuda")
    assert (dispatch.backend(probe), attention.backend(probe)) == ("triton", "triton")
    engine = _shared(family, device="cuda", cuda_graphs=graphs)
    assert engine.runner.pool.arena is not None
    assert _run(engine, family) == reference
    assert engine.stats.preemptions > 0 and engine.block_manager.cache_hit_tokens > 0
    _in_arena(engine)
    if graphs:
        decode = engine.runner.cuda_graphs
        assert decode is not None and decode.replays > 0 and decode.fallbacks == 0


# -- alignment ----------------------------------------------------------------------------


def _odd_adapter(layers: int = 2) -> LoadedAdapter:
    """Rank 3 over 10 -> 6 features: 30 and 18 elements, so tensors packed back to back
    would start off 16 bytes (at 120 bytes of fp32, then 192, ...)."""
    g = torch.Generator().manual_seed(3)
    modules = {
        (layer, module): LoRAWeights(
            a=torch.randn(3, 10, generator=g), b=torch.randn(6, 3, generator=g), scale=0.5
        )
        for layer in range(layers)
        for module in ("q_proj", "v_proj", "o_proj")
    }
    return LoadedAdapter("odd", modules)


def test_the_arena_pads_each_view_to_16_bytes_where_back_to_back_would_not_be() -> None:
    assert ALIGN_BYTES == PTR_ALIGN  # the graphs' slot tables promise what the arena keeps
    adapter = _odd_adapter()
    for dtype in (torch.float32, torch.bfloat16):
        blocks = BlockManager(16, 4)
        cache = torch.zeros(2, 2, 16, 4, 1, 8, dtype=dtype)  # blocks of 32 elements per region
        arena = KVArena(cache, blocks)
        sizes = [t.numel() for _, _, t in arena._items_by_layer(adapter)[0]]
        unpadded, ends = [0], 0
        for size in sizes[:-1]:
            ends += size
            unpadded.append(ends)
        # the negative control: packed back to back, some view would start off 16 bytes
        assert any(o * cache.element_size() % ALIGN_BYTES for o in unpadded)
        placement = arena.place(adapter)
        assert placement is not None
        for key, w in adapter.modules.items():
            a, b = placement.views[key]
            assert a.data_ptr() % ALIGN_BYTES == 0 and b.data_ptr() % ALIGN_BYTES == 0, key
            assert torch.equal(a, w.a.to(dtype)) and torch.equal(b, w.b.to(dtype))
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                       for pair in placement.views.values() for t in pair)  # fmt: skip
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))  # no overlap
        # the padding is counted: the run is as long as the aligned packing needs
        assert placement.num_blocks == arena.blocks_for(adapter)
        arena.free(placement)
        assert blocks.num_reserved == 0


def test_a_cache_whose_blocks_break_16_bytes_refuses_the_placement_naming_the_view() -> None:
    """Blocks of 3 fp32 elements (12 bytes) in a cache of 63: layer 1's regions start 756
    bytes after layer 0's, so one of them is off 16 bytes whatever the run and the offsets;
    the placement is refused before any view exists, its run given back."""
    blocks = BlockManager(63, 1)
    arena = KVArena(torch.zeros(2, 2, 63, 1, 1, 3), blocks)
    with pytest.raises(ArenaAlignmentError) as refused:
        arena.place(_odd_adapter())
    message = str(refused.value)
    assert "adapter 'odd'" in message and "not on 16 bytes" in message
    assert "layer " in message and "element " in message and "region of blocks" in message
    assert blocks.num_reserved == 0 and blocks.num_free_blocks == 63


def test_a_slot_off_16_bytes_is_not_replayed_and_decodes_eagerly_to_the_same_tokens(
    family: Family, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graphs' guard behind the arena's promise: a slot whose A starts 4 bytes off 16
    (moved there by hand) keeps its steps out of the graphs; they decode eagerly (the kernels
    then take the pointers' own alignment) and give the torch path's tokens."""
    if not INTERPRETED:
        pytest.skip("runs the tiny model on CPU through Triton's interpreter")
    pytest.importorskip("triton")
    prompt, params = [5, 9, 13, 17], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    monkeypatch.setenv(dispatch.ENV, "torch")
    monkeypatch.setenv(attention.ENV, "torch")
    plain = _engine(family, kv_lora_shared=False)
    ref = plain.register_lora("r16", family.adapters["r16"], "t")
    (want,) = plain.generate([prompt], params, [ref])
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setenv(attention.ENV, "triton")
    engine = _engine(family, kv_lora_shared=True, lora_memory=1 << 20, max_num_seqs=1)
    assert engine.enable_cuda_graphs(capture=replay_eagerly)
    ref = engine.register_lora("r16", family.adapters["r16"], "t")
    pool = engine.runner.pool
    load = pool.load

    def load_one_off(slot: int, adapter: LoadedAdapter) -> bool:
        if not load(slot, adapter):
            return False
        slots = pool.modules[(1, "q_proj")]
        a = slots.lora_a[slot]
        assert a is not None and a.data_ptr() % ALIGN_BYTES == 0  # the arena's own view
        moved = torch.empty(a.numel() + 1, dtype=a.dtype)[1:].view(a.shape)
        moved.copy_(a)
        slots.lora_a[slot] = moved
        return True

    monkeypatch.setattr(pool, "load", load_one_off)
    (got,) = engine.generate([prompt], params, [ref])
    assert got.token_ids == want.token_ids
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and graphs.fallbacks >= 3 and graphs.replays == 0
