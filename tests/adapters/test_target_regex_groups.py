"""`target_modules` given as a regex with a group of alternatives, as PEFT's own documentation
writes them (`r".*\\.(q_proj|v_proj)"`), is accepted; a group that could backtrack badly (nested,
quantified, or with a quantifier inside) stays refused with InvalidConfig naming what is allowed."""

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


@pytest.mark.parametrize(
    "pattern",
    [r".*\.(q_proj|v_proj)", r".*\.(?:q|v)_proj", r"model\.layers\.[0-9]\.self_attn\.(q|v)_proj"],
)
def test_a_pattern_with_a_group_of_alternatives_as_peft_documents_is_accepted(
    tmp_path: Path, pattern: str
) -> None:
    assert sorted(_validate(tmp_path, pattern)) == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "pattern",
    [r".*\.(q_proj|v_proj)+", r".*\.((q|v)_proj)", r".*\.(q.*|v_proj)", r".*\.(q|v){1}_proj"],
)
def test_a_group_that_could_backtrack_is_refused_naming_what_is_allowed(
    tmp_path: Path, pattern: str
) -> None:
    with pytest.raises(AdapterRejected) as info:
        _validate(tmp_path, pattern)
    assert info.value.code == "InvalidConfig"
    assert "groups of plain alternatives such as (q_proj|v_proj)" in str(info.value)
