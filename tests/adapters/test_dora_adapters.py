"""DoRA adapters at validation: accepted with a magnitude vector per module, stored with them
(and `use_dora: true`) in the canonical files and the digest; refused, with DoRANotSupported
and a message saying why, where they are not served (a mixture of experts' experts, modules
of the other layout than the base's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import canonical_digest, write_canonical
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import ValidatedAdapter, validate_adapter
from tests.adapters.crafting import (
    PREFIX,
    TINY_BASE,
    dora_tensors,
    lora_config,
    lora_tensors,
    write_adapter,
)

SHAPE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
PHI3 = BaseModelSpec.from_config({"model_type": "phi3", **SHAPE}, "phi3-base")
MIXTRAL = BaseModelSpec.from_config(
    {"model_type": "mixtral", **SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "mixtral-base",
)


def _validate(src: Path, base: BaseModelSpec) -> ValidatedAdapter:
    limits = AdapterLimits()
    with open_adapter_source(src, limits) as files:
        return validate_adapter(files, base, limits)


def test_a_dora_adapter_is_accepted_and_its_magnitudes_are_stored_and_digested(
    tmp_path: Path,
) -> None:
    tensors = dora_tensors(TINY_BASE, 8)
    src = write_adapter(tmp_path / "a", lora_config(use_dora=True), tensors)
    adapter = _validate(src, TINY_BASE)
    try:
        assert adapter.spec.use_dora
        assert all(m.m_name.endswith(".lora_magnitude_vector") for m in adapter.modules)
        assert adapter.summary()["use_dora"] is True
        out = write_canonical(adapter, tmp_path / "stored")
        assert out.digest == canonical_digest(adapter)
    finally:
        adapter.close()
    assert json.loads(out.config_path.read_bytes())["use_dora"] is True
    stored = load_file(out.weights_path)
    assert sorted(stored) == sorted(tensors)
    q0 = PREFIX + "model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    np.testing.assert_array_equal(stored[q0], tensors[q0])
    # the magnitudes are part of the version's identity
    tensors[q0] = tensors[q0] * 2
    other = write_adapter(tmp_path / "b", lora_config(use_dora=True), tensors)
    changed = _validate(other, TINY_BASE)
    try:
        assert canonical_digest(changed) != out.digest
    finally:
        changed.close()


def test_a_plain_lora_adapter_keeps_its_digest_and_summary(tmp_path: Path) -> None:
    src = write_adapter(tmp_path / "a", lora_config(), lora_tensors(TINY_BASE, 8))
    adapter = _validate(src, TINY_BASE)
    try:
        assert not adapter.spec.use_dora and "use_dora" not in adapter.summary()
        assert json.loads(adapter.spec.canonical_json())["use_dora"] is False
    finally:
        adapter.close()


def test_dora_on_a_mixture_of_experts_experts_is_refused_with_DoRANotSupported(
    tmp_path: Path,
) -> None:
    tensors: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(0)
    for layer in range(2):
        for e in range(4):
            stem = f"{PREFIX}model.layers.{layer}.block_sparse_moe.experts.{e}.w1"
            fan_in, fan_out = MIXTRAL.module_shape(f"experts.{e}.w1")
            tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((4, fan_in), np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((fan_out, 4), np.float32)
            tensors[f"{stem}.lora_magnitude_vector"] = np.ones(fan_out, np.float32)
    src = write_adapter(tmp_path / "a", lora_config(4, target_modules=["w1"], use_dora=True),
                        tensors)  # fmt: skip
    with pytest.raises(AdapterRejected) as info:
        _validate(src, MIXTRAL).close()
    assert info.value.code is ReasonCode.DORA_NOT_SUPPORTED
    assert "DoRA on a mixture of experts' expert weights is not served" in info.value.message


def test_dora_on_a_mixture_of_experts_attention_is_accepted(tmp_path: Path) -> None:
    tensors = dora_tensors(MIXTRAL, 4)
    src = write_adapter(tmp_path / "a", lora_config(4, use_dora=True), tensors)
    _validate(src, MIXTRAL).close()


def test_a_dora_adapter_of_the_other_layout_is_refused_with_DoRANotSupported(
    tmp_path: Path,
) -> None:
    llama = BaseModelSpec.from_config({"model_type": "llama", **SHAPE}, "llama-base")
    tensors = dora_tensors(llama, 4, ("q_proj", "k_proj", "v_proj"))
    src = write_adapter(
        tmp_path / "a",
        lora_config(4, target_modules=["q_proj", "k_proj", "v_proj"], use_dora=True),
        tensors,
    )
    _validate(src, llama).close()  # on its own layout: served
    with pytest.raises(AdapterRejected) as info:
        _validate(src, PHI3).close()
    assert info.value.code is ReasonCode.DORA_NOT_SUPPORTED
    assert "DoRA is served only on the base's own layout" in info.value.message
    assert "q_proj" in info.value.message and "qkv_proj" in info.value.message
