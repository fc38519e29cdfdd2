"""`loraplane adapters validate --base-model-dir DIR`: the folder whose config.json gives the
shapes. `--base-model` names a served base model elsewhere (`adapters push`), so for validate
it is only a deprecated alias that says so on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplane.cli import main
from tests.adapters.crafting import (
    TINY_BASE,
    TINY_BASE_CONFIG,
    lora_config,
    lora_tensors,
    write_adapter,
)


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_BASE_CONFIG))
    return folder


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_adapter(tmp_path / "good", lora_config(), lora_tensors(TINY_BASE, 8))


def test_base_model_dir_checks_the_shapes_without_a_warning(
    good: Path, base_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["adapters", "validate", str(good), "--base-model-dir", str(base_dir)]) == 0
    out = capsys.readouterr()
    assert "base model  base (shapes checked)" in out.out
    assert out.err == ""


def test_base_model_dir_refuses_an_adapter_of_another_shape(
    tmp_path: Path, base_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wide = json.loads(json.dumps(TINY_BASE_CONFIG)) | {"hidden_size": 128}
    (base_dir / "config.json").write_text(json.dumps(wide))
    bad = write_adapter(tmp_path / "bad", lora_config(), lora_tensors(TINY_BASE, 8))
    assert main(["adapters", "validate", str(bad), "--base-model-dir", str(base_dir)]) == 1
    assert capsys.readouterr().out.startswith("rejected: ShapeMismatch: ")


def test_the_old_flag_still_works_and_warns_on_stderr(
    good: Path, base_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["adapters", "validate", str(good), "--base-model", str(base_dir), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["valid"] is True  # stdout stays one JSON object
    assert "deprecated: use --base-model-dir DIR" in out.err


def test_an_error_names_the_flag_the_user_gave(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["adapters", "validate", str(good), "--base-model-dir", str(empty)]) == 2
    assert "error: --base-model-dir: " in capsys.readouterr().err
    assert main(["adapters", "validate", str(good), "--base-model", str(empty)]) == 2
    assert "error: --base-model: " in capsys.readouterr().err


def test_both_names_at_once_is_a_usage_error(
    good: Path, base_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["adapters", "validate", str(good), "--base-model-dir", str(base_dir)]
    assert main([*argv, "--base-model", str(base_dir)]) == 2
    assert "give --base-model-dir only" in capsys.readouterr().err


def test_help_shows_the_new_flag_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["adapters", "validate", "--help"])
    text = capsys.readouterr().out
    assert "--base-model-dir DIR" in text
    assert "--base-model " not in text.replace("--base-model-dir", "")
