"""The control plane and the operator from the images, run as the chart runs them: the control
plane answers /readyz and takes a tenant's upload (through the tenant CLI on this machine); the
operator without a cluster exits non-zero saying so; the slim image has no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.controlplane.conftest import ADMIN, SERVICE
from tests.image.conftest import container, docker, readable_copy, run_once
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[2]


def _cli(url: str, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    """`loraplane ARGS` on this machine (the tenant CLI) against the container's API."""
    env = {**os.environ, "LORAPLANE_URL": url, "LORAPLANE_ADMIN_TOKEN": ADMIN,
           "PYTHONPATH": str(REPO)}  # fmt: skip
    env.pop("LORAPLANE_API_KEY", None)
    if key:
        env["LORAPLANE_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "loraplane", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def test_the_control_plane_answers_readyz_and_takes_a_tenant_upload(
    any_image: str, tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    model = readable_copy(tiny_llama_dir, tmp_path / "model")
    port = free_port()
    # embedded mode on the writable /tmp: SQLite and the local store
    env = {"LORAPLANE_DATA_DIR": "/tmp/loraplane", "LORAPLANE_ADMIN_TOKEN": ADMIN,
           "LORAPLANE_SERVICE_TOKEN": SERVICE}  # fmt: skip
    args = ["controlplane", "--host", "127.0.0.1", "--port", str(port)]
    with container(any_image, args, env=env, mounts={model: "/models/tiny"}) as c:
        url = f"http://127.0.0.1:{port}"
        c.wait_http(url + "/readyz")
        assert httpx.get(url + "/readyz").json()
        pool = {"name": "pool-a", "base_model": {"name": "tiny-base", "uri": "/models/tiny"}}
        made = httpx.post(url + "/v1/pools", json=pool,
                          headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert made.status_code == 201, made.text

        assert _cli(url, "tenants", "create", "acme").returncode == 0
        keys = _cli(url, "keys", "create", "--tenant", "acme", "--label", "ci", "--json")
        assert keys.returncode == 0, keys.stderr
        key = json.loads(keys.stdout)["key"]
        pushed = _cli(url, "adapters", "push", str(peft_adapters["r16"]), "--name", "support",
                      "--base-model", "tiny-base", key=key)  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr + c.logs()[-3000:]
        assert pushed.stdout.startswith("pushed: support v1 (new version)\n")
        listed = _cli(url, "adapters", "list", "--json", key=key)
        assert listed.returncode == 0, listed.stderr
        assert "support" in listed.stdout
        # the catalog and the adapter's files went to /tmp, the only writable place
        stored = subprocess.run([docker(), "exec", c.name, "find", "/tmp/loraplane", "-type",
                                 "f"], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "controlplane.db" in stored.stdout
        assert "adapter_model.safetensors" in stored.stdout or ".safetensors" in stored.stdout


def test_the_operator_without_a_cluster_exits_non_zero_and_says_why_in_a_line(
    any_image: str,
) -> None:
    env = {"LORAPLANE_CONTROLPLANE_URL": "http://127.0.0.1:9", "LORAPLANE_SERVICE_TOKEN": SERVICE}
    done = run_once(any_image, ["operator", "--all-namespaces"], env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "no Kubernetes credentials (in-cluster or KUBECONFIG)" in done.stderr, out
    assert "Traceback" not in out and len(out.strip().splitlines()) <= 3, out


def test_the_slim_image_has_no_torch_and_both_run_as_uid_10001_offline(
    slim_image: str, full_image: str
) -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch') is not None)"
    for image, has_torch in ((slim_image, "False"), (full_image, "True")):
        done = run_once(image, ["-c", probe], entrypoint="python3")
        assert (done.returncode, done.stdout.strip()) == (0, has_torch), done.stderr
        config = subprocess.run([docker(), "image", "inspect", "-f", "{{json .Config}}", image],
                                capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        cfg = json.loads(config.stdout)
        assert cfg["User"] == "10001" and cfg["Entrypoint"] == ["loraplane"]
        assert "HF_HUB_OFFLINE=1" in cfg["Env"] and "HOME=/tmp" in cfg["Env"]


@pytest.mark.parametrize("command", [["--help"], ["controlplane", "--help"]])
def test_the_slim_image_runs_the_cli(slim_image: str, command: list[str]) -> None:
    done = run_once(slim_image, command)
    assert done.returncode == 0 and "usage: loraplane" in done.stdout, done.stderr
