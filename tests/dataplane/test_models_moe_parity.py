"""Mixtral and Qwen3-MoE + LoRA (attention and experts) + paged cache against HF transformers +
PEFT, fp32.

Tiny seeded models, 4 experts, top-2: Mixtral (router softmax over all experts, top-2
renormalised, fp32 routing weights) and Qwen3-MoE (norm_topk_prob, q/k head norms, head_dim 32
!= hidden / heads, one dense layer among the sparse ones). Adapters as PEFT trains them on
transformers 5: attention through target_modules, the packed experts through
target_parameters (split per expert at load); a 4.x-style per-expert adapter
(`experts.N.w1`...) is checked to serve as its packed twin does, and a dense layer's MLP
adapter as its merged weights. Batches mix adapters with base-model rows, prefill in chunks,
start from a cached prefix and decode greedily: every token is HF's argmax; the Engine end to
end gives HF+PEFT's greedy tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora import LoRABatch, LoRAPool, install_lora, load_lora
from loraplane.dataplane.lora.experts import expert_lora_torch, route_rows
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.models import load_model, read_config
from loraplane.dataplane.models.moe import MoEConfig, MoEForCausalLM
from tests.dataplane.conftest import Family, LoadedModel, PagedRunner, Seq

KINDS = ["mixtral", "qwen3_moe"]
ATOL = 1e-4  # the Llama parity tests' tolerance on fp32 logits
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "num_experts_per_tok": 2,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {**_SHAPE, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_local_experts": 4},
    "qwen3_moe": {**_SHAPE, "intermediate_size": 80, "moe_intermediate_size": 48,
                  "num_hidden_layers": 3, "num_experts": 4, "norm_topk_prob": True,
                  "mlp_only_layers": [1], "head_dim": 32},
}  # fmt: skip
# attention and a dense layer's MLP, as a pattern: PEFT turns a list naming gate_proj / up_proj
# on an MoE model into target_parameters on the packed experts instead
ALL_LINEARS = r".*\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
# name -> (LoraConfig kwargs): attention only, experts only, everything
ADAPTERS: dict[str, dict[str, Any]] = {
    "r8-attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "r16-experts": {"r": 16, "lora_alpha": 8, "target_parameters": EXPERTS},
    "r32-all": {"r": 32, "lora_alpha": 64, "target_parameters": EXPERTS},
}


def _build_model(out: Path, kind: str, seed: int) -> Path:
    import transformers

    from loraplane.demo.build import build_tokenizer

    vocab = build_tokenizer(out)
    config_cls = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}
    config = config_cls[kind](vocab_size=vocab, **CONFIGS[kind])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:  # a router of this scale spreads tokens over all four experts
                param.normal_(0.0, 0.5 if "gate.weight" in name else 0.1)
    model.save_pretrained(out)
    return out


def _build_adapter(model_dir: Path, out: Path, kind: str, seed: int, lora: dict[str, Any]) -> Path:
    import peft
    import transformers

    lora = dict(lora)
    targets = lora.pop("target_modules", None)
    if targets is None:  # experts only, or everything (attention, dense MLP, experts)
        targets = ALL_LINEARS if lora["r"] == 32 else []
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = peft.LoraConfig(init_lora_weights=False, target_modules=targets, **lora)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # random B large enough that each adapter moves the logits
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def moe_families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("moe-models")
    out = {}
    for i, kind in enumerate(KINDS):
        model_dir = _build_model(root / kind, kind, seed=31 + i)
        adapters = {
            name: _build_adapter(model_dir, root / f"{kind}-{name}", kind, 300 + j, cfg)
            for j, (name, cfg) in enumerate(ADAPTERS.items())
        }
        out[kind] = Family(kind, model_dir, adapters)
    return out


@pytest.fixture(scope="module")
def moe_reference(moe_families: dict[str, Family]) -> Callable[[str, str | None], Any]:
    """(kind, adapter) -> HF (adapter None) or a PeftModel with that adapter (fp32). One
    model per adapter: PEFT lets adapters of one model use target_parameters only when they
    all target the same parameters."""
    import peft
    import transformers

    cache: dict[tuple[str, str | None], Any] = {}

    def get(kind: str, adapter: str | None) -> Any:
        if (kind, adapter) not in cache:
            fam = moe_families[kind]
            model = transformers.AutoModelForCausalLM.from_pretrained(fam.model_dir)
            if adapter is not None:
                model = peft.PeftModel.from_pretrained(model, fam.adapters[adapter])
            cache[(kind, adapter)] = model.eval()
        return cache[(kind, adapter)]

    return get


def _engine(fam: Family, adapters: dict[str, Path] | None = None) -> LoadedModel:
    spec = BaseModelSpec.from_dir(fam.model_dir)
    model = load_model(fam.model_dir, torch.float32, torch.device("cpu"))
    adapters = fam.adapters if adapters is None else adapters
    layout = dispatch.b_transposed(torch.float32, torch.device("cpu"))  # the engine's
    pool = LoRAPool(len(adapters), spec, torch.float32, "cpu", b_transposed=layout)
    install_lora(model, pool)
    slots = {}
    for slot, (name, path) in enumerate(adapters.items()):
        assert pool.load(slot, load_lora(path, spec))
        slots[name] = slot
    return LoadedModel(model, pool, slots)


@pytest.fixture(scope="module")
def moe_models(moe_families: dict[str, Family]) -> Callable[[str], LoadedModel]:
    cache: dict[str, LoadedModel] = {}

    def get(kind: str) -> LoadedModel:
        if kind not in cache:
            cache[kind] = _engine(moe_families[kind])
        return cache[kind]

    return get


def _reference_logits(reference: Any, tokens: list[int]) -> torch.Tensor:
    """HF(+PEFT) logits [len(tokens), vocab] of one sequence."""
    with torch.no_grad():
        out = reference(torch.tensor([tokens]))
    logits: torch.Tensor = out.logits[0]
    return logits.float()


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(length)]


def _check(seq: Seq, prompt_len: int, reference: Any) -> None:
    """seq's logits equal the reference's, and each token after the prompt is its argmax."""
    expected = _reference_logits(reference, seq.tokens[: seq.num_computed])
    got = torch.stack(seq.logits)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    generated = seq.tokens[prompt_len:]
    greedy = expected.argmax(-1)[prompt_len - 1 :][: len(generated)]
    assert generated == greedy.tolist()


def test_config_parses_experts_routing_and_dense_layers(moe_families: dict[str, Family]) -> None:
    mixtral = read_config(moe_families["mixtral"].model_dir)
    qwen = read_config(moe_families["qwen3_moe"].model_dir)
    assert isinstance(mixtral, MoEConfig) and isinstance(qwen, MoEConfig)
    assert (mixtral.num_experts, mixtral.top_k, mixtral.moe_intermediate_size) == (4, 2, 96)
    assert mixtral.norm_topk_prob and mixtral.fp32_routing_weights and not mixtral.qk_head_norm
    assert mixtral.moe_layers == (0, 1) and mixtral.head_dim == 16
    assert (qwen.num_experts, qwen.top_k, qwen.moe_intermediate_size) == (4, 2, 48)
    assert qwen.moe_layers == (0, 2) and qwen.qk_head_norm and qwen.head_dim == 32
    assert qwen.norm_topk_prob and not qwen.fp32_routing_weights


@pytest.mark.parametrize("kind", KINDS)
def test_base_model_logits_and_greedy_tokens_match_hf(
    kind: str,
    moe_models: Callable[[str], LoadedModel],
    moe_reference: Callable[[str, str | None], Any],
) -> None:
    engine, rng = moe_models(kind), random.Random(f"base-{kind}")
    assert isinstance(engine.model, MoEForCausalLM)
    seqs = [Seq(_prompt(rng, n)) for n in (13, 6, 19)]
    runner = PagedRunner(engine.model, num_blocks=64, block_size=4, seed=3)
    runner.step([(s, len(s.tokens)) for s in seqs])
    lens = [len(s.tokens) for s in seqs]
    for _ in range(4):
        for s in seqs:
            s.tokens.append(int(s.logits[-1].argmax()))
        runner.step([(s, 1) for s in seqs])
    for seq, n in zip(seqs, lens, strict=True):
        _check(seq, n, moe_reference(kind, None))


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_adapters_on_attention_and_experts_chunked_prefill_match_hf_peft(
    kind: str,
    moe_families: dict[str, Family],
    moe_models: Callable[[str], LoadedModel],
    moe_reference: Callable[[str, str | None], Any],
) -> None:
    engine, rng = moe_models(kind), random.Random(kind)
    names: list[str | None] = [*moe_families[kind].adapters, None, "r16-experts", None]
    lengths = [9, 14, 7, 11, 20, 8]
    seqs = [
        Seq(_prompt(rng, n), engine.slots[a] if a else -1)
        for a, n in zip(names, lengths, strict=True)
    ]
    prompt_lens = list(lengths)
    runner = PagedRunner(engine.model, num_blocks=160, block_size=4, seed=5)
    long_seq = seqs[-2]
    # step 1: every prompt but one, and that one's first 8 tokens; step 2: its other 12 while
    # the others decode; then greedy decode steps
    runner.step([(s, len(s.tokens)) for s in seqs if s is not long_seq] + [(long_seq, 8)])
    for _ in range(5):
        for seq in seqs:
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(int(seq.logits[-1].argmax()))
        runner.step([(s, len(s.tokens) - s.num_computed) for s in seqs])
    for seq, name, n in zip(seqs, names, prompt_lens, strict=True):
        assert len(seq.tokens) - n >= 4
        _check(seq, n, moe_reference(kind, name))


@pytest.mark.parametrize("kind", KINDS)
def test_expert_adapters_change_the_logits_so_the_parity_checks_them(
    kind: str, moe_models: Callable[[str], LoadedModel]
) -> None:
    """Negative control: the experts-only adapter moves the logits away from the base model's
    (and an engine that ignored expert LoRA would fail the test above)."""
    engine, rng = moe_models(kind), random.Random(f"neg-{kind}")
    tokens = _prompt(rng, 12)
    base, adapted = Seq(list(tokens)), Seq(list(tokens), engine.slots["r16-experts"])
    PagedRunner(engine.model, num_blocks=16, block_size=4).step(
        [(base, len(tokens)), (adapted, len(tokens))]
    )
    diff = (torch.stack(adapted.logits) - torch.stack(base.logits)).abs().max()
    assert diff > 100 * ATOL


def _per_expert_twin(packed_dir: Path, out: Path, kind: str, experts: int, hidden: int) -> Path:
    """The packed-experts adapter rewritten as a 4.x one: each expert's own linears
    (`block_sparse_moe.experts.N.w1`... or `mlp.experts.N.gate_proj`...), same deltas."""
    block, (gate, up, down) = {
        "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
        "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    }[kind]
    config = json.loads((packed_dir / "adapter_config.json").read_text())
    tensors = load_file(str(packed_dir / "adapter_model.safetensors"))
    new: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if ".experts." not in key:
            new[key] = t
            continue
        if ".lora_B." in key:
            continue
        stem = key.split(".experts.")[0].replace(".mlp", f".{block}")
        b = tensors[key.replace("lora_A", "lora_B")]
        rank = t.shape[0] // experts
        # PEFT nests the two wrapped parameters (`experts.base_layer.lora_A` ...): A's fan-in
        # tells them apart, the hidden size for gate_up_proj
        parts = (gate, up) if t.shape[1] == hidden else (down,)
        for e in range(experts):
            a_e, b_e = t[e * rank : (e + 1) * rank], b[:, e::experts]
            for i, name in enumerate(parts):
                rows = b_e.shape[0] // len(parts)
                prefix = f"{stem}.experts.{e}.{name}"
                new[f"{prefix}.lora_A.weight"] = a_e.clone()
                new[f"{prefix}.lora_B.weight"] = b_e[i * rows : (i + 1) * rows].contiguous()
    config["target_parameters"] = None
    config["target_modules"] = sorted({*(config["target_modules"] or []), gate, up, down})
    for key in ("rank_pattern", "alpha_pattern"):  # PEFT's patterns for the packed gate_up_proj
        patterns = {}
        for k, v in (config.get(key) or {}).items():
            patterns.update({gate: v, up: v} if "gate_up_proj" in k else {k: v})
        config[key] = patterns
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(new, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_per_expert_adapter_serves_as_its_packed_twin(
    kind: str,
    moe_families: dict[str, Family],
    moe_models: Callable[[str], LoadedModel],
    tmp_path: Path,
) -> None:
    fam = moe_families[kind]
    twin = _per_expert_twin(fam.adapters["r32-all"], tmp_path / "twin", kind, 4, 64)
    spec = BaseModelSpec.from_dir(fam.model_dir)
    loaded = load_lora(twin, spec)
    assert any(".0." in m for _, m in loaded.modules)  # read per expert, not packed
    engine = moe_models(kind)
    other = _engine(fam, {"twin": twin})
    rng = random.Random(f"twin-{kind}")
    tokens = _prompt(rng, 15)
    a, b = Seq(list(tokens), engine.slots["r32-all"]), Seq(list(tokens), other.slots["twin"])
    PagedRunner(engine.model, num_blocks=8, block_size=4).step([(a, len(tokens))])
    PagedRunner(other.model, num_blocks=8, block_size=4).step([(b, len(tokens))])
    torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=1e-5, rtol=0)


def test_routed_rows_group_by_expert_then_slot_and_drop_base_rows() -> None:
    experts = torch.tensor([[1, 0], [0, 2], [1, 2], [2, 0]])  # [T=4, k=2]
    batch = LoRABatch.from_token_slots([1, -1, 0, 1])
    rows = route_rows(experts, batch, num_experts=4)
    assert rows.expert_bounds == (0, 3, 5, 8, 8) and rows.experts_hit == (0, 1, 2)
    # expert 0: tokens 0 (slot 1), 1 (base), 3 (slot 1) -> base first, then slot 1
    assert rows.tokens[:3].tolist() == [1, 0, 3]
    assert rows.segments(0) == ((1, 1, 3),)
    assert rows.tokens[3:5].tolist() == [2, 0]  # slot 0 before slot 1
    assert rows.segments(1) == ((0, 0, 1), (1, 1, 2))
    assert rows.segments(2) == ((0, 1, 2), (1, 2, 3))  # token 1 base, token 2 slot 0, 3 slot 1
    flat = experts.reshape(-1)
    assert (flat[rows.pairs] == torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_lora_reference_is_each_slots_delta_and_nothing_for_others(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(0)
    table = ModuleSlots(3, torch.device("cpu"))
    ranks = {0: 4, 2: 16}  # slot 1 does not adapt this expert's linear
    for slot, r in ranks.items():
        table.lora_a[slot] = torch.randn(r, 24, dtype=dtype)
        table.lora_b[slot] = torch.randn(40, r, dtype=dtype)
        table.scales[slot] = 0.5 * (slot + 1)
    x = torch.randn(9, 24, dtype=dtype)
    y0 = torch.randn(9, 40, dtype=dtype)
    y = y0.clone()
    segments = [(0, 1, 4), (1, 4, 6), (2, 6, 9)]  # row 0: a base row
    expert_lora_torch(y, x, segments, table)
    expected = y0.float().clone()
    for slot, start, end in segments:
        a, b = table.lora_a[slot], table.lora_b[slot]
        if a is not None and b is not None:
            expected[start:end] += float(table.scales[slot]) * (
                x[start:end].float() @ a.float().t() @ b.float().t()
            )
    tol = 1e-4 if dtype == torch.float32 else 0.5
    torch.testing.assert_close(y.float(), expected, atol=tol, rtol=0 if tol < 1e-3 else 0.02)
    assert torch.equal(y[:1], y0[:1]) and torch.equal(y[4:6], y0[4:6])


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_serves_a_moe_base_with_expert_adapters_as_hf_peft(
    kind: str,
    moe_families: dict[str, Family],
    moe_reference: Callable[[str, str | None], Any],
) -> None:
    """End to end through Engine (registration, cache tiers, the LoRA pool, continuous
    batching with a small token budget): greedy tokens equal HF+PEFT's greedy loop."""
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sampling import SamplingParams

    fam = moe_families[kind]
    engine = Engine(
        EngineConfig(
            model=str(fam.model_dir), device="cpu", dtype="float32", block_size=4,
            max_loras=len(fam.adapters), num_kv_blocks=256, max_num_batched_tokens=24,
        )
    )  # fmt: skip
    refs = {name: engine.register_lora(name, path, "t") for name, path in fam.adapters.items()}
    names: list[str | None] = [*fam.adapters, None, "r16-experts"]
    rng = random.Random(f"engine-{kind}")
    batch = [_prompt(rng, rng.randint(5, 18)) for _ in names]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = engine.generate(batch, params, [refs[n] if n else None for n in names])
    for prompt, name, out in zip(batch, names, outs, strict=True):
        tokens = list(prompt)
        for _ in range(8):
            logits = _reference_logits(moe_reference(kind, name), tokens)
            tokens.append(int(logits[-1].argmax()))
        assert out.token_ids == tokens[len(prompt) :], name


def test_a_qwen3_moe_dense_layers_mlp_adapter_applies_as_its_merged_weights(
    moe_families: dict[str, Family], tmp_path: Path
) -> None:
    """LoRA on the MLP of a dense layer (mlp_only_layers) of a Qwen3-MoE base: the engine's
    logits equal HF's with the deltas merged into that MLP's weights (PEFT on transformers 5
    writes such an adapter's gate/up targets as packed experts instead, so it is written here
    in the 4.x layout PEFT reads)."""
    import transformers

    fam = moe_families["qwen3_moe"]
    torch.manual_seed(9)
    rank, alpha = 8, 16
    tensors, deltas = {}, {}
    for name, (fan_in, fan_out) in {"gate_proj": (64, 80), "down_proj": (80, 64)}.items():
        a, b = torch.randn(rank, fan_in) * 0.2, torch.randn(fan_out, rank) * 0.2
        stem = f"base_model.model.model.layers.1.mlp.{name}"
        tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a, b
        deltas[name] = (alpha / rank) * b @ a
    out = tmp_path / "dense"
    out.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
              "target_modules": ["gate_proj", "down_proj"], "task_type": "CAUSAL_LM"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    engine = _engine(fam, {"dense": out})
    assert {m for _, m in load_lora(out, BaseModelSpec.from_dir(fam.model_dir)).modules} == {
        "gate_proj",
        "down_proj",
    }
    merged = transformers.AutoModelForCausalLM.from_pretrained(fam.model_dir).eval()
    with torch.no_grad():
        for name, delta in deltas.items():
            getattr(merged.model.layers[1].mlp, name).weight += delta
    tokens = _prompt(random.Random("dense"), 14)
    seq, base = Seq(list(tokens), engine.slots["dense"]), Seq(list(tokens))
    PagedRunner(engine.model, num_blocks=16, block_size=4).step(
        [(seq, len(tokens)), (base, len(tokens))]
    )
    expected = _reference_logits(merged, tokens)
    torch.testing.assert_close(torch.stack(seq.logits), expected, atol=ATOL, rtol=0)
    assert (torch.stack(base.logits) - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize("kind", KINDS)
def test_a_cached_prefix_is_read_as_hf_computes_it(
    kind: str,
    moe_models: Callable[[str], LoadedModel],
    moe_reference: Callable[[str, str | None], Any],
) -> None:
    """Prefix caching: sequences that start from another's cached blocks (an all-modules
    adapter) decode as HF+PEFT does over the whole sequence."""
    engine, rng = moe_models(kind), random.Random(f"prefix-{kind}")
    slot = engine.slots["r32-all"]
    prefix = _prompt(rng, 8)  # two blocks of 4
    writer = Seq([*prefix, *_prompt(rng, 5)], slot)
    runner = PagedRunner(engine.model, num_blocks=48, block_size=4, seed=7)
    runner.step([(writer, len(writer.tokens))])
    tail = Seq([*prefix, *_prompt(rng, 6)], slot)
    runner.share_prefix(writer, tail, 2)
    runner.step([(tail, 6)])
    prompt_len = len(tail.tokens)
    for _ in range(3):
        tail.tokens.append(int(tail.logits[-1].argmax()))
        runner.step([(tail, 1)])
    expected = _reference_logits(moe_reference(kind, "r32-all"), tail.tokens[: tail.num_computed])
    torch.testing.assert_close(torch.stack(tail.logits), expected[8:], atol=ATOL, rtol=0)
    greedy = expected.argmax(-1)[prompt_len - 1 :][:3]
    assert tail.tokens[prompt_len:] == greedy.tolist()
