"""Tensor parallelism (parallel/): the shard rules exact by construction, and TP = 2 on CPU
(two processes over gloo) giving TP = 1's tokens in mixed adapter batches; a dead worker ends
the engine with WorkerLost, never a hang."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane.async_engine import AsyncEngine
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.lora.loader import LoadedAdapter, LoRAWeights
from loraplane.dataplane.models.config import UnsupportedModelError
from loraplane.dataplane.models.loader import load_model
from loraplane.dataplane.parallel.errors import WorkerLost
from loraplane.dataplane.parallel.shard import Heads, TPShard, checkpoint_slice, shard_adapter
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import Family, hf_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
H4 = Heads(4, 4)  # the heads of the one-layer checks (their k/v rules need none)


# -- the rules, on one linear layer with an adapter (no processes) ---------------------------


def _layer(out: int, fan_in: int, rank: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(out * 7 + fan_in)
    w = torch.randn(out, fan_in, generator=g, dtype=torch.float64)
    bias = torch.randn(out, generator=g, dtype=torch.float64)
    a = torch.randn(rank, fan_in, generator=g, dtype=torch.float64)
    b = torch.randn(out, rank, generator=g, dtype=torch.float64)
    x = torch.randn(3, fan_in, generator=g, dtype=torch.float64)
    return w, bias, a, b, x


def _adapter(module: str, a: torch.Tensor, b: torch.Tensor) -> LoadedAdapter:
    return LoadedAdapter("t", {(0, module): LoRAWeights(a=a, b=b, scale=0.5)})


def _with_lora(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, ad: LoadedAdapter) -> Any:
    lora = next(iter(ad.modules.values()))
    return x @ w.T + bias + lora.scale * (x @ lora.a.T) @ lora.b.T


@pytest.mark.parametrize("size", [2, 4])
def test_column_parallel_slices_side_by_side_are_the_whole_layer(size: int) -> None:
    w, bias, a, b, x = _layer(out=16, fan_in=12)
    name = "model.layers.0.mlp.up_proj"
    whole = _with_lora(x, w, bias, _adapter("up_proj", a, b))
    parts = []
    for rank in range(size):
        shard = TPShard(rank, size)
        ad = shard_adapter(_adapter("up_proj", a, b), shard, H4)
        lora = ad.modules[(0, "up_proj")]
        assert lora.a.shape == a.shape and lora.b.shape == (16 // size, 4)
        w_r = checkpoint_slice(name + ".weight", w, shard, H4)
        b_r = checkpoint_slice(name + ".bias", bias, shard, H4)
        parts.append(_with_lora(x, w_r, b_r, ad))
    torch.testing.assert_close(torch.cat(parts, dim=-1), whole)


@pytest.mark.parametrize("size", [2, 4])
def test_row_parallel_partials_sum_to_the_whole_layer_with_the_bias_once(size: int) -> None:
    w, bias, a, b, x = _layer(out=10, fan_in=16)
    name = "model.layers.1.self_attn.o_proj"
    whole = _with_lora(x, w, bias, _adapter("o_proj", a, b))
    total = torch.zeros_like(whole)
    for rank in range(size):
        shard = TPShard(rank, size)
        cols = shard.part(16)
        ad = shard_adapter(_adapter("o_proj", a, b), shard, H4)
        assert ad.modules[(0, "o_proj")].a.shape == (4, 16 // size)
        w_r = checkpoint_slice(name + ".weight", w, shard, H4)
        b_r = checkpoint_slice(name + ".bias", bias, shard, H4)
        assert bool(b_r.any()) == (rank == 0)
        total += _with_lora(x[:, cols], w_r, b_r, ad)
    torch.testing.assert_close(total, whole)


@pytest.mark.parametrize("size", [2, 4])
def test_fused_qkv_and_gate_up_split_part_by_part_as_their_unfused_projections(size: int) -> None:
    """Phi-3's qkv_proj is [q | k | v] and gate_up_proj [gate | up]: a rank's rows are its q,
    k and v rows (its gate and up rows), as the unfused projections would split, with B's rows
    of a fused adapter alike."""
    heads, head_dim, hidden = Heads(8, 4), 2, 6
    q, kv = 8 * head_dim, 4 * head_dim
    w = torch.arange((q + 2 * kv) * hidden, dtype=torch.float32).view(q + 2 * kv, hidden)
    b = torch.randn(q + 2 * kv, 3)
    gate_up = torch.randn(2 * 10, hidden)
    for rank in range(size):
        shard = TPShard(rank, size)
        fused = checkpoint_slice("model.layers.0.self_attn.qkv_proj.weight", w, shard, heads)
        parts = [
            checkpoint_slice(f"model.layers.0.self_attn.{name}.weight", part, shard, heads)
            for name, part in zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv]),
                                  strict=True)
        ]  # fmt: skip
        assert torch.equal(fused, torch.cat(parts))
        up = checkpoint_slice("model.layers.0.mlp.gate_up_proj.weight", gate_up, shard, heads)
        gate_part, up_part = gate_up.chunk(2)
        assert torch.equal(up.chunk(2)[0], gate_part[shard.part(10)])
        assert torch.equal(up.chunk(2)[1], up_part[shard.part(10)])
        lora = shard_adapter(_adapter("qkv_proj", torch.randn(3, hidden), b), shard, heads)
        b_rows = [part[rows] for part, rows in zip(
            b.split([q, kv, kv]), (shard.part(q), shard.kv_part(kv, 4), shard.kv_part(kv, 4)),
            strict=True)]  # fmt: skip
        assert torch.equal(lora.modules[(0, "qkv_proj")].b, torch.cat(b_rows))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    ("block", "names"),
    [("block_sparse_moe", ("w1", "w3", "w2")), ("mlp", ("gate_proj", "up_proj", "down_proj"))],
)
def test_an_expert_with_its_lora_splits_as_a_dense_mlp_and_its_partials_sum_to_it(
    size: int, block: str, names: tuple[str, str, str]
) -> None:
    """Mixtral's and Qwen3-MoE's expert linears by name: gate and up (w1, w3) by output rows,
    down (w2) by input columns, adapters' A and B alike; each rank's rows through its slice
    of the expert sum to the whole expert's (what the all-reduce after the experts' weighted
    sum adds up), and the router is kept whole on every rank."""
    hidden, inter, r = 12, 16, 4
    g = torch.Generator().manual_seed(size)
    x = torch.randn(5, hidden, generator=g, dtype=torch.float64)
    shapes = {names[0]: (inter, hidden), names[1]: (inter, hidden), names[2]: (hidden, inter)}
    weights = {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    modules = {
        (0, f"experts.3.{n}"): LoRAWeights(
            torch.randn(r, s[1], generator=g, dtype=torch.float64),
            torch.randn(s[0], r, generator=g, dtype=torch.float64), 0.5,
        )
        for n, s in shapes.items()
    }  # fmt: skip

    def expert(w: dict[str, torch.Tensor], ad: LoadedAdapter, x: torch.Tensor) -> torch.Tensor:
        def linear(name: str, v: torch.Tensor) -> torch.Tensor:
            lora = ad.modules[(0, f"experts.3.{name}")]
            return v @ w[name].T + lora.scale * (v @ lora.a.T) @ lora.b.T

        h = torch.nn.functional.silu(linear(names[0], x)) * linear(names[1], x)
        return linear(names[2], h)

    whole = expert(weights, LoadedAdapter("t", modules), x)
    total = torch.zeros_like(whole)
    router = torch.randn(4, hidden, generator=g)
    for rank in range(size):
        shard = TPShard(rank, size)
        prefix = f"model.layers.0.{block}"
        local = {
            n: checkpoint_slice(f"{prefix}.experts.3.{n}.weight", w, shard, H4)
            for n, w in weights.items()
        }
        assert local[names[0]].shape == (inter // size, hidden)
        assert local[names[2]].shape == (hidden, inter // size)
        assert checkpoint_slice(f"{prefix}.gate.weight", router, shard, H4) is router
        total += expert(local, shard_adapter(LoadedAdapter("t", modules), shard, H4), x)
    torch.testing.assert_close(total, whole)


def test_fewer_kv_heads_than_ranks_replicates_the_head_each_rank_reads() -> None:
    head_dim, kv_heads = 3, 2
    w = torch.arange(kv_heads * head_dim * 5, dtype=torch.float32).view(-1, 5)
    rows = [checkpoint_slice("model.layers.0.self_attn.k_proj.weight", w, TPShard(r, 4),
                             Heads(4, 2)) for r in range(4)]  # fmt: skip
    # query heads 0-1 of 4 ranks... ranks 0, 1 read KV head 0; ranks 2, 3 KV head 1
    assert torch.equal(rows[0], w[:3]) and torch.equal(rows[1], w[:3])
    assert torch.equal(rows[2], w[3:]) and torch.equal(rows[3], w[3:])


def test_the_vocabulary_splits_into_equal_padded_slices() -> None:
    emb = torch.arange(10, dtype=torch.float32).view(10, 1).expand(10, 2).contiguous()
    parts = [
        checkpoint_slice("model.embed_tokens.weight", emb, TPShard(r, 4), H4) for r in range(4)
    ]
    assert [tuple(p.shape) for p in parts] == [(3, 2)] * 4
    assert torch.equal(torch.cat(parts)[:10], emb)
    assert not parts[3][1:].any()  # the last rank's padding rows
    norm = torch.ones(4)
    assert (
        checkpoint_slice("model.layers.0.input_layernorm.weight", norm, TPShard(1, 2), H4) is norm
    )


def test_models_that_cannot_be_split_are_refused_by_name(
    families: dict[str, Family], tmp_path: Path
) -> None:
    from tests.factories import build_model

    odd = build_model(tmp_path / "qwen3_moe", "qwen3_moe", moe_intermediate_size=45)
    llama = families["llama"].model_dir  # 4 heads over 2 KV heads
    with pytest.raises(UnsupportedModelError, match=r"does not divide num_attention_heads \(4\)"):
        load_model(llama, torch.float32, "cpu", shard=TPShard(0, 3))
    with pytest.raises(UnsupportedModelError, match=r"does not divide moe_intermediate_size \(45"):
        load_model(odd, torch.float32, "cpu", shard=TPShard(0, 2))
    with pytest.raises(ValueError, match="cuda_graphs is not supported with tensor_parallel"):
        EngineConfig(model=str(llama), device="cpu", tensor_parallel_size=2, cuda_graphs=True)
    config = EngineConfig(model=str(llama), device="cuda", tensor_parallel_size=2)
    assert config.kv_lora_shared is True and config.cuda_graphs is False


@pytest.mark.parametrize("transposed", [False, True])
def test_a_packed_part_unpacks_to_its_rank_slice_and_pickles_as_one_buffer(
    transposed: bool,
) -> None:
    """What rank 0 ships a worker (parallel/ship.py): the rank's slice of each module, cast to
    the pool's dtype and laid out as its pool holds B, in one buffer whose bytes are all that
    a pickle carries (views of one storage would each carry the whole storage)."""
    import pickle

    from loraplane.dataplane.lora.host_form import is_host_form
    from loraplane.dataplane.parallel.ship import peer_parts, unpack, wire, with_buffer

    torch.manual_seed(0)
    modules = {}
    for layer in range(3):
        for module, (out, fan_in) in {"q_proj": (32, 32), "down_proj": (32, 48)}.items():
            a, b = torch.randn(8, fan_in), torch.randn(out, 8)
            modules[(layer, module)] = LoRAWeights(a.bfloat16(), b.bfloat16(), 0.5)
    adapter = LoadedAdapter("x", modules, "sha256:x")
    shard = TPShard(0, 4)
    parts = peer_parts(adapter, shard, H4, torch.float32, transposed)
    assert len(parts) == 3
    for rank, packed in zip((1, 2, 3), parts, strict=True):
        want = shard_adapter(adapter, TPShard(rank, 4), H4)
        pickled = pickle.dumps(packed)
        assert packed.nbytes == 4 * sum(w.a.numel() + w.b.numel() for w in want.modules.values())
        assert len(pickled) < packed.nbytes + 4096
        got = unpack(pickle.loads(pickled))
        assert is_host_form(got, torch.float32, transposed)  # the worker's pool reads it as is
        assert got.modules.keys() == want.modules.keys() and got.digest == "sha256:x"
        for key, w in want.modules.items():
            assert torch.equal(got.modules[key].a, w.a.float())
            assert torch.equal(got.modules[key].b, w.b.float())
            assert got.modules[key].scale == 0.5
    # on the wire: one layout in the step message, each rank's bytes alone
    layout, buffers = wire(parts)
    assert layout.nbytes == 0 and [b.nbytes for b in buffers] == [p.nbytes for p in parts]
    for packed, buffer in zip(parts, buffers, strict=True):
        got = unpack(with_buffer(pickle.loads(pickle.dumps(layout)), buffer.copy()))
        assert all(torch.equal(got.modules[k].b, w.b) for k, w in unpack(packed).modules.items())


def test_rank_0_keeps_the_workers_parts_exactly_as_long_as_its_host_copy(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    """The workers' parts live beside rank 0's host copy: made when it is read, gone when the
    host tier evicts or unregisters it (no parts kept for versions it no longer holds)."""
    from loraplane.adapters.base_model import BaseModelSpec
    from loraplane.dataplane.lora import LoRAPool
    from loraplane.dataplane.lora.manager import LoRAManager

    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    made: list[str] = []

    @dataclass(frozen=True)
    class Part:
        of: str
        nbytes: int = 0

    def peers(adapter: LoadedAdapter) -> tuple[Part, ...]:
        made.append(adapter.digest)
        return (Part(f"part of {adapter.digest}"),)

    pool = LoRAPool(1, spec, torch.float32, "cpu")
    manager = LoRAManager(pool, spec, 64, max_cpu_loras=1, shard=lambda a: a, peers=peers)
    try:
        first = manager.register("a", peft_adapters["r4"])
        assert manager.peer_parts(first.key) == (Part(f"part of {first.digest}"),)
        second = manager.register("b", peft_adapters["r16"])  # evicts the first's host copy
        assert not manager.in_host_memory(first)
        with pytest.raises(KeyError):
            manager.peer_parts(first.key)
        assert manager.peer_parts(second.key) == (Part(f"part of {second.digest}"),)
        manager.unregister("b")
        with pytest.raises(KeyError):
            manager.peer_parts(second.key)
        assert made == [first.digest, second.digest]
    finally:
        manager.close()


def test_rank_0s_host_tier_weighs_every_ranks_part_and_evicts_them_together(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    """TP = 2, rank 0's manager as the model runner builds it: a version's host bytes are its
    own part's plus the worker's (equal in size: twice one rank's part), the tier's bytes are
    the sum over its versions, and the `max_cpu_loras` limit evicts a version with all its
    parts, the tier's bytes falling by exactly that version's."""
    from loraplane.adapters.base_model import BaseModelSpec
    from loraplane.dataplane.lora import LoRAPool
    from loraplane.dataplane.lora.manager import LoRAManager
    from loraplane.dataplane.parallel.shard import heads_of, local_spec
    from loraplane.dataplane.parallel.ship import peer_parts

    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    shard, heads = TPShard(0, 2), heads_of(spec)
    pool = LoRAPool(2, local_spec(spec, shard), torch.float32, "cpu")
    manager = LoRAManager(
        pool, spec, 64, max_cpu_loras=2,
        shard=functools.partial(shard_adapter, shard=shard, heads=heads),
        peers=functools.partial(peer_parts, shard=shard, heads=heads, dtype=torch.float32,
                                transposed=pool.transposes_b),
    )  # fmt: skip
    try:
        refs = [manager.register(n, peft_adapters[n]) for n in ("r4", "r16")]
        weights = {}
        for ref in refs:
            entry = manager.registry.entries[ref.key]
            own = manager.host_copy(ref).nbytes
            (theirs,) = manager.peer_parts(ref.key)
            assert own == pool.bytes_needed(manager.host_copy(ref)) > 0
            assert theirs.nbytes == own  # equal splits: each rank's part the same size
            assert entry.host_bytes == own + theirs.nbytes
            weights[ref.key] = entry.host_bytes
        assert manager.host.bytes == sum(weights.values())
        snapshot_figure = manager.host.bytes
        third = manager.register("r32-mlp", peft_adapters["r32-mlp"])  # evicts r4, the LRU
        assert not manager.in_host_memory(refs[0]) and manager.in_host_memory(refs[1])
        with pytest.raises(KeyError):
            manager.peer_parts(refs[0].key)
        added = manager.registry.entries[third.key].host_bytes
        assert manager.host.bytes == snapshot_figure - weights[refs[0].key] + added
        assert manager.registry.entries[refs[0].key].host_bytes == 0
        manager.unregister("r16")
        assert manager.host.bytes == added
        manager.unregister("r32-mlp")
        assert manager.host.bytes == 0 and not manager.host.hosted
    finally:
        manager.close()


def test_rank_0s_byte_limit_weighs_every_ranks_part_and_evicts_them_together(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    """TP = 2 under `max_cpu_lora_bytes`: the limit weighs a version's own part and the
    worker's together, evicts the least recently used version with all its parts, and refuses
    a version whose own part would fit but not with the worker's beside it."""
    from loraplane.adapters.base_model import BaseModelSpec
    from loraplane.adapters.errors import AdapterRejected, ReasonCode
    from loraplane.dataplane.lora import LoRAPool
    from loraplane.dataplane.lora.manager import LoRAManager
    from loraplane.dataplane.parallel.shard import heads_of, local_spec
    from loraplane.dataplane.parallel.ship import peer_parts

    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    shard, heads = TPShard(0, 2), heads_of(spec)
    pool = LoRAPool(2, local_spec(spec, shard), torch.float32, "cpu")
    manager = LoRAManager(
        pool, spec, 64, max_cpu_loras=8,
        shard=functools.partial(shard_adapter, shard=shard, heads=heads),
        peers=functools.partial(peer_parts, shard=shard, heads=heads, dtype=torch.float32,
                                transposed=pool.transposes_b),
    )  # fmt: skip
    try:
        refs = {n: manager.register(n, peft_adapters[n]) for n in ("r4", "r16", "r32-mlp")}
        weights = {n: manager.registry.entries[r.key].host_bytes for n, r in refs.items()}
        own = manager.host_copy(refs["r16"]).nbytes
        assert weights["r16"] == 2 * own  # the worker's part beside rank 0's own
        manager.max_cpu_lora_bytes = weights["r16"] + weights["r32-mlp"]
        manager.host.evict()
        assert not manager.in_host_memory(refs["r4"])  # the LRU, with its worker's part
        with pytest.raises(KeyError):
            manager.peer_parts(refs["r4"].key)
        assert manager.host.bytes == weights["r16"] + weights["r32-mlp"]
        manager.unregister("r16")
        manager.unregister("r32-mlp")
        manager.max_cpu_lora_bytes = None
        big = manager.register("r64", peft_adapters["r64"])
        whole = manager.registry.entries[big.key].host_bytes
        manager.unregister("r64")
        manager.max_cpu_lora_bytes = whole - 1  # rank 0's own part alone would fit
        with pytest.raises(AdapterRejected) as caught:
            manager.register("r64", peft_adapters["r64"])
        assert caught.value.code is ReasonCode.TOO_LARGE
        assert f"needs {whole} bytes of host memory (every tensor-parallel rank's part)" in (
            caught.value.message
        )
    finally:
        manager.close()


# -- two processes over gloo -------------------------------------------------------------------


def _engine(family: Family, tp: int, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {
        "device": "cpu", "dtype": "float32", "block_size": 4, "num_kv_blocks": 256,
        "max_loras": 3, "tensor_parallel_size": tp,
    }  # fmt: skip
    settings.update(overrides)
    return Engine(EngineConfig(model=str(family.model_dir), **settings))


def _run(engine: Engine, family: Family, names: list[str | None]) -> dict[str, Any]:
    refs = {n: engine.register_lora(n, family.adapters[n], "t") for n in names if n}
    for i, name in enumerate(names):
        prompt = [5 + i, 17, 33 + i, 9, 40 + 2 * i, 11][: 3 + i % 4]
        params = GREEDY
        if i == 1:  # a scoring request: prompt log-probabilities go through the split head
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                    prompt_logprobs=2, logprobs=2)  # fmt: skip
        engine.add_request(f"r{i}", prompt, params, refs.get(name) if name else None)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    prompt_lp: dict[str, Any] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
            if out.prompt_logprobs:
                prompt_lp[out.request_id] = out.prompt_logprobs
    return {"tokens": tokens, "logprobs": logprobs, "prompt": prompt_lp}


def _split_equals_whole(family: Family, names: list[str | None], **overrides: Any) -> None:
    """TP = 2 gives TP = 1's greedy tokens, and log-probs within 1e-4, on `names`."""
    expected = _run(_engine(family, 1, **overrides), family, names)
    split = _engine(family, 2, **overrides)
    try:
        got = _run(split, family, names)
    finally:
        split.close()
    assert got["tokens"] == expected["tokens"]
    for rid, values in expected["logprobs"].items():
        torch.testing.assert_close(got["logprobs"][rid], values, atol=1e-4, rtol=1e-4)


def _check_host_bytes(engine: Engine) -> None:
    """Rank 0's host tier weighs its copies and the workers' parts beside them, and reports
    that (the snapshot, hence `loraplane_cpu_adapter_bytes_used`)."""
    from loraplane.dataplane.snapshot import EngineSnapshot

    host = engine.loras.host
    assert 0 < len(host.hosted) <= host.max_cpu_loras
    held = [(e.host, host.peer_parts(key)) for key, e in host.hosted.items()]
    assert host.bytes == sum(c.nbytes + sum(p.nbytes for p in parts) for c, parts in held if c)
    assert host.bytes == sum(2 * c.nbytes for c, _ in held if c)  # TP = 2: two equal parts
    assert EngineSnapshot.of(engine).cpu_bytes_used == host.bytes


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_gives_tp1s_tokens_in_mixed_adapter_batches(
    families: dict[str, Family], kind: str
) -> None:
    # qwen2: one KV head over two ranks (replicated), tied embeddings, q/k/v biases
    family = families[kind]
    names: list[str | None] = ["r4", "r16", None, "r32-mlp", "r8-patterns", "r4", None, "r64"]
    # three slots for five adapters: slots are emptied and refilled on both ranks
    # (chunked prefill at 8 tokens a step mixes prefill and decode rows)
    one = _engine(family, 1, max_num_batched_tokens=8)
    expected = _run(one, family, names)
    two = _engine(family, 2, max_num_batched_tokens=8)
    try:
        got = _run(two, family, names)
        _check_host_bytes(two)
    finally:
        two.close()
    assert got["tokens"] == expected["tokens"]
    for rid, values in expected["logprobs"].items():
        torch.testing.assert_close(got["logprobs"][rid], values, atol=1e-4, rtol=1e-4)
    assert got["prompt"].keys() == expected["prompt"].keys() == {"r1"}
    assert len(got["prompt"]["r1"]) == len(expected["prompt"]["r1"])


def test_tp2_under_a_host_byte_limit_serves_more_adapters_than_fit_with_tp1s_tokens(
    families: dict[str, Family],
) -> None:
    """Two processes, one slot, a byte limit for two of three versions (each weighed with the
    worker's part): every request gets TP = 1's tokens, rank 0's host tier stays within the
    limit between requests, and versions evicted from it are read and shipped again."""
    family = families["llama"]
    names = ["r4", "r16", "r32-mlp", "r4", "r16"]
    one = _engine(family, 1, max_loras=1, max_cpu_loras=8)
    expected = [
        one.generate([[5, 17, 33]], GREEDY, [one.register_lora(n, family.adapters[n], "t")])[0]
        for n in names
    ]
    two = _engine(family, 2, max_loras=1, max_cpu_loras=8)
    try:
        refs = {n: two.register_lora(n, family.adapters[n], "t") for n in set(names)}
        host = two.loras.host
        weights = sorted(host.hosted[r.key].host_bytes for r in refs.values())
        two.loras.max_cpu_lora_bytes = limit = weights[-1] + weights[-2]
        for name, want in zip(names, expected, strict=True):
            (out,) = two.generate([[5, 17, 33]], GREEDY, [refs[name]])
            assert out.error is None, out.error
            assert out.token_ids == want.token_ids, name
            assert host.bytes <= limit, name
        assert two.loras.host_stats.evictions > 0
        _check_host_bytes(two)
    finally:
        two.close()


def test_tp2_equals_hf_peft(families: dict[str, Family], hf_reference: Any) -> None:
    family = families["llama"]
    engine = _engine(family, 2)
    try:
        got = _run(engine, family, ["r16", None, "r8-qv"])["tokens"]
    finally:
        engine.close()
    reference = hf_reference("llama")
    for i, name in enumerate(["r16", None, "r8-qv"]):
        tokens = [5 + i, 17, 33 + i, 9, 40 + 2 * i, 11][: 3 + i % 4]
        for _ in range(GREEDY.max_tokens if i != 1 else 4):
            tokens.append(int(hf_logits(reference, tokens, name)[-1].argmax()))
        assert got[f"r{i}"] == tokens[-len(got[f"r{i}"]) :], name


def _in_thread(fn: Any, timeout: float) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout} s: a hang"
    return box


def test_a_dead_worker_ends_the_engine_with_worker_lost_never_a_hang(
    families: dict[str, Family],
) -> None:
    family = families["llama"]
    engine = _engine(family, 2)
    try:
        loop = AsyncEngine(engine)
        worker = engine.runner.workers._procs[0]  # type: ignore[union-attr]
        worker.kill()  # SIGKILL: no goodbye
        worker.join(10)

        async def ask() -> None:
            async for _ in loop.generate("x", [5, 6, 7], GREEDY):
                pass

        import asyncio

        box = _in_thread(lambda: asyncio.run(ask()), timeout=60)
        assert "error" in box and "engine stopped: WorkerLost" in str(box["error"])
        deadline = time.monotonic() + 10
        while loop.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not loop.alive  # the replica's probes report the engine gone
        health = loop.health(stall_s=60, max_failed_steps=3)
        assert not health.ready
    finally:
        engine.close()


def test_a_step_after_the_worker_died_raises_worker_lost_naming_it(
    families: dict[str, Family],
) -> None:
    family = families["llama"]
    engine = _engine(family, 2)
    try:
        worker = engine.runner.workers._procs[0]  # type: ignore[union-attr]
        worker.kill()
        worker.join(10)
        engine.add_request("x", [5, 6, 7], GREEDY)
        box = _in_thread(engine.step, timeout=60)
        assert isinstance(box.get("error"), WorkerLost)
        assert "loraplane-tp1 exited" in str(box["error"])
    finally:
        engine.close()


def test_a_worker_failing_to_load_its_part_ends_the_engine_with_worker_lost_naming_it(
    families: dict[str, Family],
) -> None:
    """A part the worker's pool refuses (here: a layer the model lacks) makes its rank fail
    after it took the bytes; rank 0's next step raises WorkerLost naming that error, within
    seconds (no hang)."""
    from loraplane.dataplane.model_step import StepPlan
    from loraplane.dataplane.parallel.group import SlotLoad, StepMessage
    from loraplane.dataplane.parallel.ship import pack, wire

    engine = _engine(families["llama"], 2)
    try:
        workers = engine.runner.workers
        assert workers is not None
        bad = LoRAWeights(torch.zeros(4, 64), torch.zeros(64, 4), 1.0)
        packed = pack(LoadedAdapter("x", {(999, "q_proj"): bad}, "d"), torch.float32, True)
        layout, buffers = wire([packed])
        message = StepMessage(
            StepPlan([], False, []), [], [SlotLoad(0, "x", layout, packed.nbytes)]
        )
        workers.send(message, [buffers])  # the worker takes the bytes, then fails loading them
        engine.add_request("x", [5, 6, 7], GREEDY)
        box = _in_thread(engine.step, timeout=60)
        assert isinstance(box.get("error"), WorkerLost)
        assert "rank 1 failed: ValueError: adapter adapts 'q_proj' in layer 999" in str(
            box["error"]
        )
    finally:
        engine.close()


@pytest.fixture(scope="module")
def w4_checkpoints(
    families: dict[str, Family], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """4-bit checkpoints of the tiny llama in every format the loader reads."""
    from tests.dataplane.w4_checkpoints import VARIANTS, write

    out = tmp_path_factory.mktemp("w4-tp")
    return {name: write(families["llama"].model_dir, out, name).w4 for name in VARIANTS}


@pytest.mark.parametrize(
    "variant", ["ct-asym", "ct-channel", "ct-act-order", "awq", "gptq", "gptq-act-order"]
)
def test_each_ranks_4_bit_projections_dequantize_to_its_slice_of_the_unsplit_ones(
    w4_checkpoints: dict[str, Path], variant: str
) -> None:
    """Packed words, group scales and zero points split with their rows or input columns;
    one group per row (ct-channel) and act-order maps (every group kept, each rank's columns'
    entries of the map) on the row-parallel ones: the two ranks side by side are the unsplit
    model's weights, bit for bit."""
    from loraplane.dataplane.models.quant_w4 import W4Linear

    model = w4_checkpoints[variant]
    whole = load_model(model, torch.float32, "cpu")
    ranks = [load_model(model, torch.float32, "cpu", shard=TPShard(r, 2)) for r in range(2)]
    layers = [n for n, m in whole.named_modules() if isinstance(m, W4Linear)]
    assert {n.rpartition(".")[2] for n in layers} >= {"q_proj", "o_proj", "down_proj"}
    for name in layers:
        full = whole.get_submodule(name)
        parts = [rank.get_submodule(name) for rank in ranks]
        assert all(isinstance(p, W4Linear) for p in [full, *parts]), name
        dim = 1 if name.endswith(("o_proj", "down_proj")) else 0
        weights = torch.cat([p.dequantized() for p in parts], dim)  # type: ignore[operator]
        torch.testing.assert_close(weights, full.dequantized(), rtol=0, atol=0)  # type: ignore[operator]
        held = sum(p.device_bytes() for p in parts)  # type: ignore[operator]
        assert held < 1.3 * full.device_bytes()  # type: ignore[operator]  # not two copies


def test_4_bit_groups_a_split_would_cut_are_refused_naming_the_split(
    families: dict[str, Family], tmp_path: Path
) -> None:
    """Groups of 64 inputs over 2 ranks: o_proj's 64 inputs (4 heads of 16) leave 32 per rank."""
    import json
    import shutil

    awq = tmp_path / "awq-64"
    shutil.copytree(families["llama"].model_dir, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 64}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="tensor parallel size 2: a 4-bit projection"
                                                    " of 32 inputs does not split into groups"
                                                    " of 64"):  # fmt: skip
        load_model(awq, torch.float32, "cpu", shard=TPShard(0, 2))


@pytest.mark.parametrize("variant", ["awq", "gptq-act-order"])
def test_tp2_over_4_bit_weights_gives_tp1s_tokens_in_mixed_adapter_batches(
    families: dict[str, Family], w4_checkpoints: dict[str, Path], variant: str
) -> None:
    base = families["llama"]
    family = Family("llama", w4_checkpoints[variant], base.adapters)
    names: list[str | None] = ["r4", "r16", None, "r32-mlp", "r8-patterns", "r4"]
    _split_equals_whole(family, names)


# llama's FP8 checkpoint per channel, qwen2's per tensor, llama's 16-bit one quantized at load
FP8_FORMS = [("llama", None), ("qwen2", None), ("llama", "fp8")]


@pytest.fixture(scope="module")
def fp8_checkpoints(
    families: dict[str, Family], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """FP8 checkpoints (compressed-tensors) of llama per channel and of qwen2 (q/k/v biases,
    one KV head) per tensor."""
    from tests.dataplane.test_quant_fp8 import _write

    out = tmp_path_factory.mktemp("fp8-tp")
    return {
        "llama": _write(families["llama"].model_dir, out / "llama", "channel")[0],
        "qwen2": _write(families["qwen2"].model_dir, out / "qwen2", "tensor")[0],
    }


@pytest.mark.parametrize(("kind", "quantization"), FP8_FORMS)
def test_each_ranks_fp8_projections_dequantize_to_its_slice_of_the_unsplit_ones(
    families: dict[str, Family], fp8_checkpoints: dict[str, Path], kind: str,
    quantization: str | None,
) -> None:  # fmt: skip
    """Per-channel scales split with their rows (kept whole in o_proj / down_proj), a
    per-tensor scale kept by both ranks, a 16-bit checkpoint quantized whole before it is
    split (fp8 at load): the two ranks' slices side by side are the unsplit model's weights,
    bit for bit, and each rank holds half the projection bytes."""
    from loraplane.dataplane.models.quant import FP8Linear

    model = families[kind].model_dir if quantization else fp8_checkpoints[kind]
    whole = load_model(model, torch.float32, "cpu", quantization=quantization)
    ranks = [load_model(model, torch.float32, "cpu", quantization=quantization,
                        shard=TPShard(r, 2)) for r in range(2)]  # fmt: skip
    layers = [n for n, m in whole.named_modules() if isinstance(m, FP8Linear)]
    assert any(n.endswith("o_proj") for n in layers) and any(n.endswith("q_proj") for n in layers)
    for name in layers:
        full = whole.get_submodule(name)
        parts = [rank.get_submodule(name) for rank in ranks]
        assert all(isinstance(p, FP8Linear) for p in [full, *parts]), name
        weights = [p.dequantized() for p in parts]  # type: ignore[operator]
        if name.endswith(("o_proj", "down_proj")):  # row-parallel: input columns
            torch.testing.assert_close(torch.cat(weights, 1), full.dequantized(), rtol=0, atol=0)  # type: ignore[operator]
        elif not name.endswith(("k_proj", "v_proj")) or kind == "llama":  # output rows
            torch.testing.assert_close(torch.cat(weights, 0), full.dequantized(), rtol=0, atol=0)  # type: ignore[operator]
        else:  # qwen2's one KV head: both ranks hold it whole
            for w in weights:
                torch.testing.assert_close(w, full.dequantized(), rtol=0, atol=0)  # type: ignore[operator]
        if full.bias is not None and not name.endswith(("o_proj", "down_proj")):
            assert all(p.bias is not None and p.bias.dtype == torch.float32 for p in parts)


@pytest.mark.parametrize(("kind", "quantization"), FP8_FORMS)
def test_tp2_over_fp8_weights_gives_tp1s_tokens_in_mixed_adapter_batches(
    families: dict[str, Family], fp8_checkpoints: dict[str, Path], kind: str,
    quantization: str | None,
) -> None:  # fmt: skip
    """An FP8 checkpoint (llama per channel, qwen2 per tensor with biases) and a 16-bit one
    quantized at load, split over two ranks: TP = 1's greedy tokens and log-probs, adapters
    mixed with the base over three slots."""
    base = families[kind]
    model = base.model_dir if quantization else fp8_checkpoints[kind]
    family = Family(kind, model, base.adapters)
    names: list[str | None] = ["r4", "r16", None, "r32-mlp", "r8-patterns", "r4"]
    _split_equals_whole(family, names, quantization=quantization)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text", "phi3"])
def test_tp2_gives_tp1s_tokens_on_gemma_and_phi3(kind: str, tmp_path: Path) -> None:
    """Gemma's scaled embedding (after the vocabulary-parallel lookup's sum), its soft caps
    (attention per head; the logits after the gather) and 1 + w norms, split over two ranks;
    Gemma 2 with two KV heads, Gemma 3 with one (each rank holds it) and untied lm_head.
    Phi-3's fused qkv_proj and gate_up_proj (and its adapters' fused B) split part by part."""
    from tests.dataplane.test_models_gemma_parity import _build_model
    from tests.factories import build_model, build_peft_adapter

    if kind == "phi3":
        model = build_model(tmp_path / kind, kind)
        targets = (["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], ["o_proj", "down_proj"])
    else:
        model = _build_model(tmp_path / kind, kind, seed=3)
        targets = (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj"], ["o_proj", "down_proj"])  # fmt: skip
    adapters = {
        "a": build_peft_adapter(model, tmp_path / "a", seed=1, r=8, lora_alpha=16,
                                target_modules=targets[0]),
        "b": build_peft_adapter(model, tmp_path / "b", seed=2, r=4, lora_alpha=4,
                                target_modules=targets[1]),
    }  # fmt: skip
    family = Family(kind, model, adapters)
    names: list[str | None] = ["a", None, "b", "a"]
    _split_equals_whole(family, names)


@pytest.mark.parametrize(
    ("kind", "weights"),
    [("mixtral", None), ("qwen3_moe", None), ("mixtral", "fp8"), ("qwen3_moe", "fp8-checkpoint"),
     ("mixtral", "ct-act-order"), ("qwen3_moe", "gptq-v2"), ("qwen3_moe", "fp8-block")],
)  # fmt: skip
def test_tp2_gives_tp1s_tokens_on_mixtures_of_experts_with_expert_adapters(
    kind: str, weights: str | None, tmp_path: Path
) -> None:
    """Mixtral and Qwen3-MoE (q/k norms, a dense layer among the sparse ones) split over two
    ranks: each expert's gate/up by rows and down by columns, the router replicated, one
    all-reduce after the experts' weighted sum; adapters on attention only, on the experts
    only (PEFT target_parameters, split per expert at load, then per rank) and on both, mixed
    with base rows over two slots (slots emptied and refilled on both ranks), chunked. Also
    with FP8 experts: quantized at load, and from a per-channel FP8 checkpoint (each expert's
    down_proj keeps its whole rows' scales), and block-wise in blocks of 32x32 that each rank's
    slice of an expert (24 of its 48 rows or inputs) starts inside; and with 4-bit experts,
    act-order in groups of 16 (a rank's down keeps every group) and GPTQ v2 per channel."""
    from tests.dataplane.test_models_moe_parity import ADAPTERS, _build_adapter, _build_model
    from tests.dataplane.test_quant_fp8 import _write
    from tests.dataplane.test_quant_fp8_block import write_block_fp8
    from tests.dataplane.w4_checkpoints import VARIANTS as W4_VARIANTS
    from tests.dataplane.w4_checkpoints import write as write_w4

    model = _build_model(tmp_path / kind, kind, seed=41)
    adapters = {
        name: _build_adapter(model, tmp_path / name, kind, 400 + i, cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    if weights == "fp8-checkpoint":
        model = _write(model, tmp_path / "fp8", "channel")[0]
    elif weights == "fp8-block":
        model = write_block_fp8(model, tmp_path / "fp8-block", (32, 32))[0]
    elif weights in W4_VARIANTS:
        model = write_w4(model, tmp_path / "w4", weights).w4
    family = Family(kind, model, adapters)
    names: list[str | None] = ["r16-experts", "r8-attn", None, "r32-all", "r16-experts", None]
    settings: dict[str, Any] = {"max_loras": 2, "max_num_batched_tokens": 8}
    if weights == "fp8":
        settings["quantization"] = "fp8"
    expected = _run(_engine(family, 1, **settings), family, names)
    split = _engine(family, 2, **settings)
    try:
        got = _run(split, family, names)
        _check_host_bytes(split)
    finally:
        split.close()
    assert got["tokens"] == expected["tokens"]
    for rid, values in expected["logprobs"].items():
        torch.testing.assert_close(got["logprobs"][rid], values, atol=1e-4, rtol=1e-4)
    assert got["prompt"].keys() == expected["prompt"].keys() == {"r1"}


def test_workers_get_their_slices_from_rank_0_never_reading_adapter_files(
    families: dict[str, Family], tmp_path: Path
) -> None:
    """Rank 0 reads and validates an adapter once, and ships each worker its slice when it
    places it: with the adapter's files gone after registration (rank 0 holds its host copy),
    the split engine still gives the unsplit one's tokens. (Workers that read the files
    themselves fail here: their rank dies, WorkerLost.)"""
    import shutil

    family = families["llama"]
    names: list[str | None] = ["r16", None, "r32-mlp", "r16"]
    expected = _run(_engine(family, 1), family, names)
    copies = {n: tmp_path / n for n in ("r16", "r32-mlp")}
    for name, folder in copies.items():
        shutil.copytree(family.adapters[name], folder)
    moved = Family(family.kind, family.model_dir, {**family.adapters, **copies})
    split = _engine(moved, 2)
    try:
        refs = {n: split.register_lora(n, folder, "t") for n, folder in copies.items()}
        for folder in copies.values():
            shutil.rmtree(folder)
        for i, name in enumerate(names):
            prompt = [5 + i, 17, 33 + i, 9, 40 + 2 * i, 11][: 3 + i % 4]
            params = GREEDY
            if i == 1:
                params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                        prompt_logprobs=2, logprobs=2)  # fmt: skip
            split.add_request(f"r{i}", prompt, params, refs[name] if name else None)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        while split.has_unfinished:
            for out in split.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
                logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
    finally:
        split.close()
    assert tokens == expected["tokens"]
    for rid, values in expected["logprobs"].items():
        torch.testing.assert_close(logprobs[rid], values, atol=1e-4, rtol=1e-4)
