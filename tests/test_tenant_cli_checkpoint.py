"""`loraplane adapters push` of a transformers.Trainer checkpoint-* folder: the adapter is sent,
the Trainer's other files stay on disk and are listed as ignored (text and --json)."""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.test_tenant_cli as tenant_cli
from tests.factories import TRAINER_EXTRAS, build_trainer_checkpoint

# the tenant CLI tests' control plane (over HTTP, a pool serving the tiny Llama) and env
controlplane = tenant_cli.controlplane
env = tenant_cli.env


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_trainer_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("trainer"))


def test_push_of_a_trainer_checkpoint_lists_the_ignored_files(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], checkpoint: Path
) -> None:
    env.setenv("LORAPLANE_API_KEY", tenant_cli.new_tenant(capsys, "trainer"))
    args = ("adapters", "push", str(checkpoint), "--name", "tuned", "--base-model")
    pushed = tenant_cli.cli(capsys, *args, tenant_cli.BASE_NAME)
    assert pushed.code == 0, pushed.err
    assert pushed.out.startswith("pushed: tuned v1 (new version)\n")
    assert f"  ignored     {', '.join(TRAINER_EXTRAS)} (not sent)\n" in pushed.out
    again = tenant_cli.cli(capsys, *args, tenant_cli.BASE_NAME, "--json")
    assert again.code == 0, again.err
    assert again.json()["ignored"] == list(TRAINER_EXTRAS)
    assert again.json()["created"] is False
