"""`loraplane adapters pin|unpin|pins` and `tenants update --max-pinned-bytes` against a real
control plane over HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from loraplane.adapters.base_model import BaseModelSpec
from tests.adapters.crafting import lora_config, lora_tensors, write_adapter
from tests.controlplane.conftest import SERVICE
from tests.test_tenant_cli import BASE_NAME, cli, controlplane, env, new_tenant

__all__ = ["controlplane", "env"]  # the fixtures, shared with tests/test_tenant_cli.py


def test_a_tenant_pins_lists_and_unpins_a_version_within_its_quota(
    env: pytest.MonkeyPatch,
    controlplane: str,
    capsys: pytest.CaptureFixture[str],
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    key = new_tenant(capsys, "pinner")
    spec = BaseModelSpec.from_dir(tiny_llama_dir, BASE_NAME)
    src = write_adapter(tmp_path / "a", lora_config(r=4), lora_tensors(spec, 4, seed=7))
    # a replica of pool-a reports: a pin needs live replicas to go on
    r = httpx.post(controlplane + "/internal/v1/pressure", json={"pool": "pool-a", "replica": "r0"},
                   headers={"Authorization": f"Bearer {SERVICE}"})  # fmt: skip
    assert r.status_code == 200, r.text
    env.setenv("LORAPLANE_API_KEY", key)
    pushed = cli(capsys, "adapters", "push", str(src), "--name", "bot", "--base-model", BASE_NAME)
    assert pushed.code == 0, pushed.err
    refused = cli(capsys, "adapters", "pin", "bot", "1", "--pool", "pool-a")
    assert refused.code == 1 and "max_pinned_bytes quota of 0" in refused.err
    env.delenv("LORAPLANE_API_KEY")
    granted = cli(capsys, "tenants", "update", "pinner", "--max-pinned-bytes", str(1 << 30))
    assert granted.code == 0, granted.err
    env.setenv("LORAPLANE_API_KEY", key)
    pinned = cli(capsys, "adapters", "pin", "bot", "v1", "--pool", "pool-a", "--json")
    assert pinned.code == 0, pinned.err
    assert pinned.json()["replicas"] == 1 and pinned.json()["version"] == 1
    listed = cli(capsys, "adapters", "pins")
    assert listed.code == 0 and "bot v1 on 1 replica(s) of pool default/pool-a" in listed.out
    assert "; held by 0 of 1" in listed.out and "refused" not in listed.out
    # the replica's next report: its engine would not keep it
    why = "refused: pinning bot would pin 3 adapters, more than its cap of 2"
    state = {"tenant": "pinner", "adapter": "bot", "digest": pinned.json()["digest"], "state": why}
    r = httpx.post(controlplane + "/internal/v1/pressure",
                   json={"pool": "pool-a", "replica": "r0", "pin_states": [state]},
                   headers={"Authorization": f"Bearer {SERVICE}"})  # fmt: skip
    assert r.status_code == 200, r.text
    listed = cli(capsys, "adapters", "pins")
    assert "; held by 0 of 1; refused by r0: pinning bot would pin 3 adapters" in listed.out
    gone = cli(capsys, "adapters", "unpin", "bot", "1", "--pool", "pool-a")
    assert gone.code == 0 and "unpinned: bot v1 on pool default/pool-a" in gone.out
    assert cli(capsys, "adapters", "pins").out.strip() == "no pinned versions"
