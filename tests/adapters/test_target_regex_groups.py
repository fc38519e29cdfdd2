"""Finding (issue 29 end-to-end work): `target_modules` given as a regex with a group, as PEFT's
own documentation writes them (`r".*\\.(q_proj|v_proj)"`; the MoE parity tests' all-linears
adapter uses one too), is refused at upload with InvalidConfig, though PEFT trains it and the
engine serves it. A group of plain alternatives cannot backtrack badly; the equivalent class
form (`.*\\.[qv]_proj`) is accepted. Strict xfail until the adapter core accepts such groups:
when it does, this fails and the marker goes."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.adapters.errors import AdapterRejected
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import validate_adapter
from tests.adapters.crafting import TINY_BASE, lora_config, lora_tensors, write_adapter


def _validate(tmp: Path, pattern: str) -> list[str]:
    """The modules of an adapter on q_proj and v_proj whose config names them by `pattern`."""
    tensors = lora_tensors(TINY_BASE, 4, ("q_proj", "v_proj"))
    src = write_adapter(tmp, lora_config(4, target_modules=pattern), tensors)
    limits = AdapterLimits()
    with open_adapter_source(src, limits) as files:
        validated = validate_adapter(files, TINY_BASE, limits)
        modules = list(validated.target_modules)
        validated.close()
    return modules


def test_a_class_pattern_for_q_and_v_is_accepted(tmp_path: Path) -> None:
    assert sorted(_validate(tmp_path, r".*\.[qv]_proj")) == ["q_proj", "v_proj"]


@pytest.mark.xfail(
    strict=True, raises=AdapterRejected, reason="groups in target_modules: InvalidConfig"
)
def test_a_pattern_with_a_group_of_alternatives_as_peft_documents_is_accepted(
    tmp_path: Path,
) -> None:
    assert sorted(_validate(tmp_path, r".*\.(q_proj|v_proj)")) == ["q_proj", "v_proj"]
