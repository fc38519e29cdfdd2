"""Fused <-> split LoRA packing is exact: for random inputs the fused module's update equals
the concatenation of the split modules' (any ranks and scales, parts left out, shared A's),
ranks survive a round trip, and a PEFT adapter of a tiny Phi-3 converted to the split layout
computes, on the same weights in a Llama-layout model, what it computes on Phi-3 (and back)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.packing import (
    LoRAFactors,
    adapter_factors,
    fuse,
    pack_experts,
    split,
    to_fused,
    to_split,
    unpack_experts,
)
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import validate_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HIDDEN, Q_OUT, KV_OUT = 24, 32, 16
SIZES = (Q_OUT, KV_OUT, KV_OUT)


def _factors(rng: np.random.Generator, rank: int, out: int, scale: float) -> LoRAFactors:
    return LoRAFactors(
        rng.standard_normal((rank, HIDDEN)).astype(np.float64),
        rng.standard_normal((out, rank)).astype(np.float64),
        scale,
    )


def _apply(f: LoRAFactors, x: torch.Tensor) -> torch.Tensor:
    """The LoRA side path as the engine computes it: scale * B (A x), x [tokens, in]."""
    a, b = torch.from_numpy(f.a.astype(np.float64)), torch.from_numpy(f.b.astype(np.float64))
    return f.scale * (x.double() @ a.T) @ b.T


@pytest.mark.parametrize(
    ("ranks", "scales"),
    [((8, 8, 8), (2.0, 2.0, 2.0)), ((4, 16, 8), (0.5, 2.0, 3.0)), ((8, None, 2), (1.0, 1.0, 4.0))],
)
def test_fused_update_is_the_concatenation_of_the_split_updates_for_every_input(
    ranks: tuple[int | None, ...], scales: tuple[float, ...]
) -> None:
    rng = np.random.default_rng(0)
    parts = [
        None if r is None else _factors(rng, r, rows, s)
        for r, rows, s in zip(ranks, SIZES, scales, strict=True)
    ]
    fused = fuse(parts, SIZES)
    assert fused.rank == sum(r for r in ranks if r is not None)  # rank-exact, no padding
    x = torch.randn(5, HIDDEN, dtype=torch.float64)
    expected = torch.cat([
        torch.zeros(5, rows, dtype=torch.float64) if p is None else _apply(p, x)
        for p, rows in zip(parts, SIZES, strict=True)
    ], dim=1)  # fmt: skip
    torch.testing.assert_close(_apply(fused, x), expected)


def test_negative_control_b_stacked_without_block_diagonal_is_not_exact() -> None:
    """The block-diagonal B is what makes the fused update exact: stacking the B's by rows
    over stacked A's (the shared-A rule applied to distinct A's) is wrong."""
    rng = np.random.default_rng(1)
    parts = [_factors(rng, 4, rows, 1.0) for rows in SIZES]
    a = np.concatenate([p.a for p in parts])
    b = np.concatenate([np.tile(p.b, (1, 3)) for p in parts])
    x = torch.randn(3, HIDDEN, dtype=torch.float64)
    wrong = _apply(LoRAFactors(a, b, 1.0), x)
    right = _apply(fuse(parts, SIZES), x)
    assert not torch.allclose(wrong, right)


def test_shared_a_fuses_at_the_parts_rank_and_split_keeps_it() -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, HIDDEN))
    parts = [LoRAFactors(a, rng.standard_normal((rows, 8)), s)
             for rows, s in zip(SIZES, (2.0, 1.0, 0.5), strict=True)]  # fmt: skip
    fused = fuse(parts, SIZES)
    assert fused.rank == 8
    np.testing.assert_allclose(fused.delta(), np.concatenate([p.delta() for p in parts]))
    back = split(fused, SIZES)
    assert [p.rank for p in back if p is not None] == [8, 8, 8]
    for got, want in zip(back, parts, strict=True):
        assert got is not None
        np.testing.assert_allclose(got.delta(), want.delta())


def test_split_of_a_fused_module_gives_each_part_its_rows_and_round_trips_ranks() -> None:
    rng = np.random.default_rng(3)
    parts = [_factors(rng, r, rows, s)
             for r, rows, s in zip((4, 16, 8), SIZES, (1.0, 2.0, 0.25), strict=True)]  # fmt: skip
    back = split(fuse(parts, SIZES), SIZES)
    assert [p.rank for p in back if p is not None] == [4, 16, 8]
    x = torch.randn(4, HIDDEN, dtype=torch.float64)
    for got, want in zip(back, parts, strict=True):
        assert got is not None
        torch.testing.assert_close(_apply(got, x), _apply(want, x))
    # a dense fused B (a model trained fused): every part keeps the full rank and shares A
    dense = _factors(rng, 8, sum(SIZES), 2.0)
    pieces = split(dense, SIZES)
    assert all(p is not None and p.rank == 8 for p in pieces)
    joined = torch.cat([_apply(p, x) for p in pieces if p is not None], dim=1)
    torch.testing.assert_close(joined, _apply(dense, x))
    # a part with no update is left out
    only_q = fuse([parts[0], None, None], SIZES)
    assert [p is None for p in split(only_q, SIZES)] == [False, True, True]


def test_mismatched_shapes_are_refused() -> None:
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="output rows"):
        fuse([_factors(rng, 4, 8, 1.0), None, None], SIZES)
    with pytest.raises(ValueError, match="do not add up"):
        split(_factors(rng, 4, 60, 1.0), SIZES)
    with pytest.raises(ValueError, match="nothing to fuse"):
        fuse([None, None, None], SIZES)


# --- end to end: PEFT on a tiny Phi-3 and on the same weights in the Llama layout ------------

PHI3 = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "pad_token_id": 0}  # fmt: skip


def _phi3_and_llama(root: Path) -> tuple[Path, Path]:
    """A seeded tiny Phi-3 and a Llama holding the same weights, q/k/v and gate/up split."""
    torch.manual_seed(0)
    phi = transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3))
    phi.save_pretrained(root / "phi3")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in PHI3.items() if k != "pad_token_id"}, rms_norm_eps=1e-5
    ))  # fmt: skip
    spec = BaseModelSpec.from_dir(root / "phi3")
    weights = {}
    for name, tensor in phi.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split(
                [spec.module_shape(m)[1] for m in ("q_proj", "k_proj", "v_proj")]
            )
            weights |= {stem + "q_proj.weight": q, stem + "k_proj.weight": k,
                        stem + "v_proj.weight": v}  # fmt: skip
        elif name.endswith("gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            weights |= {stem + "gate_proj.weight": gate, stem + "up_proj.weight": up}
        else:
            weights[name] = tensor
    llama.load_state_dict(weights, strict=True)
    llama.save_pretrained(root / "llama")
    return root / "phi3", root / "llama"


def _read_peft(adapter_dir: Path, base: BaseModelSpec) -> dict[str, LoRAFactors]:
    with open_adapter_source(adapter_dir, AdapterLimits()) as files:
        adapter = validate_adapter(files, base, AdapterLimits())
    out = adapter_factors(adapter)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    for m in adapter.modules:  # the same numbers as the file holds
        np.testing.assert_array_equal(out[m.key].a, tensors[m.a_name])
    adapter.close()
    return out


def _write_peft(modules: dict[str, LoRAFactors], out: Path) -> Path:
    """A PEFT adapter of these modules: each one's rank and scale by exact-path patterns."""
    out.mkdir(parents=True)
    tensors = {}
    for path, f in modules.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = np.ascontiguousarray(f.a, np.float32)
        tensors[f"base_model.model.{path}.lora_B.weight"] = np.ascontiguousarray(f.b, np.float32)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1,
        "target_modules": sorted({p.rsplit(".", 1)[1] for p in modules}),
        "rank_pattern": {p: f.rank for p, f in modules.items()},
        "alpha_pattern": {p: f.scale * f.rank for p, f in modules.items()},
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _logits(model_dir: Path, adapter_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        model = peft.PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        return model(ids).logits


def _peft_adapter(model_dir: Path, out: Path, targets: list[str], seed: int) -> Path:
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                             target_modules=targets, rank_pattern={"o_proj": 4})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(base, config).save_pretrained(out)
    return out


def test_phi3_peft_adapter_split_computes_the_same_on_the_llama_layout(tmp_path: Path) -> None:
    phi_dir, llama_dir = _phi3_and_llama(tmp_path)
    phi_spec, llama_spec = BaseModelSpec.from_dir(phi_dir), BaseModelSpec.from_dir(llama_dir)
    fused_dir = _peft_adapter(
        phi_dir, tmp_path / "fused", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 1
    )
    modules = to_split(_read_peft(fused_dir, phi_spec), phi_spec)
    assert {p.rsplit(".", 1)[1] for p in modules} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    # module by module, on the Llama layout's shapes: each part is its rows of the fused update
    x = torch.randn(3, 64, dtype=torch.float32)
    fused = _read_peft(fused_dir, phi_spec)
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn."
        whole = _apply(fused[attn + "qkv_proj"], x.double())
        parts = [_apply(modules[attn + m], x.double()) for m in ("q_proj", "k_proj", "v_proj")]
        assert [p.shape[1] for p in parts] == [llama_spec.module_shape(m)[1]
                                               for m in ("q_proj", "k_proj", "v_proj")]  # fmt: skip
        torch.testing.assert_close(torch.cat(parts, dim=1), whole)
    split_dir = _write_peft(modules, tmp_path / "split")
    with open_adapter_source(split_dir, AdapterLimits()) as files:
        validate_adapter(files, llama_spec, AdapterLimits()).close()  # a valid Llama adapter
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 17]])
    on_phi = _logits(phi_dir, fused_dir, ids)
    on_llama = _logits(llama_dir, split_dir, ids)
    torch.testing.assert_close(on_llama, on_phi, rtol=1e-4, atol=1e-5)
    # negative control: the base models alone differ from the adapted ones
    base_only = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)(ids).logits
    assert not torch.allclose(base_only, on_phi, atol=1e-3)


def test_llama_layout_adapter_fused_computes_the_same_on_phi3(tmp_path: Path) -> None:
    phi_dir, llama_dir = _phi3_and_llama(tmp_path)
    phi_spec, llama_spec = BaseModelSpec.from_dir(phi_dir), BaseModelSpec.from_dir(llama_dir)
    split_dir = _peft_adapter(llama_dir, tmp_path / "split", ["q_proj", "v_proj", "up_proj",
                                                             "gate_proj", "o_proj"], 2)  # fmt: skip
    modules = to_fused(_read_peft(split_dir, llama_spec), phi_spec)
    qkv = modules["model.layers.0.self_attn.qkv_proj"]
    assert qkv.rank == 8 + 8  # q and v, each rank 8; k left out adds nothing
    fused_dir = _write_peft(modules, tmp_path / "fused")
    ids = torch.tensor([[3, 8, 1, 44, 90, 2]])
    torch.testing.assert_close(
        _logits(phi_dir, fused_dir, ids), _logits(llama_dir, split_dir, ids), rtol=1e-4, atol=1e-5
    )


# --- experts: one by one (4.x) <-> packed (transformers 5, PEFT target_parameters) ----------


def test_packed_experts_hold_each_experts_update_and_unpack_exactly() -> None:
    rng = np.random.default_rng(5)
    experts = [_factors(rng, 4, 20, s) for s in (2.0, 2.0, 1.0)]
    packed = pack_experts(experts)
    assert (packed.a.shape, packed.b.shape) == ((12, HIDDEN), (20, 12))
    # PEFT's ParamWrapper update: delta[e] = scale * sum_j B[:, j * E + e] A[e * r + j]
    a = packed.a.reshape(3, 4, HIDDEN)
    b = packed.b.reshape(20, 4, 3)
    delta = packed.scale * np.einsum("ore,eri->eoi", b, a)
    for e, want in enumerate(experts):
        np.testing.assert_allclose(delta[e], want.delta())
    for got, want in zip(unpack_experts(packed, 3), experts, strict=True):
        np.testing.assert_allclose(got.delta(), want.delta())
    with pytest.raises(ValueError, match="ranks differ"):
        pack_experts([_factors(rng, 4, 20, 1.0), _factors(rng, 8, 20, 1.0)])


def test_per_expert_adapter_packs_to_the_factors_peft_itself_loads(tmp_path: Path) -> None:
    """A 4.x Mixtral adapter (experts.N.w1/w3/w2) packed by us equals, tensor for tensor,
    what PEFT's transformers-5 conversion makes of it on a packed-experts Mixtral."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    rng = np.random.default_rng(6)
    shapes = {"w1": (32, 16), "w3": (32, 16), "w2": (16, 32)}
    per = {(e, w): LoRAFactors(rng.standard_normal((4, i)).astype(np.float32),
                               rng.standard_normal((o, 4)).astype(np.float32), 2.0)
           for e in range(4) for w, (i, o) in shapes.items()}  # fmt: skip
    stem = "base_model.model.model.layers.0.block_sparse_moe.experts"
    tensors = {}
    for (e, w), f in per.items():
        tensors[f"{stem}.{e}.{w}.lora_A.weight"] = f.a
        tensors[f"{stem}.{e}.{w}.lora_B.weight"] = f.b
    src = tmp_path / "a"
    src.mkdir()
    save_file(tensors, src / "adapter_model.safetensors")
    (src / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["w1", "w2", "w3"]}
    ))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(model, src)
    wrappers = {m.parameter_name: m for _, m in loaded.named_modules()
                if getattr(m, "parameter_name", None)}  # fmt: skip
    gate_up = pack_experts([fuse([per[e, "w1"], per[e, "w3"]], (16, 16)) for e in range(4)])
    down = pack_experts([per[e, "w2"] for e in range(4)])
    for name, ours in (("gate_up_proj", gate_up), ("down_proj", down)):
        theirs = wrappers[name]
        np.testing.assert_array_equal(theirs.lora_A["default"].weight.detach().numpy(), ours.a)
        np.testing.assert_array_equal(theirs.lora_B["default"].weight.detach().numpy(), ours.b)
        assert theirs.scaling["default"] == pytest.approx(ours.scale)


def test_adapter_factors_read_bf16_and_f16_files_as_floats(tmp_path: Path) -> None:
    spec = BaseModelSpec("t", "llama", 1, 8, 16, 2, 2, 4)
    rng = np.random.default_rng(7)
    a = torch.from_numpy(rng.standard_normal((2, 8)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal((8, 2)).astype(np.float32))
    for dtype in (torch.bfloat16, torch.float16):
        out = tmp_path / str(dtype)
        out.mkdir()
        stem = "base_model.model.model.layers.0.self_attn.q_proj"
        save_torch({stem + ".lora_A.weight": a.to(dtype), stem + ".lora_B.weight": b.to(dtype)},
                   out / "adapter_model.safetensors")  # fmt: skip
        (out / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
        ))  # fmt: skip
        with open_adapter_source(out, AdapterLimits()) as files:
            adapter = validate_adapter(files, spec, AdapterLimits())
        got = adapter_factors(adapter)["model.layers.0.self_attn.q_proj"]
        adapter.close()
        np.testing.assert_array_equal(got.a, a.to(dtype).float().numpy())
        np.testing.assert_array_equal(got.b, b.to(dtype).float().numpy())
        assert got.scale == 2.0
