"""The CRDs: generated from one source (no drift), valid manifests, and every example resource
valid against them; `kubectl apply -f examples/` works against the API emulator."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from loraplane.operator import crds
from tests.operator.emulator import running_emulator

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {
    ("loraplane.io/v1alpha1", "LoRAAdapter"): crds.adapter_schema(),
    ("loraplane.io/v1alpha1", "ServingPool"): crds.pool_schema(),
}
# GitOps tool kinds: not served by a plain cluster, checked by their own tools
FOREIGN = {"Kustomization", "Application", "AppProject"}


def _docs(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path, doc))
    return out


EXAMPLES = _docs(sorted((ROOT / "examples").rglob("*.yaml")))


def test_committed_crd_files_match_the_generator() -> None:
    for name, text in crds.rendered_files().items():
        committed = (ROOT / "crds" / name).read_text()
        assert committed == text, (
            f"crds/{name} drifted: run `loraplane operator crds --output-dir crds`"
        )
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == sorted(crds.FILES)


@pytest.mark.parametrize("name", sorted(crds.FILES))
def test_crd_manifest_passes_kubernetes_validate_strict(name: str) -> None:
    doc = yaml.safe_load((ROOT / "crds" / name).read_text())
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_crds_declare_status_subresource_columns_and_immutability() -> None:
    adapter, pool = crds.all_crds()
    version = adapter["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Base", "Rank", "Version", "Phase", "Age"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["baseModel"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    pool_spec = pool["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert pool_spec["properties"]["baseModel"]["x-kubernetes-validations"][0]["rule"] == (
        "self == oldSelf"
    )
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Validating", "Ready", "Rejected", "Failed"]


@pytest.mark.parametrize(
    ("path", "doc"),
    EXAMPLES,
    ids=[f"{p.name}:{d['kind']}:{d.get('metadata', {}).get('name')}" for p, d in EXAMPLES],
)
def test_example_resource_is_valid(path: Path, doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in SCHEMAS:
        jsonschema.Draft4Validator(SCHEMAS[key]).validate(doc)
    elif doc["kind"] not in FOREIGN:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_examples_cover_rbac_adapter_pool_and_gitops() -> None:
    kinds = {d["kind"] for _, d in EXAMPLES}
    assert {"Namespace", "Role", "RoleBinding", "LoRAAdapter", "ServingPool"} <= kinds
    assert {"Kustomization", "Application"} <= kinds


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"baseModel": "bad model name"}, "baseModel"),
        ({"source": {"uri": "file:///etc/passwd"}}, "uri"),
        ({"source": {"uri": "s3://bucket/k", "secretRef": {}}}, "name"),
        ({"servedName": "Has_Upper"}, "servedName"),
    ],
)
def test_schema_refuses_bad_adapter_specs(change: dict[str, Any], where: str) -> None:
    doc = {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": "x"},
        "spec": {"baseModel": "tiny", "source": {"uri": "s3://bucket/key"}, **change},
    }
    with pytest.raises(jsonschema.ValidationError) as info:
        jsonschema.Draft4Validator(SCHEMAS[("loraplane.io/v1alpha1", "LoRAAdapter")]).validate(doc)
    assert where in str(info.value)


@pytest.mark.k8s
def test_kubectl_apply_examples_against_the_emulator(tmp_path: Path) -> None:
    with running_emulator() as emulator:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emu", "cluster": {"server": emulator.url}}],
                    "users": [{"name": "u", "user": {"token": "test"}}],
                    "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u"}}],
                    "current-context": "emu",
                }
            )
        )
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}
        for _ in range(2):  # a second apply changes nothing and still succeeds
            result = subprocess.run(
                ["kubectl", "apply", "--validate=false", "-f", str(ROOT / "examples")],
                capture_output=True, text=True, env=env, timeout=60, check=False,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
        assert "loraadapter.loraplane.io/support-bot" in result.stdout
        assert "servingpool.loraplane.io/llama-3-8b" in result.stdout
        listed = subprocess.run(
            ["kubectl", "get", "loraadapters", "-n", "team-a", "-o", "name"],
            capture_output=True, text=True, env=env, timeout=60, check=False,
        )  # fmt: skip
        assert listed.stdout.split() == ["loraadapter.loraplane.io/support-bot"]
