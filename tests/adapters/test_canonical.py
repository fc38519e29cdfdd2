"""The canonical digest: stable across re-serialisation, different for different content, and
recomputable from the stored files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import canonical_digest, digest_files, write_canonical
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import validate_adapter
from tests.adapters.crafting import lora_config, lora_tensors, raw_safetensors, write_adapter
from tests.adapters.test_bad_corpus import BASE


def digest_of(path: Path, base: BaseModelSpec | None = BASE) -> str:
    with open_adapter_source(path, AdapterLimits()) as files:
        adapter = validate_adapter(files, base, AdapterLimits())
        try:
            return canonical_digest(adapter)
        finally:
            adapter.close()


def test_same_weights_reserialised_have_the_same_digest(tmp_path: Path) -> None:
    tensors = lora_tensors(BASE, 8)
    a = write_adapter(tmp_path / "a", lora_config(), tensors)
    # reversed tensor order in the data section, other metadata, extra config fields,
    # another order of target_modules
    header: dict[str, object] = {"__metadata__": {"trained_by": "someone"}}
    chunks, pos = [], 0
    for name in sorted(tensors, reverse=True):
        raw = tensors[name].tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [pos, pos + len(raw)]}  # fmt: skip
        chunks.append(raw)
        pos += len(raw)
    config = lora_config(target_modules=["v_proj", "q_proj"], revision="main", inference_mode=False)
    b = write_adapter(tmp_path / "b", config, raw_safetensors(header, b"".join(chunks)))
    assert (a / "adapter_model.safetensors").read_bytes() != (
        b / "adapter_model.safetensors"
    ).read_bytes()
    assert digest_of(a) == digest_of(b)


def test_digest_changes_with_weights_alpha_rslora_or_dtype(tmp_path: Path) -> None:
    tensors = lora_tensors(BASE, 8)
    ref = digest_of(write_adapter(tmp_path / "ref", lora_config(), tensors))
    changed = dict(tensors)
    key = next(iter(changed))
    changed[key] = changed[key].copy()
    changed[key][0, 0] += 1e-3
    f16 = {k: v.astype(np.float16) for k, v in tensors.items()}
    variants = [
        write_adapter(tmp_path / "w", lora_config(), changed),
        write_adapter(tmp_path / "alpha", lora_config(lora_alpha=17), tensors),
        write_adapter(tmp_path / "rs", lora_config(use_rslora=True), tensors),
        write_adapter(tmp_path / "f16", lora_config(), f16),
    ]
    digests = {digest_of(v) for v in variants}
    assert ref not in digests
    assert len(digests) == len(variants)


def test_digest_does_not_depend_on_the_base_model_check(tmp_path: Path) -> None:
    src = write_adapter(tmp_path / "a", lora_config(), lora_tensors(BASE, 8))
    assert digest_of(src, BASE) == digest_of(src, None)


def test_written_canonical_files_recompute_to_the_digest_and_read_back(tmp_path: Path) -> None:
    src = write_adapter(
        tmp_path / "a", lora_config(rank_pattern={"v_proj": 8}), lora_tensors(BASE, 8)
    )
    with open_adapter_source(src, AdapterLimits()) as files:
        adapter = validate_adapter(files, BASE, AdapterLimits())
        canon = write_canonical(adapter, tmp_path / "out")
        assert canon.digest == canonical_digest(adapter)
        adapter.close()
    assert digest_files(canon.config_path, canon.weights_path) == canon.digest
    config = json.loads(canon.config_path.read_text())
    assert config["rank_pattern"] == {"v_proj": 8}
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert digest_of(tmp_path / "out") == canon.digest
