"""A transformers.Trainer checkpoint-* folder is an adapter: its other files are ignored.

The folder is made by a real Trainer (one CPU step of a seeded tiny Llama's LoRA), so the
file set is what users upload; the Trainer's pickles must never be opened, pickled weights
stay refused by name.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME, open_adapter_source
from loraplane.adapters.validate import validate_adapter
from tests.factories import TRAINER_EXTRAS, build_trainer_checkpoint


@pytest.fixture(scope="session")
def trainer_checkpoint(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Trainer's checkpoint-1 folder of a LoRA of the tiny Llama."""
    return build_trainer_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("trainer"))


def tar_of(folder: Path, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    return out


def test_the_trainer_leaves_its_artefacts_beside_the_adapter(trainer_checkpoint: Path) -> None:
    names = sorted(p.name for p in trainer_checkpoint.iterdir())
    assert names == sorted([CONFIG_NAME, WEIGHTS_NAME, *TRAINER_EXTRAS])


def test_a_checkpoint_folder_validates_and_lists_what_is_ignored(
    trainer_checkpoint: Path, tiny_llama_dir: Path
) -> None:
    base = BaseModelSpec.from_dir(tiny_llama_dir)
    with open_adapter_source(trainer_checkpoint, AdapterLimits()) as files:
        assert files.ignored == TRAINER_EXTRAS
        adapter = validate_adapter(files, base, AdapterLimits())
        assert adapter.summary()["rank"] == 4
        adapter.close()


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_a_checkpoint_archive_validates_and_only_the_adapter_is_extracted(
    trainer_checkpoint: Path, tmp_path: Path, kind: str
) -> None:
    if kind == "tar":
        archive = tar_of(trainer_checkpoint, tmp_path / "checkpoint-1.tar.gz")
    else:
        archive = tmp_path / "checkpoint-1.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            for p in trainer_checkpoint.iterdir():
                zf.write(p, f"checkpoint-1/{p.name}")
    with open_adapter_source(archive, AdapterLimits()) as files:
        assert files.ignored == tuple(f"checkpoint-1/{n}" for n in TRAINER_EXTRAS)
        assert sorted(p.name for p in files.config_path.parent.iterdir()) == [
            CONFIG_NAME,
            WEIGHTS_NAME,
        ]
        validate_adapter(files, None, AdapterLimits()).close()


def test_the_trainers_pickles_are_never_unpickled(trainer_checkpoint: Path, tmp_path: Path) -> None:
    # a pickle that would run code if it were loaded: the folder still validates
    folder = shutil.copytree(trainer_checkpoint, tmp_path / "checkpoint-1")
    marker = tmp_path / "unpickled"
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    for name in ("training_args.bin", "optimizer.pt", "rng_state.pth", "scheduler.pt"):
        (folder / name).write_bytes(payload)
    (folder / "rng_state_1.pth").write_bytes(payload)  # a second process's RNG state
    with open_adapter_source(folder, AdapterLimits()) as files:
        validate_adapter(files, None, AdapterLimits()).close()
        assert "rng_state_1.pth" in files.ignored
    assert not marker.exists()


@pytest.mark.parametrize("weights", ["adapter_model.bin", "pytorch_model.bin"])
def test_pickled_weights_without_safetensors_are_refused_by_name(
    trainer_checkpoint: Path, tmp_path: Path, weights: str
) -> None:
    folder = shutil.copytree(trainer_checkpoint, tmp_path / "checkpoint-1")
    (folder / WEIGHTS_NAME).unlink()
    (folder / weights).write_bytes(b"\x80\x04")
    with pytest.raises(AdapterRejected) as caught, open_adapter_source(folder, AdapterLimits()):
        pass
    assert caught.value.code == ReasonCode.UNSUPPORTED_FORMAT
    assert caught.value.message == (
        f"{weights!r} is a pickle file: pickled weights are never loaded; "
        f"save the adapter as {WEIGHTS_NAME} (safetensors)"
    )


def test_pickled_weights_beside_safetensors_are_refused_by_name(
    trainer_checkpoint: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(trainer_checkpoint, tmp_path / "checkpoint-1")
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(AdapterRejected) as caught, open_adapter_source(folder, AdapterLimits()):
        pass
    assert "'adapter_model.bin' is a pickle file" in caught.value.message
    assert f"the {WEIGHTS_NAME} beside it is what is served" in caught.value.message


def test_a_checkpoint_without_weights_names_the_missing_file(
    trainer_checkpoint: Path, tmp_path: Path
) -> None:
    folder = shutil.copytree(trainer_checkpoint, tmp_path / "checkpoint-1")
    (folder / WEIGHTS_NAME).unlink()
    with pytest.raises(AdapterRejected) as caught, open_adapter_source(folder, AdapterLimits()):
        pass
    assert caught.value.message == f"{folder} has no {WEIGHTS_NAME} beside {CONFIG_NAME}"


def test_a_lone_config_or_weights_file_says_what_is_missing(
    trainer_checkpoint: Path, tmp_path: Path
) -> None:
    for name, code, said in (
        (CONFIG_NAME, ReasonCode.UNSUPPORTED_FORMAT, f"{CONFIG_NAME} alone holds no weights"),
        (WEIGHTS_NAME, ReasonCode.INVALID_CONFIG, f"{WEIGHTS_NAME} alone has no {CONFIG_NAME}"),
    ):
        lone = tmp_path / name
        shutil.copy(trainer_checkpoint / name, lone)
        with pytest.raises(AdapterRejected) as caught, open_adapter_source(lone, AdapterLimits()):
            pass
        assert caught.value.code == code
        assert caught.value.message.startswith(said), caught.value.message
        assert "neither an adapter folder" not in caught.value.message


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loraplane", *args], capture_output=True, text=True, timeout=120
    )


def test_adapters_validate_accepts_a_checkpoint_and_lists_the_ignored_files(
    trainer_checkpoint: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = run_cli(
        "adapters", "validate", str(trainer_checkpoint), "--base-model", str(tiny_llama_dir)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"valid: {trainer_checkpoint}\n")
    assert f"  ignored     {', '.join(TRAINER_EXTRAS)} (never opened)\n" in out.stdout
    archive = tar_of(trainer_checkpoint, tmp_path / "c.tar.gz")
    as_json = run_cli("adapters", "validate", str(archive), "--json")
    assert as_json.returncode == 0, as_json.stdout
    body = json.loads(io.StringIO(as_json.stdout).readline())
    assert body["valid"] is True
    assert body["ignored"] == [f"checkpoint-1/{n}" for n in TRAINER_EXTRAS]
