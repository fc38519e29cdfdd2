"""load_lora: PEFT folders through the validating reader; scales, dtypes, rejections."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, IntegrityError, ReasonCode
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.safetensors_io import TensorInfo
from loraplane.adapters.store import LocalStore
from loraplane.dataplane.lora import load_lora, loader
from loraplane.dataplane.lora import stored as stored_read
from loraplane.dataplane.lora.stored import _tensor_view
from loraplane.demo.build import build_adapter


@pytest.fixture(scope="module")
def spec(tiny_llama_dir: Path) -> BaseModelSpec:
    return BaseModelSpec.from_dir(tiny_llama_dir)


def test_scales_honour_lora_alpha_rslora_and_the_rank_and_alpha_patterns(
    peft_adapters: dict[str, Path], spec: BaseModelSpec
) -> None:
    plain = load_lora(peft_adapters["r16"], spec)
    assert {w.scale for w in plain.modules.values()} == {2.0}  # 32 / 16
    rslora = load_lora(peft_adapters["r16-rslora"], spec)
    assert {w.scale for w in rslora.modules.values()} == {16 / math.sqrt(16)}
    patterns = load_lora(peft_adapters["r8-patterns"], spec).modules
    assert patterns[(0, "q_proj")].rank == 4 and patterns[(0, "q_proj")].scale == 16 / 4
    assert patterns[(1, "q_proj")].rank == 8 and patterns[(1, "q_proj")].scale == 2.0
    assert patterns[(0, "down_proj")].rank == 12
    assert patterns[(0, "down_proj")].scale == pytest.approx(16 / 12)
    assert patterns[(1, "o_proj")].scale == pytest.approx(3 / 8)


def test_layers_to_transform_and_target_modules_limit_the_adapted_modules(
    peft_adapters: dict[str, Path], spec: BaseModelSpec
) -> None:
    assert {layer for layer, _ in load_lora(peft_adapters["r8-layer1"], spec).modules} == {1}
    qv = load_lora(peft_adapters["r8-qv"], spec)
    assert {m for _, m in qv.modules} == {"q_proj", "v_proj"}
    assert qv.rank == 8


def test_weights_equal_the_safetensors_file_and_shapes_are_a_r_by_in_b_out_by_r(
    peft_adapters: dict[str, Path], spec: BaseModelSpec
) -> None:
    from safetensors.torch import load_file

    stored = load_file(str(peft_adapters["r32-mlp"] / "adapter_model.safetensors"))
    adapter = load_lora(peft_adapters["r32-mlp"], spec)
    w = adapter.modules[(1, "down_proj")]
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(w.a, stored[f"{prefix}.lora_A.weight"])
    assert torch.equal(w.b, stored[f"{prefix}.lora_B.weight"])
    assert w.a.shape == (32, 128) and w.b.shape == (64, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_adapters_keep_their_exact_values(
    peft_adapters: dict[str, Path], spec: BaseModelSpec, tmp_path: Path, dtype: torch.dtype
) -> None:
    from safetensors.torch import load_file, save_file

    src = peft_adapters["r8-qv"]
    shutil.copytree(src, tmp_path / "half")
    tensors = {k: v.to(dtype) for k, v in load_file(str(src / "adapter_model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "half" / "adapter_model.safetensors"))
    adapter = load_lora(tmp_path / "half", spec)
    w = adapter.modules[(0, "v_proj")]
    assert w.a.dtype == dtype
    prefix = "base_model.model.model.layers.0.self_attn.v_proj"
    assert torch.equal(w.a, tensors[f"{prefix}.lora_A.weight"])
    assert torch.equal(w.b, tensors[f"{prefix}.lora_B.weight"])


def test_the_weights_file_is_closed_after_loading(
    peft_adapters: dict[str, Path], spec: BaseModelSpec
) -> None:
    path = str(peft_adapters["r64"] / "adapter_model.safetensors")
    adapter = load_lora(peft_adapters["r64"], spec)
    assert adapter.nbytes > 0
    assert path not in Path("/proc/self/maps").read_text()


def test_an_adapter_over_the_rank_limit_is_rejected_with_its_reason_code(
    peft_adapters: dict[str, Path], spec: BaseModelSpec
) -> None:
    with pytest.raises(AdapterRejected) as err:
        load_lora(peft_adapters["r64"], spec, AdapterLimits(max_rank=32))
    assert err.value.code == ReasonCode.RANK_TOO_LARGE


def test_an_adapter_for_another_base_model_shape_is_rejected(
    peft_adapters: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    other = BaseModelSpec.from_config({**config, "hidden_size": 128}, "other")
    with pytest.raises(AdapterRejected) as err:
        load_lora(peft_adapters["r4"], other)
    assert err.value.code == ReasonCode.SHAPE_MISMATCH


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_stored_version_reads_in_one_pass_equal_to_the_validating_path(
    peft_adapters: dict[str, Path], spec: BaseModelSpec, tmp_path: Path, dtype: torch.dtype
) -> None:
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(peft_adapters["r8-patterns"], src)
    weights = src / "adapter_model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(str(weights)).items()}, str(weights))
    version = ingest(src, "acme", "bot", spec, AdapterLimits(), LocalStore(tmp_path / "store"))
    stored = tmp_path / "store" / version.path
    fast = load_lora(stored, spec, expected_digest=version.digest)  # one read, hashed on the way
    slow = load_lora(src, spec)  # the tenant's own (non-canonical) file, validated in full
    assert fast.digest == slow.digest == version.digest
    assert fast.modules.keys() == slow.modules.keys()
    for key, w in fast.modules.items():
        assert w.a.dtype == dtype and w.scale == slow.modules[key].scale
        assert torch.equal(w.a, slow.modules[key].a) and torch.equal(w.b, slow.modules[key].b)
    # one buffer is the only copy: the tensors sit in it back to back, as in the file
    spans = sorted((t.data_ptr(), t.nbytes) for w in fast.modules.values() for t in (w.a, w.b))
    assert all(p + n == q for (p, n), (q, _) in itertools.pairwise(spans))
    assert str(stored / "adapter_model.safetensors") not in Path("/proc/self/maps").read_text()


def test_a_stored_version_with_a_flipped_byte_fails_its_digest(
    peft_adapters: dict[str, Path], spec: BaseModelSpec, tmp_path: Path
) -> None:
    version = ingest(
        peft_adapters["r4"], "acme", "bot", spec, AdapterLimits(), LocalStore(tmp_path / "s")
    )
    weights = tmp_path / "s" / version.path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # a tensor byte: the layout still parses, the content changed
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        load_lora(weights.parent, spec, expected_digest=version.digest)


def test_a_tensor_at_an_unaligned_offset_is_copied_not_viewed() -> None:
    values = np.arange(6, dtype="<f4")
    buf = np.zeros(2 + values.nbytes, dtype=np.uint8)
    buf[2:] = np.frombuffer(values.tobytes(), dtype=np.uint8)
    info = TensorInfo("t", "F32", (2, 3), 2, 2 + values.nbytes)
    tensor = _tensor_view(torch.from_numpy(buf), {}, info)
    assert tensor.shape == (2, 3) and torch.equal(tensor.flatten(), torch.from_numpy(values))


@pytest.fixture
def no_known_layouts() -> None:
    stored_read._layouts.clear()


def test_a_version_of_a_known_layout_is_read_without_validating_again_and_digest_checked(
    tiny_llama_dir: Path,
    spec: BaseModelSpec,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_known_layouts: None,
) -> None:
    store = LocalStore(tmp_path / "store")
    srcs = [build_adapter(tiny_llama_dir, tmp_path / f"src{i}", r=8, seed=i) for i in range(3)]
    other = build_adapter(tiny_llama_dir, tmp_path / "r4", r=4, seed=9)
    versions = [ingest(p, "acme", p.name, spec, AdapterLimits(), store) for p in [*srcs, other]]
    expected = load_lora(srcs[1], spec)  # the tenant's own file, validated in full
    load_lora(tmp_path / "store" / versions[0].path, spec, expected_digest=versions[0].digest)

    def validate_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("validated again")

    monkeypatch.setattr(loader, "validate_adapter", validate_again)
    # same rank, modules and dtypes as the first: the same config and header bytes
    fast = load_lora(
        tmp_path / "store" / versions[1].path, spec, expected_digest=versions[1].digest
    )
    assert fast.digest == versions[1].digest and fast.modules.keys() == expected.modules.keys()
    for key, w in fast.modules.items():
        assert torch.equal(w.a, expected.modules[key].a) and w.scale == expected.modules[key].scale
        assert torch.equal(w.b, expected.modules[key].b)
    # its digest is still checked: one flipped tensor byte fails it, without validation
    weights = tmp_path / "store" / versions[2].path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        load_lora(weights.parent, spec, expected_digest=versions[2].digest)
    # another layout (rank 4), or the same one under other limits, is validated in full
    with pytest.raises(AssertionError, match="validated again"):
        load_lora(tmp_path / "store" / versions[3].path, spec, expected_digest=versions[3].digest)
    with pytest.raises(AssertionError, match="validated again"):
        load_lora(
            tmp_path / "store" / versions[1].path,
            spec,
            AdapterLimits(max_rank=8),
            expected_digest=versions[1].digest,
        )


def test_a_layout_is_remembered_only_once_its_digest_matched(
    tiny_llama_dir: Path, spec: BaseModelSpec, tmp_path: Path, no_known_layouts: None
) -> None:
    version = ingest(
        build_adapter(tiny_llama_dir, tmp_path / "src", r=8, seed=1),
        "acme",
        "bot",
        spec,
        AdapterLimits(),
        LocalStore(tmp_path / "store"),
    )
    folder = tmp_path / "store" / version.path
    with pytest.raises(IntegrityError):
        load_lora(folder, spec, expected_digest="0" * 64)
    assert not stored_read._layouts
    load_lora(folder, spec, expected_digest=version.digest)
    assert len(stored_read._layouts) == 1
