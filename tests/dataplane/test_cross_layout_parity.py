"""Cross-layout adapters served against HF + PEFT: a Phi-3 base (fused qkv_proj, gate_up_proj)
and a Llama holding the same weights split; PEFT adapters trained on the Llama serve on the
Phi-3 base (their q/k/v and gate/up fused, rank-exact) and give PEFT-on-Llama's logits and
greedy tokens, in mixed batches with a native Phi-3 adapter and base rows; PEFT Phi-3 adapters
serve on the Llama base (split) and give PEFT-on-Phi-3's. A fused rank over the pool's max is
refused at load, in words."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.limits import AdapterLimits
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora import LoRAPool, install_lora, load_lora
from loraplane.dataplane.lora.loader import LoadedAdapter
from loraplane.dataplane.models import load_model
from tests.dataplane.family_parity import (
    Served,
    build_base,
    check,
    engine_greedy_equals_hf,
    mixed_run,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Phi-3 without LongRoPE or partial rotary, so a Llama computes the same on its weights
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
SPLIT_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED_ALL = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
LLAMA_ADAPTERS: dict[str, dict[str, Any]] = {
    "llama-all": {"r": 8, "lora_alpha": 16, "target_modules": SPLIT_ALL},
    # k and gate left out (zero rows of the fused B); v at its own rank and so its own scale
    "llama-qv-up": {"r": 16, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"],
                    "rank_pattern": {"v_proj": 4}},
    "llama-attn": {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                 "o_proj"]},
}  # fmt: skip
PHI3_ADAPTERS: dict[str, dict[str, Any]] = {
    "phi3-all": {"r": 8, "lora_alpha": 16, "target_modules": FUSED_ALL},
    "phi3-rslora": {"r": 16, "lora_alpha": 16, "use_rslora": True,
                    "target_modules": ["qkv_proj", "gate_up_proj"]},
}  # fmt: skip


class _ByAdapter(torch.nn.Module):
    """HF + PEFT references, each adapter on the model it was trained on (base rows: the
    first), called as `hf_logits` calls a PeftModel."""

    def __init__(self, models: dict[str, torch.nn.Module], base: torch.nn.Module) -> None:
        super().__init__()
        self.by_name = models
        self.base = base

    def forward(self, ids: torch.Tensor, adapter_names: list[str]) -> Any:
        name = adapter_names[0]
        return self.by_name.get(name, self.base)(ids, adapter_names=adapter_names)


def _split_copy(phi3_dir: Path, out: Path) -> Path:
    """A Llama model holding the Phi-3 model's weights, q/k/v and gate/up split."""
    phi = transformers.AutoModelForCausalLM.from_pretrained(phi3_dir)
    c = phi.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    q_out = c.hidden_size
    kv_out = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    weights = {}
    for name, tensor in phi.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            for part, rows in zip(("q", "k", "v"), tensor.split([q_out, kv_out, kv_out]),
                                  strict=True):  # fmt: skip
                weights[f"{stem}{part}_proj.weight"] = rows
        elif name.endswith("gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            weights |= {stem + "gate_proj.weight": gate, stem + "up_proj.weight": up}
        else:
            weights[name] = tensor
    llama = transformers.LlamaForCausalLM(config)
    llama.load_state_dict(weights, strict=True)
    llama.save_pretrained(out)
    for item in phi3_dir.iterdir():  # the tokenizer's files
        if item.is_file() and not (out / item.name).exists():
            shutil.copy(item, out / item.name)
    return out


def _peft(model_dir: Path, adapters: dict[str, Path]) -> torch.nn.Module:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    reference: torch.nn.Module = model.eval()
    return reference


class Bases:
    """The two bases, every adapter, and HF + PEFT on each base with its own adapters."""

    def __init__(self, root: Path) -> None:
        from tests.factories import build_peft_adapter

        self.phi3_dir = build_base(root / "phi3", transformers.Phi3Config, seed=3, **SHAPE)
        self.llama_dir = _split_copy(self.phi3_dir, root / "llama")
        self.adapters: dict[str, Path] = {}
        for i, (name, cfg) in enumerate(LLAMA_ADAPTERS.items()):
            self.adapters[name] = build_peft_adapter(self.llama_dir, root / name, seed=80 + i,
                                                     **dict(cfg))  # fmt: skip
        for i, (name, cfg) in enumerate(PHI3_ADAPTERS.items()):
            self.adapters[name] = build_peft_adapter(self.phi3_dir, root / name, seed=90 + i,
                                                     **dict(cfg))  # fmt: skip
        self.on_llama = _peft(self.llama_dir, {n: self.adapters[n] for n in LLAMA_ADAPTERS})
        self.on_phi3 = _peft(self.phi3_dir, {n: self.adapters[n] for n in PHI3_ADAPTERS})
        self.phi3 = BaseModelSpec.from_dir(self.phi3_dir)
        self.llama = BaseModelSpec.from_dir(self.llama_dir)

    def reference(self, base: torch.nn.Module) -> _ByAdapter:
        models = {n: self.on_llama for n in LLAMA_ADAPTERS} | {
            n: self.on_phi3 for n in PHI3_ADAPTERS
        }
        return _ByAdapter(models, base)

    def serve(self, model_dir: Path, names: list[str]) -> Served:
        """The engine's decoder of `model_dir` with `names` in slots, beside the references."""
        spec = BaseModelSpec.from_dir(model_dir)
        model = load_model(model_dir, torch.float32, torch.device("cpu"))
        layout = dispatch.b_transposed(torch.float32, torch.device("cpu"))  # the engine's
        pool = LoRAPool(len(names), spec, torch.float32, "cpu", b_transposed=layout)
        install_lora(model, pool)
        slots = {}
        for slot, name in enumerate(names):
            assert pool.load(slot, load_lora(self.adapters[name], spec))
            slots[name] = slot
        base = self.on_phi3 if model_dir == self.phi3_dir else self.on_llama
        adapters = {n: self.adapters[n] for n in names}
        return Served(model, slots, self.reference(base), model_dir, adapters)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    return Bases(tmp_path_factory.mktemp("cross-layout"))


@pytest.fixture(scope="module")
def on_phi3(bases: Bases) -> Served:
    return bases.serve(bases.phi3_dir, ["llama-all", "llama-qv-up", "phi3-all", "llama-attn"])


@pytest.fixture(scope="module")
def on_llama(bases: Bases) -> Served:
    return bases.serve(bases.llama_dir, ["phi3-all", "phi3-rslora", "llama-all"])


def _logits(model: torch.nn.Module, ids: list[int], adapter: str | None) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), adapter_names=[adapter or "__base__"])
    logits: torch.Tensor = out.logits[0]
    return logits


def test_the_llama_copy_computes_what_the_phi3_base_computes(bases: Bases) -> None:
    """The premise of the comparisons: the same base model in both layouts; and each PEFT
    adapter changes its model's output (negative control)."""
    ids = [1, 7, 33, 90, 5, 250, 12]
    base_phi, base_llama = _logits(bases.on_phi3, ids, None), _logits(bases.on_llama, ids, None)
    torch.testing.assert_close(base_llama, base_phi, atol=1e-5, rtol=0)
    for name in LLAMA_ADAPTERS:
        assert not torch.allclose(_logits(bases.on_llama, ids, name), base_llama, atol=1e-3)
    for name in PHI3_ADAPTERS:
        assert not torch.allclose(_logits(bases.on_phi3, ids, name), base_phi, atol=1e-3)


def _delta(adapter: LoadedAdapter, layer: int, module: str) -> torch.Tensor:
    w = adapter.modules[(layer, module)]
    return w.scale * (w.b.double() @ w.a.double())


def test_loading_fuses_split_parts_rank_exact_on_the_phi3_base(bases: Bases) -> None:
    fused = load_lora(bases.adapters["llama-qv-up"], bases.phi3)
    split = load_lora(bases.adapters["llama-qv-up"], bases.llama)
    assert {m for _, m in fused.modules} == {"qkv_proj", "gate_up_proj"}
    qkv = fused.modules[(0, "qkv_proj")]
    assert qkv.rank == 16 + 4 and qkv.a.shape == (20, 64) and qkv.b.shape == (64 + 32 + 32, 20)
    assert fused.modules[(1, "gate_up_proj")].rank == 16
    assert fused.digest == split.digest  # the uploaded files' identity
    for layer in range(2):
        zeros = torch.zeros(32, 64, dtype=torch.float64)  # k: left out
        want = torch.cat([_delta(split, layer, "q_proj"), zeros, _delta(split, layer, "v_proj")])
        torch.testing.assert_close(_delta(fused, layer, "qkv_proj"), want, atol=1e-6, rtol=1e-6)
        want = torch.cat(
            [torch.zeros(96, 64, dtype=torch.float64), _delta(split, layer, "up_proj")]
        )
        torch.testing.assert_close(_delta(fused, layer, "gate_up_proj"), want, atol=1e-6, rtol=1e-6)


def test_loading_splits_fused_modules_on_the_llama_base(bases: Bases) -> None:
    split = load_lora(bases.adapters["phi3-all"], bases.llama)
    fused = load_lora(bases.adapters["phi3-all"], bases.phi3)
    assert {m for _, m in split.modules} == set(SPLIT_ALL)
    assert all(w.rank == 8 for w in split.modules.values())  # no rank grows when splitting
    for layer in range(2):
        parts = [_delta(split, layer, m) for m in ("q_proj", "k_proj", "v_proj")]
        torch.testing.assert_close(torch.cat(parts), _delta(fused, layer, "qkv_proj"))
        parts = [_delta(split, layer, m) for m in ("gate_proj", "up_proj")]
        torch.testing.assert_close(torch.cat(parts), _delta(fused, layer, "gate_up_proj"))


def test_a_bf16_adapter_is_converted_in_its_own_dtype_exactly(bases: Bases, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src = bases.adapters["llama-all"]
    out = tmp_path / "bf16"
    shutil.copytree(src, out)
    tensors = load_file(src / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
              out / "adapter_model.safetensors")  # fmt: skip
    fused = load_lora(out, bases.phi3)
    split = load_lora(out, bases.llama)
    qkv = fused.modules[(0, "qkv_proj")]
    assert qkv.a.dtype == torch.bfloat16 and qkv.rank == 24
    # equal scales: the slices are placed, not recomputed, so every value is the file's
    q, k, v = (split.modules[(0, m)] for m in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(qkv.a, torch.cat([q.a, k.a, v.a]))
    assert torch.equal(qkv.b[:64, :8], q.b) and torch.equal(qkv.b[64:96, 8:16], k.b)
    assert not qkv.b[:64, 8:].any() and not qkv.b[96:, :16].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_parts_scale_ratio_is_folded_into_its_b_rounded_as_torch_rounds(
    dtype: torch.dtype, bases: Bases, tmp_path: Path
) -> None:
    import json

    from safetensors.torch import save_file

    src = bases.adapters["llama-qv-up"]  # q rank 16, v rank 4
    out = tmp_path / "a"
    out.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"v_proj": 3}  # v's scale 3 / 4 against q's 8 / 16: ratio 1.5
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(src / "adapter_model.safetensors")
    save_file({k: t.to(dtype) for k, t in tensors.items()}, out / "adapter_model.safetensors")
    fused, split = load_lora(out, bases.phi3), load_lora(out, bases.llama)
    qkv, q, v = (
        fused.modules[(1, "qkv_proj")],
        split.modules[(1, "q_proj")],
        split.modules[(1, "v_proj")],
    )
    assert qkv.b.dtype == dtype and qkv.scale == q.scale == 0.5 and v.scale == 0.75
    assert torch.equal(qkv.b[:64, :16], q.b) and torch.equal(qkv.a[16:], v.a)
    assert torch.equal(qkv.b[96:, 16:], (v.b.float() * 1.5).to(dtype))
    assert not torch.equal(qkv.b[96:, 16:], v.b)  # negative control: the ratio is applied


def test_llama_adapters_on_the_phi3_base_mixed_batch_match_peft_on_llama(
    on_phi3: Served,
) -> None:
    names: list[str | None] = ["llama-all", None, "phi3-all", "llama-qv-up", "llama-attn",
                               "phi3-all", "llama-all"]  # fmt: skip
    runs = mixed_run(on_phi3, names, [9, 5, 7, 6, 4, 8, 7], seed=31, decode_steps=3)
    for seq, name in runs:
        check(seq, on_phi3.reference, name)


def test_phi3_adapters_on_the_llama_base_mixed_batch_match_peft_on_phi3(
    on_llama: Served,
) -> None:
    names: list[str | None] = ["phi3-rslora", "llama-all", None, "phi3-all", "phi3-rslora"]
    runs = mixed_run(on_llama, names, [10, 6, 5, 8, 7], seed=32, decode_steps=3)
    for seq, name in runs:
        check(seq, on_llama.reference, name)


def test_negative_control_unconverted_slices_differ_from_peft(bases: Bases) -> None:
    """Rows of the fused B out of place (two halves of q's swapped) are caught by the
    comparison the mixed-batch tests make."""
    served = bases.serve(bases.phi3_dir, ["llama-all"])
    table = served.model.lora_context.pool.modules[(0, "qkv_proj")]  # type: ignore[union-attr]
    b = table.lora_b[0]
    assert b is not None
    swapped = b.clone()
    swapped[:32], swapped[32:64] = b[32:64].clone(), b[:32].clone()
    b.copy_(swapped)
    runs = mixed_run(served, ["llama-all", "llama-all"], [9, 6], seed=33, decode_steps=1)
    for seq, name in runs:
        with pytest.raises(AssertionError):
            check(seq, served.reference, name)


def test_the_engine_generates_peft_greedy_tokens_across_layouts(bases: Bases) -> None:
    """The whole engine (scheduler, chunked prefill, prefix cache, LoRA manager and tiers)
    loading each adapter itself: both directions in mixed batches with base rows."""
    phi = bases.serve(bases.phi3_dir, ["llama-all", "phi3-all", "llama-qv-up"])
    engine_greedy_equals_hf(phi, ["llama-all", None, "phi3-all", "llama-qv-up"], [5, 7, 6, 4])
    llama = bases.serve(bases.llama_dir, ["phi3-rslora", "llama-attn", "phi3-all"])
    engine_greedy_equals_hf(llama, ["phi3-rslora", "llama-attn", None, "phi3-all"], [6, 4, 7, 5])


def test_a_fused_rank_over_the_engines_max_lora_rank_is_refused_at_load_in_words(
    bases: Bases,
) -> None:
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine

    engine = Engine(EngineConfig(model=str(bases.phi3_dir), device="cpu", dtype="float32",
                                 block_size=4, max_loras=2, num_kv_blocks=64,
                                 max_lora_rank=16))  # fmt: skip
    with pytest.raises(AdapterRejected) as info:
        engine.register_lora("too-wide", bases.adapters["llama-all"], "t")
    assert info.value.code == ReasonCode.RANK_TOO_LARGE
    message = info.value.message
    assert (
        "layer 0 qkv_proj" in message and "q_proj + k_proj + v_proj of ranks 8 + 8 + 8" in message
    )
    assert "rank 24" in message and "max_lora_rank 16" in message
    # the same rank-8 adapter on the split base, and the fused adapters, fit rank 16
    engine.register_lora("native", bases.adapters["phi3-all"], "t")
    with pytest.raises(AdapterRejected):  # and load_lora itself refuses it too
        load_lora(bases.adapters["llama-all"], bases.phi3, AdapterLimits(max_rank=23))
    assert load_lora(bases.adapters["llama-all"], bases.phi3, AdapterLimits(max_rank=24)).rank == 24


def test_on_a_mixture_of_experts_base_fused_names_split_beside_per_expert_modules(
    tmp_path: Path,
) -> None:
    """Qwen3-MoE: a Phi-3-style qkv_proj in every layer and gate_up_proj in the dense layer
    load as the pool's q/k/v and gate/up, beside an expert's own modules; the pool takes it."""
    from tests.adapters.crafting import lora_config, write_adapter
    from tests.adapters.test_cross_layout import QWEN3_MOE, _fused_tensors

    where = [(0, "self_attn", "qkv_proj"), (1, "self_attn", "qkv_proj"),
             (1, "mlp", "gate_up_proj"), (0, "mlp", "experts.2.down_proj")]  # fmt: skip
    config = lora_config(8, target_modules=["qkv_proj", "gate_up_proj", "down_proj"])
    src = write_adapter(tmp_path / "a", config, _fused_tensors(QWEN3_MOE, where))
    loaded = load_lora(src, QWEN3_MOE)
    assert set(loaded.modules) == {
        (0, "q_proj"), (0, "k_proj"), (0, "v_proj"), (1, "q_proj"), (1, "k_proj"),
        (1, "v_proj"), (1, "gate_proj"), (1, "up_proj"), (0, "experts.2.down_proj"),
    }  # fmt: skip
    tensors = load_file(src / "adapter_model.safetensors")
    stem = "base_model.model.model.layers.1.mlp.gate_up_proj"
    a, b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
    gate, up = loaded.modules[(1, "gate_proj")], loaded.modules[(1, "up_proj")]
    assert torch.equal(gate.a, a) and torch.equal(up.a, a)
    assert torch.equal(gate.b, b[:96]) and torch.equal(up.b, b[96:])
    pool = LoRAPool(1, QWEN3_MOE, torch.float32, "cpu")
    assert pool.load(0, pool.host_form(loaded))
    assert pool.modules[(1, "up_proj")].lora_a[0] is not None


def test_a_stored_version_loads_converted_on_every_path_and_the_memo_keeps_the_rank_check(
    bases: Bases, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catalog serving reads stored versions: the one-pass read and the remembered-layout
    read both convert; a remembered layout is remembered per limits, so a lower max rank
    validates (and refuses) again."""
    from loraplane.adapters.ingest import ingest
    from loraplane.adapters.store import LocalStore
    from loraplane.dataplane.lora import loader

    store = LocalStore(tmp_path / "store")
    limits = AdapterLimits(max_rank=24)
    version = ingest(bases.adapters["llama-all"], "acme", "split", bases.phi3, limits, store)
    stored = tmp_path / "store" / version.path
    expected = load_lora(bases.adapters["llama-all"], bases.phi3)
    first = load_lora(stored, bases.phi3, limits, version.digest)  # validated, then remembered
    from loraplane.adapters.validate import validate_adapter as real_validate

    def validate_again(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validated again")

    monkeypatch.setattr(loader, "validate_adapter", validate_again)
    again = load_lora(stored, bases.phi3, limits, version.digest)  # the remembered layout
    for got in (first, again):
        assert got.digest == version.digest and got.modules.keys() == expected.modules.keys()
        for key, w in got.modules.items():
            assert torch.equal(w.a, expected.modules[key].a)
            assert torch.equal(w.b, expected.modules[key].b)
    monkeypatch.setattr(loader, "validate_adapter", real_validate)
    with pytest.raises(AdapterRejected) as info:
        load_lora(stored, bases.phi3, AdapterLimits(max_rank=23), version.digest)
    assert info.value.code == ReasonCode.RANK_TOO_LARGE and "rank 24" in info.value.message
