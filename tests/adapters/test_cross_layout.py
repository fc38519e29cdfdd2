"""Cross-layout adapters at validation: split q/k/v and gate/up on a fused (Phi-3) base and
the fused names on a split (Llama) base are accepted with their parts' (the fused module's)
shapes and listed as uploaded; the conversions serving will make are reported with their
ranks (a fused module's is the sum of its parts'), a fused rank over the pool's max is
refused in words, a wrong part shape is refused naming the part, and digests stay those of
the uploaded files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import canonical_digest, write_canonical
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import ValidatedAdapter, validate_adapter
from tests.adapters.crafting import PREFIX, lora_config, lora_tensors, write_adapter

SHAPE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
PHI3 = BaseModelSpec.from_config({"model_type": "phi3", **SHAPE}, "phi3-base")
LLAMA = BaseModelSpec.from_config({"model_type": "llama", **SHAPE}, "llama-base")
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
Q_OUT, KV_OUT, INTER = 64, 32, 96  # heads * head_dim, kv_heads * head_dim


def _adapter(
    root: Path, modules: tuple[str, ...], r: int = 8, layout: BaseModelSpec = LLAMA, **extra: Any
) -> Path:
    """An adapter of `modules` in every layer, shaped as `layout` has them."""
    tensors = lora_tensors(layout, r, modules)
    return write_adapter(root, lora_config(r, target_modules=list(modules), **extra), tensors)


def _validate(src: Path, base: BaseModelSpec, limits: AdapterLimits | None = None
              ) -> ValidatedAdapter:  # fmt: skip
    limits = limits or AdapterLimits()
    with open_adapter_source(src, limits) as files:
        return validate_adapter(files, base, limits)


def _refused(src: Path, base: BaseModelSpec, limits: AdapterLimits | None = None
             ) -> AdapterRejected:  # fmt: skip
    with pytest.raises(AdapterRejected) as info:
        _validate(src, base, limits).close()
    return info.value


def test_split_adapter_on_a_fused_base_is_accepted_with_its_modules_and_fused_ranks(
    tmp_path: Path,
) -> None:
    adapter = _validate(_adapter(tmp_path / "a", SPLIT), PHI3)
    try:
        assert adapter.target_modules == list(SPLIT)  # as uploaded
        assert {(m.layer, m.module) for m in adapter.modules} == {
            (layer, m) for layer in range(2) for m in SPLIT
        }
        # each part has its own shape on the fused base
        shapes = {m.module: (m.in_features, m.out_features) for m in adapter.modules}
        assert shapes["q_proj"] == (64, Q_OUT) and shapes["k_proj"] == (64, KV_OUT)
        assert shapes["gate_proj"] == (64, INTER)
        built = {(c.layer, c.module): c for c in adapter.conversions}
        assert set(built) == {
            (layer, m) for layer in range(2) for m in ("qkv_proj", "gate_up_proj")
        }
        qkv = built[(0, "qkv_proj")]
        assert [p.module for p in qkv.parts] == ["q_proj", "k_proj", "v_proj"] and qkv.fuses
        assert qkv.rank == 24 and built[(1, "gate_up_proj")].rank == 16
        assert adapter.rank == 8 and adapter.served_rank == 24
        summary = adapter.summary()
        assert summary["rank"] == 8 and summary["served_rank"] == 24
        assert summary["served_modules"] == ["qkv_proj", "gate_up_proj"]
    finally:
        adapter.close()


def test_partial_split_adapter_on_a_fused_base_fuses_only_its_parts(tmp_path: Path) -> None:
    # q and v only: k's rows of the fused B are zero, adding no rank
    adapter = _validate(_adapter(tmp_path / "a", ("q_proj", "v_proj"), r=16), PHI3)
    try:
        assert adapter.target_modules == ["q_proj", "v_proj"]
        assert [(c.layer, c.module, [p.module for p in c.parts], c.rank)
                for c in adapter.conversions] == [
            (0, "qkv_proj", ["q_proj", "v_proj"], 32), (1, "qkv_proj", ["q_proj", "v_proj"], 32)
        ]  # fmt: skip
    finally:
        adapter.close()


def test_fused_adapter_on_a_split_base_is_accepted_and_keeps_its_rank(tmp_path: Path) -> None:
    src = _adapter(tmp_path / "a", FUSED, r=16, layout=PHI3)
    # its rank does not grow when split: a max rank of 16 is enough
    adapter = _validate(src, LLAMA, AdapterLimits(max_rank=16))
    try:
        assert adapter.target_modules == list(FUSED)
        shapes = {m.module: (m.in_features, m.out_features) for m in adapter.modules}
        assert shapes["qkv_proj"] == (64, Q_OUT + 2 * KV_OUT)
        assert shapes["gate_up_proj"] == (64, 2 * INTER)
        parts = {c.module: [p.module for p in c.parts] for c in adapter.conversions if c.layer == 0}
        assert parts == {"q_proj": ["qkv_proj"], "k_proj": ["qkv_proj"], "v_proj": ["qkv_proj"],
                         "gate_proj": ["gate_up_proj"], "up_proj": ["gate_up_proj"]}  # fmt: skip
        assert not any(c.fuses for c in adapter.conversions)
        assert adapter.served_rank == 16 == adapter.rank
    finally:
        adapter.close()


def test_native_adapters_report_no_conversion(tmp_path: Path) -> None:
    for base, modules in ((PHI3, FUSED), (LLAMA, SPLIT)):
        adapter = _validate(_adapter(tmp_path / base.model_type, modules, layout=base), base)
        assert adapter.conversions == () and adapter.served_rank == 8
        assert "served_rank" not in adapter.summary()
        adapter.close()


def test_the_digest_and_stored_files_are_the_uploaded_adapters(tmp_path: Path) -> None:
    """The same files validated on either base digest the same and are stored as uploaded:
    the conversion happens when serving, not in the store."""
    src = _adapter(tmp_path / "a", SPLIT)
    on_phi, on_llama = _validate(src, PHI3), _validate(src, LLAMA)
    try:
        assert canonical_digest(on_phi) == canonical_digest(on_llama)
        write_canonical(on_phi, tmp_path / "canon")
    finally:
        on_phi.close()
        on_llama.close()
    from safetensors.numpy import load_file

    stored = load_file(next(Path(tmp_path / "canon").rglob("*.safetensors")))
    uploaded = load_file(src / "adapter_model.safetensors")
    assert set(stored) == set(uploaded)  # q_proj ... named as uploaded, nothing fused
    for name, tensor in uploaded.items():
        np.testing.assert_array_equal(stored[name], tensor)


def test_fused_rank_over_the_pools_max_is_refused_in_words(tmp_path: Path) -> None:
    src = _adapter(tmp_path / "a", ("q_proj", "k_proj", "v_proj", "o_proj"), r=8)
    pool = AdapterLimits().tightened(max_rank=16, rank_limit="the pool's max_lora_rank 16")
    error = _refused(src, PHI3, pool)
    assert error.code == ReasonCode.RANK_TOO_LARGE
    message = error.message
    assert "layer 0 qkv_proj" in message
    assert "q_proj + k_proj + v_proj of ranks 8 + 8 + 8" in message
    assert "one module of rank 24" in message and "the pool's max_lora_rank 16" in message
    # the same adapter fits a pool of rank 24, and on a split base rank 8 is all it needs
    _validate(src, PHI3, AdapterLimits(max_rank=24)).close()
    _validate(src, LLAMA, AdapterLimits(max_rank=8)).close()
    # two parts of rank 8 fit a max of 16 exactly
    _validate(_adapter(tmp_path / "b", ("q_proj", "v_proj")), PHI3, pool).close()


def test_fused_rank_check_reads_rank_pattern(tmp_path: Path) -> None:
    # ranks 4 + 8 + 4 = 16 fit; 4 + 16 + 4 = 24 do not (the parts' own ranks, not r)
    for k_rank, fits in ((8, True), (16, False)):
        tensors = lora_tensors(LLAMA, 4, ("q_proj", "k_proj", "v_proj"))
        rng = np.random.default_rng(1)
        for layer in range(2):
            stem = f"{PREFIX}model.layers.{layer}.self_attn.k_proj"
            tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((k_rank, 64), np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((KV_OUT, k_rank), np.float32)
        config = lora_config(4, target_modules=["q_proj", "k_proj", "v_proj"],
                             rank_pattern={"k_proj": k_rank})  # fmt: skip
        src = write_adapter(tmp_path / str(k_rank), config, tensors)
        limits = AdapterLimits(max_rank=16)
        if fits:
            adapter = _validate(src, PHI3, limits)
            assert adapter.served_rank == 16 and adapter.rank == 8
            adapter.close()
        else:
            error = _refused(src, PHI3, limits)
            assert error.code == ReasonCode.RANK_TOO_LARGE
            assert "layer 0 qkv_proj" in error.message and "of ranks 4 + 16 + 4" in error.message


@pytest.mark.parametrize(
    ("base", "tensor", "shape", "fragments"),
    [
        # k is kv_heads * head_dim = 32 rows on Phi-3, not q's 64
        (PHI3, "model.layers.1.self_attn.k_proj.lora_B.weight", (Q_OUT, 8),
         ["layer 1 k_proj", "B 32x8", "k_proj is served as 32 of the 128 rows of phi3's fused "
          "qkv_proj"]),
        (PHI3, "model.layers.0.mlp.up_proj.lora_B.weight", (2 * INTER, 8),
         ["layer 0 up_proj", "B 96x8", "of the 192 rows of phi3's fused gate_up_proj"]),
        # a fused qkv_proj on Llama must have every part's rows: 64 + 32 + 32
        (LLAMA, "model.layers.0.self_attn.qkv_proj.lora_B.weight", (Q_OUT, 8),
         ["layer 0 qkv_proj", "B 128x8", "qkv_proj is split into q_proj, k_proj, v_proj on "
          "llama"]),
    ],
)  # fmt: skip
def test_a_wrong_part_shape_is_refused_naming_the_part(
    base: BaseModelSpec, tensor: str, shape: tuple[int, int], fragments: list[str],
    tmp_path: Path,
) -> None:  # fmt: skip
    layout = LLAMA if base is PHI3 else PHI3
    modules = SPLIT if base is PHI3 else FUSED
    tensors = lora_tensors(layout, 8, modules)
    tensors[PREFIX + tensor] = np.zeros(shape, np.float32)
    src = write_adapter(tmp_path / "a", lora_config(8, target_modules=list(modules)), tensors)
    error = _refused(src, base)
    assert error.code == ReasonCode.SHAPE_MISMATCH
    for fragment in fragments:
        assert fragment in error.message, error.message


@pytest.mark.parametrize(("base", "modules"), [(PHI3, ("qkv_proj", "q_proj")),
                                               (LLAMA, ("gate_up_proj", "up_proj"))])  # fmt: skip
def test_a_fused_module_and_its_part_in_one_layer_are_refused(
    base: BaseModelSpec, modules: tuple[str, str], tmp_path: Path
) -> None:
    tensors = lora_tensors(base, 8, modules[:1]) | lora_tensors(base, 8, modules[1:])
    src = write_adapter(tmp_path / "a", lora_config(8, target_modules=list(modules)), tensors)
    error = _refused(src, base)
    assert error.code == ReasonCode.UNSUPPORTED_TARGET_MODULE
    assert f"layer 0 is adapted on both the fused {modules[0]} and its part {modules[1]}" in (
        error.message
    )


def test_what_no_layout_serves_stays_refused(tmp_path: Path) -> None:
    """A Mixtral layer's MLP is its experts: no fused or split MLP projection is served."""
    mixtral = BaseModelSpec.from_config(
        {"model_type": "mixtral", **SHAPE, "num_local_experts": 4}, "mixtral-base"
    )
    tensors = {}
    rng = np.random.default_rng(0)
    stem = f"{PREFIX}model.layers.0.mlp.gate_up_proj"
    tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((8, 64), np.float32)
    tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((2 * INTER, 8), np.float32)
    src = write_adapter(tmp_path / "a", lora_config(8, target_modules=["gate_up_proj"]), tensors)
    error = _refused(src, mixtral)
    assert error.code == ReasonCode.UNSUPPORTED_TARGET_MODULE
    assert "gate_up_proj" in error.message


def test_a_peft_adapter_of_a_llama_model_validates_on_the_phi3_config(tmp_path: Path) -> None:
    """Real PEFT files: a Llama adapter's names and config on a Phi-3 base's config.json."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.factories import build_peft_adapter

    model_dir = tmp_path / "llama"
    config = transformers.LlamaConfig(vocab_size=64, **SHAPE)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    src = build_peft_adapter(model_dir, tmp_path / "adapter", seed=3, r=4, lora_alpha=8,
                             target_modules=["q_proj", "k_proj", "v_proj", "up_proj",
                                             "gate_proj"])  # fmt: skip
    assert json.loads((src / "adapter_config.json").read_text())["r"] == 4
    adapter = _validate(src, PHI3, AdapterLimits(max_rank=12))
    try:
        assert adapter.target_modules == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
        assert {c.module: c.rank for c in adapter.conversions} == {
            "qkv_proj": 12,
            "gate_up_proj": 8,
        }
        assert all(m.scale == 2.0 for m in adapter.modules)
    finally:
        adapter.close()


QWEN3_MOE = BaseModelSpec.from_config(
    {"model_type": "qwen3_moe", **SHAPE, "head_dim": 16, "moe_intermediate_size": 32,
     "num_experts": 4, "mlp_only_layers": [1]}, "qwen3-moe-base",
)  # fmt: skip


def _fused_tensors(spec: BaseModelSpec, where: list[tuple[int, str, str]], r: int = 8
                   ) -> dict[str, np.ndarray]:  # fmt: skip
    """A and B of each (layer, block, module), shaped as `spec` gives the module."""
    rng = np.random.default_rng(2)
    out = {}
    for layer, block, module in where:
        fan_in, fan_out = spec.module_shape(module)
        stem = f"{PREFIX}model.layers.{layer}.{block}.{module}"
        out[f"{stem}.lora_A.weight"] = rng.standard_normal((r, fan_in), np.float32)
        out[f"{stem}.lora_B.weight"] = rng.standard_normal((fan_out, r), np.float32)
    return out


def test_fused_names_on_a_mixture_of_experts_base_split_where_it_has_the_parts(
    tmp_path: Path,
) -> None:
    """Qwen3-MoE: attention split in every layer, the MLP split in its dense layer (1); a
    sparse layer's MLP is its experts, so gate_up_proj there stays refused."""
    where = [(0, "self_attn", "qkv_proj"), (1, "self_attn", "qkv_proj"), (1, "mlp", "gate_up_proj")]
    config = lora_config(8, target_modules=["qkv_proj", "gate_up_proj"])
    src = write_adapter(tmp_path / "a", config, _fused_tensors(QWEN3_MOE, where))
    adapter = _validate(src, QWEN3_MOE)
    try:
        assert adapter.target_modules == ["qkv_proj", "gate_up_proj"]
        assert {(c.layer, c.module) for c in adapter.conversions} == {
            (0, "q_proj"), (0, "k_proj"), (0, "v_proj"), (1, "q_proj"), (1, "k_proj"),
            (1, "v_proj"), (1, "gate_proj"), (1, "up_proj"),
        }  # fmt: skip
    finally:
        adapter.close()
    sparse = _fused_tensors(QWEN3_MOE, [*where, (0, "mlp", "gate_up_proj")])
    error = _refused(write_adapter(tmp_path / "b", config, sparse), QWEN3_MOE)
    assert error.code == ReasonCode.UNSUPPORTED_TARGET_MODULE
    assert (
        "adapts mlp.gate_up_proj, but layer 0 of qwen3-moe-base is a mixture-of-experts "
        "layer (adapt its experts)" in error.message
    )


def test_ingest_stores_the_upload_and_records_the_served_layout(tmp_path: Path) -> None:
    """A Llama-layout upload to a Phi-3 pool: stored as uploaded (q_proj ... in the store, the
    uploaded rank), the manifest telling the rank it is served at; over the pool's rank
    limit nothing is stored."""
    from loraplane.adapters.ingest import ingest
    from loraplane.adapters.store import LocalStore

    store = LocalStore(tmp_path / "store")
    src = _adapter(tmp_path / "a", ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    version = ingest(src, "acme", "split", PHI3, AdapterLimits(max_rank=24), store)
    manifest = json.loads(store.get_bytes(version.path + "manifest.json"))
    assert manifest["rank"] == 8 and manifest["served_rank"] == 24
    assert manifest["target_modules"] == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    assert manifest["served_modules"] == ["qkv_proj", "gate_up_proj"]
    with pytest.raises(AdapterRejected) as info:
        ingest(src, "acme", "narrow", PHI3, AdapterLimits(max_rank=16), store)
    assert info.value.code == ReasonCode.RANK_TOO_LARGE
    assert not [k for k in store.list_keys("adapters/acme/narrow/") if k.endswith(".json")]
