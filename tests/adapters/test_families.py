"""Every served family's adaptable modules and shapes, from config.json alone: real PEFT
adapters on tiny seeded HF models of each family are accepted with PEFT's ranks and scales and
stable digests; shape mismatches and what stays refused (embeddings, the head, the MoE router,
modules_to_save, a vision tower) are refused by name with the existing reason codes."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from loraplane.adapters.base_model import BaseModelError, BaseModelSpec
from loraplane.adapters.canonical import write_canonical
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import ValidatedAdapter, validate_adapter
from loraplane.planner.shapes import ModelShape

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
SMALL = {"vocab_size": 128, "max_position_embeddings": 64, "num_hidden_layers": 2}
TEXT = {**SMALL, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def _gemma3_config() -> Any:
    text = {**TEXT, "head_dim": 32, "intermediate_size": 96}
    vision = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 32, "image_size": 16, "patch_size": 8}  # fmt: skip
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


# name -> (config factory, the PEFT LoraConfig arguments of the adapter the test builds)
FAMILIES: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    # head_dim 32, not hidden / heads = 16
    "qwen3": (lambda: transformers.Qwen3Config(**TEXT, head_dim=32, intermediate_size=96),
              {"target_modules": ATTN + MLP}),
    "gemma2": (lambda: transformers.Gemma2Config(**TEXT, head_dim=32, intermediate_size=96),
               {"target_modules": "all-linear"}),
    "gemma3_text": (lambda: transformers.Gemma3TextConfig(**TEXT, head_dim=32,
                                                          intermediate_size=96),
                    {"target_modules": ATTN + MLP, "rank_pattern": {"o_proj": 4}}),
    # the text stack under model.language_model; the vision tower left out by a regex
    "gemma3": (_gemma3_config,
               {"target_modules": ATTN + MLP, "exclude_modules": ".*vision_tower.*"}),
    "phi3": (lambda: transformers.Phi3Config(**TEXT, intermediate_size=96, pad_token_id=0),
             {"target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}),
    # transformers 5 packs the experts; PEFT adapts them through target_parameters
    "mixtral": (lambda: transformers.MixtralConfig(**TEXT, intermediate_size=32,
                                                   num_local_experts=4),
                {"target_modules": ATTN,
                 "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}),
    # layer 1 dense; the 4.x expert names, which PEFT converts to the packed parameters
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**TEXT, head_dim=24, intermediate_size=96,
                                                      moe_intermediate_size=32, num_experts=4,
                                                      num_experts_per_tok=2,
                                                      mlp_only_layers=[1]),
                  {"target_modules": ATTN + MLP}),
}  # fmt: skip


def _build(root: Path, family: str, seed: int = 0, **override: Any) -> tuple[Path, Path]:
    """A tiny seeded model of the family and a PEFT adapter of it (random A and B)."""
    make, lora = FAMILIES[family]
    model_dir, adapter_dir = root / f"{family}-model", root / f"{family}-adapter-{seed}"
    torch.manual_seed(seed)
    config = make()
    if family == "gemma3":
        model = transformers.Gemma3ForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    if not model_dir.exists():
        model.save_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(
            model,
            peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **{**lora, **override}),
        )
    wrapped.save_pretrained(adapter_dir)
    return model_dir, adapter_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("families")
    return {family: _build(root, family) for family in FAMILIES}


def _validate(adapter_dir: Path, base: BaseModelSpec | None) -> ValidatedAdapter:
    with open_adapter_source(adapter_dir, AdapterLimits()) as files:
        adapter = validate_adapter(files, base, AdapterLimits())
    return adapter


def _peft_modules(model_dir: Path, adapter_dir: Path, family: str) -> dict[str, tuple[int, float]]:
    """What PEFT itself attaches: module (or packed parameter) key -> (rank per expert, scale)."""
    cls = (transformers.Gemma3ForConditionalGeneration if family == "gemma3"
           else transformers.AutoModelForCausalLM)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(cls.from_pretrained(model_dir), adapter_dir)
    out = {}
    for key, module in model.base_model.model.named_modules():
        if not (hasattr(module, "lora_A") and "default" in module.lora_A):
            continue
        name = key.replace(".base_layer", "")
        experts = getattr(module, "num_experts", 1)
        if getattr(module, "parameter_name", None):
            name += "." + module.parameter_name
        out[name] = (module.lora_A["default"].weight.shape[0] // experts,
                     module.scaling["default"])  # fmt: skip
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_adapter_of_each_family_is_accepted_with_pefts_modules_ranks_and_scales(
    family: str, built: dict[str, tuple[Path, Path]]
) -> None:
    model_dir, adapter_dir = built[family]
    base = BaseModelSpec.from_dir(model_dir)
    assert base.model_type == family
    adapter = _validate(adapter_dir, base)
    ours = {m.key: (m.rank, m.scale) for m in adapter.modules}
    adapter.close()
    theirs = _peft_modules(model_dir, adapter_dir, family)
    assert theirs, "PEFT attached nothing"
    assert ours.keys() == theirs.keys()
    for key, (rank, scale) in theirs.items():
        assert ours[key][0] == rank, key
        assert ours[key][1] == pytest.approx(scale), key


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_shapes_from_config_match_the_hf_model(
    family: str, built: dict[str, tuple[Path, Path]]
) -> None:
    """Every linear layer (and packed expert parameter) of the HF model has the shape
    BaseModelSpec gives it, read from config.json alone."""
    model_dir, _ = built[family]
    base = BaseModelSpec.from_dir(model_dir)
    cls = (transformers.Gemma3ForConditionalGeneration if family == "gemma3"
           else transformers.AutoModelForCausalLM)  # fmt: skip
    model = cls.from_pretrained(model_dir)
    prefix = base.layer_prefix + "."
    checked = 0
    for name, param in model.named_parameters():
        if not name.startswith(prefix) or "norm" in name or ".gate." in name:
            continue
        layer_s, block, *rest = name[len(prefix) :].split(".")
        layer = int(layer_s)
        if rest[-1] == "weight":  # a linear layer: weight [out, in]
            module = ".".join(rest[:-1])
            assert base.has_module(layer, module), name
            assert base.module_shape(module) == (param.shape[1], param.shape[0]), name
        else:  # a packed experts parameter [experts, out, in]
            module = ".".join(rest)
            assert base.has_module(layer, module), name
            assert param.shape[0] == base.num_experts, name
            assert base.module_shape(module) == (param.shape[2], param.shape[1]), name
        assert base.module_block(module) == block or module.startswith("experts."), name
        checked += 1
    assert checked >= 2 * 4


def test_digest_of_a_family_adapter_is_stable_and_content_sensitive(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    for family in ("phi3", "mixtral", "gemma3"):
        model_dir, adapter_dir = built[family]
        base = BaseModelSpec.from_dir(model_dir)
        digests = []
        for i, src in enumerate((adapter_dir, adapter_dir)):
            copy = tmp_path / f"{family}-{i}"
            shutil.copytree(src, copy)
            adapter = _validate(copy, base)
            digests.append(write_canonical(adapter, tmp_path / f"{family}-out-{i}").digest)
            adapter.close()
        assert digests[0] == digests[1], family
        _, other = _build(tmp_path, family, seed=1)
        adapter = _validate(other, base)
        assert write_canonical(adapter, tmp_path / f"{family}-other").digest != digests[0]
        adapter.close()


def test_stored_packed_expert_adapter_loads_back_into_peft_unchanged(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    model_dir, adapter_dir = built["mixtral"]
    adapter = _validate(adapter_dir, BaseModelSpec.from_dir(model_dir))
    out = tmp_path / "stored"
    write_canonical(adapter, out)
    adapter.close()
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    logits = []
    for src in (adapter_dir, out):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
            model = peft.PeftModel.from_pretrained(base, src)
        with torch.no_grad():
            logits.append(model(ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_gemma3_4x_layout_has_the_same_digest_as_the_5_layout(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """transformers 4.x saved Gemma 3 adapters under `language_model.model.layers`: the same
    weights in that layout are accepted and stored under the 5 layout, digest unchanged."""
    model_dir, adapter_dir = built["gemma3"]
    base = BaseModelSpec.from_dir(model_dir)
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", old)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    renamed = {k.replace("model.language_model.", "language_model.model."): v
               for k, v in tensors.items()}  # fmt: skip
    save_file(renamed, old / "adapter_model.safetensors")
    digests = []
    for i, src in enumerate((adapter_dir, old)):
        adapter = _validate(src, base)
        digests.append(write_canonical(adapter, tmp_path / f"out{i}").digest)
        adapter.close()
    assert digests[0] == digests[1]


# --- hand-made 4.x per-expert adapters (PEFT in transformers 5 converts them on load) --------


def _per_expert_adapter(out: Path, base: BaseModelSpec, names: tuple[str, ...],
                        r: int = 4, **config: Any) -> Path:  # fmt: skip
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(base.num_layers):
        for module in base.layer_modules(layer):
            if module.split(".")[-1] not in names:
                continue
            fan_in, fan_out = base.module_shape(module)
            stem = "base_model.model." + base.module_key(layer, module)
            tensors[stem + ".lora_A.weight"] = rng.standard_normal((r, fan_in), np.float32)
            tensors[stem + ".lora_B.weight"] = rng.standard_normal((fan_out, r), np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(names),
           **config}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def test_mixtral_4x_per_expert_adapter_is_accepted_and_is_what_peft_loads(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    model_dir, _ = built["mixtral"]
    base = BaseModelSpec.from_dir(model_dir)
    src = _per_expert_adapter(tmp_path / "a", base, ("q_proj", "w1", "w2", "w3"))
    adapter = _validate(src, base)
    modules = {(m.layer, m.module) for m in adapter.modules}
    assert (1, "experts.3.w2") in modules
    assert len(modules) == 2 * (1 + 4 * 3)
    assert adapter.target_modules == ["q_proj", "experts.w1", "experts.w3", "experts.w2"]
    assert {m.key for m in adapter.modules if m.module == "experts.0.w1"} == {
        f"model.layers.{i}.block_sparse_moe.experts.0.w1" for i in range(2)
    }
    adapter.close()
    # the oracle for the names: PEFT, converting them onto the packed experts, misses none
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir), src
        )
    wrapped = [n for n, m in model.named_modules() if getattr(m, "parameter_name", None)]
    assert len(wrapped) == 2 * 2


def test_qwen3_moe_per_expert_and_dense_layers_are_told_apart(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    model_dir, _ = built["qwen3_moe"]
    base = BaseModelSpec.from_dir(model_dir)
    assert base.moe_layers == (0,)
    assert base.module_shape("experts.1.up_proj") == (64, 32)
    assert base.module_shape("up_proj") == (64, 96)
    src = _per_expert_adapter(tmp_path / "a", base, ("gate_proj", "up_proj", "down_proj"))
    adapter = _validate(src, base)
    keys = {m.key for m in adapter.modules}
    assert "model.layers.0.mlp.experts.2.down_proj" in keys
    assert "model.layers.1.mlp.down_proj" in keys  # the dense layer
    adapter.close()
    # an expert in the dense layer, or a dense MLP in the sparse layer: refused by name
    tensors = load_file(src / "adapter_model.safetensors")
    for wrong, fragment in (
        ("model.layers.1.mlp.experts.0.up_proj", "layer 1 of qwen3_moe-model is a dense layer"),
        ("model.layers.0.mlp.up_proj", "mixture-of-experts layer (adapt its experts)"),
        ("model.layers.0.mlp.experts.9.up_proj", "its experts are 0 to 3"),
    ):
        bad = dict(tensors)
        bad[f"base_model.model.{wrong}.lora_A.weight"] = np.zeros((4, 64), np.float32)
        bad[f"base_model.model.{wrong}.lora_B.weight"] = np.zeros((32, 4), np.float32)
        save_file(bad, src / "adapter_model.safetensors")
        with pytest.raises(AdapterRejected) as info:
            _validate(src, base)
        assert info.value.code == ReasonCode.UNSUPPORTED_TARGET_MODULE
        assert fragment in info.value.message


# --- refusals --------------------------------------------------------------------------------


def _rewrite(adapter_dir: Path, out: Path, change: Callable[[dict[str, np.ndarray]], None],
             **config: Any) -> Path:  # fmt: skip
    shutil.copytree(adapter_dir, out)
    tensors = load_file(out / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, out / "adapter_model.safetensors")
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return out


def _refused(src: Path, base: BaseModelSpec) -> AdapterRejected:
    with pytest.raises(AdapterRejected) as info:
        _validate(src, base)
    return info.value


def _put(name: str, *shape: int) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda t: t.__setitem__(name, np.zeros(shape, np.float32))


def test_shape_mismatches_are_refused_with_ShapeMismatch(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    cases = {
        # Phi-3's qkv_proj out = (4 + 2 * 2) * 16 = 128: a q-sized B is refused
        "phi3": ("model.layers.0.self_attn.qkv_proj.lora_B.weight", (64, 8), "B 128x8"),
        # Qwen3's q_proj out is heads * head_dim = 128, not hidden = 64
        "qwen3": ("model.layers.1.self_attn.q_proj.lora_B.weight", (64, 8), "B 128x8"),
        # a packed expert's A holds rank x experts = 32 rows
        "mixtral": ("model.layers.0.mlp.experts.lora_", (8, 32), "rank 8 but the config gives "
                    "rank 8 x 4 experts"),
        "gemma3": ("model.language_model.layers.0.mlp.down_proj.lora_A.weight", (8, 64),
                   "needs A 8x96"),
    }  # fmt: skip
    for family, (name, shape, fragment) in cases.items():
        model_dir, adapter_dir = built[family]
        change = _put("base_model.model." + name, *shape)
        if name.endswith("lora_"):  # both factors, rank 8 instead of 8 x experts

            def change(t: dict[str, np.ndarray], name: str = name) -> None:
                t["base_model.model." + name + "A.weight"] = np.zeros((8, 32), np.float32)
                t["base_model.model." + name + "B.weight"] = np.zeros((64, 8), np.float32)

        src = _rewrite(adapter_dir, tmp_path / family, change)
        error = _refused(src, BaseModelSpec.from_dir(model_dir))
        assert error.code == ReasonCode.SHAPE_MISMATCH, (family, error.message)
        assert fragment in error.message, (family, error.message)


def test_a_split_part_beside_its_fused_module_is_refused_naming_the_fused_layers(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    # q_proj alone would be served fused (tests/adapters/test_cross_layout.py); beside the
    # layer's own qkv_proj it adapts one projection twice
    model_dir, adapter_dir = built["phi3"]
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    add = {q + ".lora_A.weight": np.zeros((8, 64), np.float32),
           q + ".lora_B.weight": np.zeros((64, 8), np.float32)}  # fmt: skip
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj"]
    src = _rewrite(adapter_dir, tmp_path / "a", lambda t: t.update(add), target_modules=targets)
    error = _refused(src, BaseModelSpec.from_dir(model_dir))
    assert error.code == ReasonCode.UNSUPPORTED_TARGET_MODULE
    assert "phi3 layers have qkv_proj, o_proj, gate_up_proj, down_proj" in error.message


@pytest.mark.parametrize(
    ("family", "tensor", "config", "fragment"),
    [
        ("mixtral", "model.layers.0.block_sparse_moe.gate", {},
         "LoRA on the router `block_sparse_moe.gate` is not supported"),
        ("qwen3_moe", "model.layers.0.mlp.gate", {},
         "LoRA on the router `mlp.gate` is not supported"),
        ("qwen3", "lm_head", {}, "LoRA on `lm_head` (the output projection) is not supported"),
        ("gemma2", "model.embed_tokens", {}, "LoRA on `embed_tokens` (the token embeddings)"),
        ("gemma3", "model.vision_tower.encoder.layers.0.self_attn.q_proj", {},
         "a vision or audio tower and its projector are not served"),
        ("qwen3_moe", None, {"target_parameters": ["gate.weight"]},
         "LoRA on the router `gate` is not supported"),
        ("mixtral", None, {"target_modules": ["q_proj", "gate"]},
         "LoRA on the router `gate` is not supported"),
        ("phi3", None, {"target_modules": ["qkv_proj", "embed_tokens"]},
         "LoRA on `embed_tokens` (the token embeddings) is not supported"),
        ("qwen3", None, {"target_parameters": ["experts.down_proj"]},
         "name packed experts, but qwen3-model (qwen3) has none"),
    ],
)  # fmt: skip
def test_what_stays_refused_is_refused_by_name(
    family: str, tensor: str | None, config: dict[str, Any], fragment: str,
    built: dict[str, tuple[Path, Path]], tmp_path: Path,
) -> None:  # fmt: skip
    model_dir, adapter_dir = built[family]

    def change(t: dict[str, np.ndarray]) -> None:
        if tensor is not None:
            t[f"base_model.model.{tensor}.lora_A.weight"] = np.zeros((8, 64), np.float32)
            t[f"base_model.model.{tensor}.lora_B.weight"] = np.zeros((4, 8), np.float32)

    error = _refused(_rewrite(adapter_dir, tmp_path / "a", change, **config),
                     BaseModelSpec.from_dir(model_dir))  # fmt: skip
    assert error.code == ReasonCode.UNSUPPORTED_TARGET_MODULE, error.message
    assert fragment in error.message


def test_modules_to_save_is_refused_on_every_family(
    built: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    for family in ("phi3", "qwen3_moe", "gemma3"):
        model_dir, adapter_dir = built[family]
        src = _rewrite(adapter_dir, tmp_path / family, lambda t: None, modules_to_save=["lm_head"])
        error = _refused(src, BaseModelSpec.from_dir(model_dir))
        assert error.code == ReasonCode.MODULES_TO_SAVE_NOT_SUPPORTED


def test_a_config_without_its_family_numbers_is_refused_naming_the_field() -> None:
    with pytest.raises(BaseModelError, match="text_config"):
        BaseModelSpec.from_config({"model_type": "gemma3", "hidden_size": 64}, "g")
    with pytest.raises(BaseModelError, match="unsupported model_type 'gpt2'"):
        BaseModelSpec.from_config({"model_type": "gpt2"}, "g")
    # a field left out takes the config class's default: Qwen3's head_dim is 128
    spec = BaseModelSpec.from_config(
        {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 96}, "q"
    )  # fmt: skip
    assert spec.head_dim == 128
    assert spec.module_shape("q_proj") == (64, 512)


def test_a_per_expert_adapter_with_qwen3_30b_a3b_tensor_count_passes_the_default_limits(
    tmp_path: Path,
) -> None:
    """48 layers x (4 attention + 128 experts x 3) modules x A and B = 37,248 tensors."""
    config = {"model_type": "qwen3_moe", "hidden_size": 16, "intermediate_size": 32,
              "moe_intermediate_size": 8, "num_experts": 128, "num_hidden_layers": 48,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}  # fmt: skip
    base = BaseModelSpec.from_config(config, "q30-shaped")
    src = _per_expert_adapter(tmp_path / "a", base, tuple(ATTN + MLP), r=1)
    adapter = _validate(src, base)
    assert len(adapter.weights.tensors) == 37_248
    assert len({m.module for m in adapter.modules if m.module.startswith("experts.")}) == 384
    adapter.close()


def test_a_published_gemma3_config_that_leaves_fields_out_reads_as_transformers_reads_it(
    tmp_path: Path,
) -> None:
    """Google's gemma-3-4b config.json gives text_config only hidden, intermediate and layer
    counts: the heads, head_dim and vocabulary are the config class's defaults."""
    published = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(published))
    spec = BaseModelSpec.from_dir(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).text_config
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers) == (2560, 10240, 34)
    assert spec.num_heads == theirs.num_attention_heads == 8
    assert spec.num_kv_heads == theirs.num_key_value_heads == 4
    assert spec.head_dim == theirs.head_dim == 256
    assert spec.module_shape("q_proj") == (2560, 8 * 256)
    shape = ModelShape.from_dir(str(tmp_path))
    assert shape.vocab_size == theirs.vocab_size == 262208
    assert shape.tie_word_embeddings
