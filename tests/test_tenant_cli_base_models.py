"""`loraplane adapters base-models`: a new tenant sees what it may push for, over real HTTP."""

from __future__ import annotations

import pytest

from tests.test_tenant_cli import BASE_NAME, cli, controlplane, env, new_tenant

__all__ = ["controlplane", "env"]  # the fixtures, shared with tests/test_tenant_cli.py


def test_a_new_tenant_lists_the_base_models_it_may_push_for(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(capsys, "tenants", "create", "initech", "--max-rank", "16").code == 0
    made = cli(capsys, "keys", "create", "--tenant", "initech", "--label", "ci", "--json")
    env.setenv("LORAPLANE_API_KEY", made.json()["key"])
    table = cli(capsys, "adapters", "base-models")
    assert table.code == 0, table.err
    header, row = table.out.splitlines()
    assert header.split() == ["BASE", "MODEL", "READY", "TYPE", "MAX", "RANK", "MAX", "SIZE"]
    assert row.split()[:4] == [BASE_NAME, "yes", "llama", "16"]
    listed = cli(capsys, "adapters", "base-models", "--json")
    assert [(o["name"], o["ready"], o["max_lora_rank"]) for o in listed.json()] == [
        (BASE_NAME, True, 16)
    ]


def test_base_models_needs_a_tenant_key(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = cli(capsys, "adapters", "base-models")
    assert run.code != 0 and "LORAPLANE_API_KEY" in run.err
    env.setenv("LORAPLANE_API_KEY", new_tenant(capsys, "hooli"))
    assert cli(capsys, "adapters", "base-models").code == 0
