"""The operator gives each data-plane pod a folder for its usage spool that outlives a crashed
container (an emptyDir), and points the data plane's setting at it."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.dataplane.server.settings import ServerSettings
from loraplane.operator import manifests
from loraplane.operator.specs import PoolSpec

POOL = {"baseModel": {"name": "tiny", "uri": "/models/tiny"}, "image": "img:1"}


def test_pods_spool_undelivered_usage_on_an_emptydir(monkeypatch: pytest.MonkeyPatch) -> None:
    dep = manifests.deployment("p", "ns", PoolSpec.parse(POOL), controlplane_url="http://cp",
                               replicas=1)  # fmt: skip
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    folder = env["LORAPLANE_USAGE_SPOOL_DIR"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == folder)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume  # survives a container restart, goes with the pod
    monkeypatch.setenv("LORAPLANE_USAGE_SPOOL_DIR", folder)  # what the data plane reads
    assert ServerSettings.load(model="/models/tiny").usage_spool_dir == Path(folder)
