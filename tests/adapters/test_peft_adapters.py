"""Real PEFT adapters (ranks 4 to 64, rslora, rank/alpha patterns, layer subsets) are accepted,
with the ranks and scales PEFT itself uses, and stored versions load back into PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.store.local import LocalStore
from loraplane.adapters.validate import validate_adapter
from tests.conftest import ADAPTER_CONFIGS


def _peft_model(model_dir: Path, adapter_dir: Path):  # type: ignore[no-untyped-def]
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    return peft.PeftModel.from_pretrained(base, adapter_dir, adapter_name="x")


@pytest.mark.parametrize("name", list(ADAPTER_CONFIGS))
def test_peft_adapter_is_accepted_with_pefts_ranks_and_scales(
    name: str, tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    base = BaseModelSpec.from_dir(tiny_llama_dir)
    with open_adapter_source(peft_adapters[name], AdapterLimits(max_rank=64)) as files:
        adapter = validate_adapter(files, base, AdapterLimits(max_rank=64))
        ours = {m.key: (m.rank, m.scale) for m in adapter.modules}
        adapter.close()

    model = _peft_model(tiny_llama_dir, peft_adapters[name])
    theirs = {}
    for key, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "x" in module.lora_A:
            theirs[key] = (module.lora_A["x"].weight.shape[0], module.scaling["x"])
    assert theirs, "PEFT attached nothing"
    assert ours.keys() == theirs.keys()
    for key, (rank, scale) in theirs.items():
        assert ours[key][0] == rank, key
        assert ours[key][1] == pytest.approx(scale), key


def test_rslora_scale_is_alpha_over_sqrt_rank(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    with open_adapter_source(peft_adapters["r16-rslora"], AdapterLimits()) as files:
        adapter = validate_adapter(files, BaseModelSpec.from_dir(tiny_llama_dir), AdapterLimits())
        assert {m.scale for m in adapter.modules} == {16 / 4}
        adapter.close()


def test_patterns_and_layer_subsets_are_honoured(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    base = BaseModelSpec.from_dir(tiny_llama_dir)
    with open_adapter_source(peft_adapters["r8-patterns"], AdapterLimits()) as files:
        adapter = validate_adapter(files, base, AdapterLimits())
        by_key = {m.key: m for m in adapter.modules}
        adapter.close()
    assert by_key["model.layers.0.self_attn.q_proj"].rank == 4
    assert by_key["model.layers.1.self_attn.q_proj"].rank == 8
    assert by_key["model.layers.1.mlp.down_proj"].rank == 12
    assert by_key["model.layers.0.self_attn.o_proj"].scale == pytest.approx(3 / 8)
    with open_adapter_source(peft_adapters["r8-layer1"], AdapterLimits()) as files:
        adapter = validate_adapter(files, base, AdapterLimits())
        assert {m.layer for m in adapter.modules} == {1}
        adapter.close()


def test_stored_version_loads_in_peft_and_computes_the_same(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    base = BaseModelSpec.from_dir(tiny_llama_dir, name="tiny")
    src = peft_adapters["r8-patterns"]
    version = ingest(src, "acme", "bot", base, AdapterLimits(), store)
    stored = Path(store.url()) / version.path
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        expected = _peft_model(tiny_llama_dir, src)(ids).logits
        got = _peft_model(tiny_llama_dir, stored)(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
