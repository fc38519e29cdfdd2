"""Bad adapters uploaded over HTTP: 422 with the adapter core's reason code, store unchanged.

One sample per reason code from the adapter core's corpus (its builders make the files).
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest

from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME
from loraplane.controlplane.settings import Settings
from tests.adapters.test_bad_corpus import BASE as CORPUS_BASE
from tests.adapters.test_bad_corpus import CASES, Case
from tests.controlplane.conftest import BASE, Api
from tests.controlplane.test_adapters import store_files
from tests.factories import TRAINER_EXTRAS, build_trainer_checkpoint


def one_per_code() -> list[Case]:
    """The first corpus case of each reason code that needs no special limits."""
    seen: dict[str, Case] = {}
    for case in CASES:
        if case.limits == AdapterLimits() and case.code.value not in seen:
            seen[case.code.value] = case
    return list(seen.values())


SAMPLES = one_per_code()


def test_corpus_base_model_is_the_pools_base_model() -> None:
    assert (CORPUS_BASE.hidden_size, CORPUS_BASE.num_layers) == (BASE.hidden_size, BASE.num_layers)
    assert CORPUS_BASE.intermediate_size == BASE.intermediate_size
    assert len(SAMPLES) >= 11


@pytest.mark.parametrize("case", SAMPLES, ids=[c.id for c in SAMPLES])
def test_bad_adapter_is_422_with_its_reason_code_and_nothing_stored(
    ready: Api, settings: Settings, tmp_path: Path, case: Case
) -> None:
    key = ready.keys["acme"]
    assert ready.upload(key, "good", ready.adapter_dir(seed=1)).status_code == 201
    before = store_files(settings)
    build = tmp_path / "case"
    build.mkdir()
    source = case.build(build)
    r = ready.upload(key, "bad", source)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == case.code.value
    assert case.fragment in r.json()["error"]["message"]
    assert store_files(settings) == before
    assert (
        ready.client.get("/v1/adapters/bad", headers={"Authorization": f"Bearer {key}"}).status_code
        == 404
    )


# -- a transformers.Trainer checkpoint-* folder: accepted, its other files ignored and listed --


@pytest.fixture(scope="session")
def trainer_checkpoint(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Trainer's checkpoint-1 folder (a LoRA of a Llama of the pool's shapes)."""
    return build_trainer_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("trainer"))


def test_a_trainer_checkpoint_folder_uploads_and_its_extra_files_are_listed_as_ignored(
    ready: Api, settings: Settings, trainer_checkpoint: Path
) -> None:
    assert len(list(trainer_checkpoint.iterdir())) == 2 + len(TRAINER_EXTRAS)
    r = ready.upload(ready.keys["acme"], "trained", trainer_checkpoint)  # every file a part
    assert r.status_code == 201, r.text
    assert r.json()["ignored"] == list(TRAINER_EXTRAS)
    assert r.json()["version"]["rank"] == 4
    stored = sorted(f.name for f in store_files(settings) if "/trained/v1-" in str(f))
    assert stored == [CONFIG_NAME, WEIGHTS_NAME, "manifest.json"]


def test_a_trainer_checkpoint_archive_uploads_and_lists_what_was_ignored(
    ready: Api, tmp_path: Path, trainer_checkpoint: Path
) -> None:
    archive = tmp_path / "checkpoint-1.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(trainer_checkpoint, arcname="checkpoint-1")
    r = ready.upload(ready.keys["acme"], "trained", archive)
    assert r.status_code == 201, r.text
    assert r.json()["ignored"] == [f"checkpoint-1/{n}" for n in TRAINER_EXTRAS]
    again = ready.upload(ready.keys["acme"], "trained", trainer_checkpoint)  # same adapter
    assert again.status_code == 200, again.text
    assert again.json()["version"]["version"] == 1


def test_an_adapter_without_extra_files_lists_nothing_ignored(ready: Api) -> None:
    r = ready.upload(ready.keys["acme"], "plain", ready.adapter_dir())
    assert r.status_code == 201, r.text
    assert r.json()["ignored"] == []


def test_a_config_without_weights_says_the_weights_are_missing(
    ready: Api, settings: Settings, tmp_path: Path, trainer_checkpoint: Path
) -> None:
    before = store_files(settings)
    lone = tmp_path / CONFIG_NAME
    shutil.copy(trainer_checkpoint / CONFIG_NAME, lone)
    r = ready.upload(ready.keys["acme"], "half", lone)  # one file part: the config
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "UnsupportedFormat"
    assert error["message"].startswith(f"{CONFIG_NAME} alone holds no weights: send ")
    assert "neither an adapter folder" not in error["message"]
    folder = shutil.copytree(trainer_checkpoint, tmp_path / "no-weights")
    (folder / WEIGHTS_NAME).unlink()
    r = ready.upload(ready.keys["acme"], "half", folder)  # the checkpoint, less its weights
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].endswith(f"has no {WEIGHTS_NAME} beside {CONFIG_NAME}")
    assert store_files(settings) == before


def test_pickled_weights_in_a_checkpoint_stay_refused_by_name(
    ready: Api, tmp_path: Path, trainer_checkpoint: Path
) -> None:
    folder = shutil.copytree(trainer_checkpoint, tmp_path / "pickled")
    (folder / WEIGHTS_NAME).unlink()
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04")
    r = ready.upload(ready.keys["acme"], "pickled", folder)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "UnsupportedFormat"
    assert error["message"] == (
        "'adapter_model.bin' is a pickle file: pickled weights are never loaded; "
        f"save the adapter as {WEIGHTS_NAME} (safetensors)"
    )
