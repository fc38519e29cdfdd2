"""The chart ships the repository's CRDs as templates (so `helm upgrade` applies them), kept on
uninstall, with no drift from `crds/` (the operator's generated source)."""

from __future__ import annotations

from typing import Any

import yaml

from loraplane.operator import crds
from tests.charts.render import CHART, ROOT, find, helm, render

CHART_CRDS = CHART / "files" / "crds"
HELM_LABELS = {
    "helm.sh/chart",
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
}


def test_chart_crd_files_are_byte_copies_of_the_repository_crds() -> None:
    names = sorted(p.name for p in CHART_CRDS.glob("*.yaml"))
    assert names == sorted(crds.FILES)
    for name in names:
        assert (CHART_CRDS / name).read_text() == (ROOT / "crds" / name).read_text(), (
            f"charts/loraplane/files/crds/{name} drifted: run "
            "`loraplane operator crds --output-dir charts/loraplane/files/crds`"
        )


def _strip_release_metadata(crd: dict[str, Any]) -> dict[str, Any]:
    meta = crd["metadata"]
    meta["labels"] = {k: v for k, v in meta["labels"].items() if k not in HELM_LABELS}
    annotations = meta.pop("annotations", {})
    assert annotations == {"helm.sh/resource-policy": "keep"}
    return crd


def test_rendered_crds_equal_the_repository_crds_plus_release_metadata() -> None:
    rendered = {
        d["metadata"]["name"]: _strip_release_metadata(d)
        for d in find(render(), "CustomResourceDefinition")
    }
    repo = {}
    for name in crds.FILES:
        doc = yaml.safe_load((ROOT / "crds" / name).read_text())
        repo[doc["metadata"]["name"]] = doc
    assert rendered == repo


def test_crds_are_templates_not_the_never_upgraded_crds_folder() -> None:
    with helm.Chart.load(CHART) as chart:
        assert chart.crds == []  # Helm installs crds/ once and never upgrades it
        templates = {t["name"] for t in chart.templates}
    assert "templates/crds.yaml" in templates


def test_crds_can_be_left_to_someone_else_or_deleted_on_uninstall() -> None:
    assert not find(render({"crds": {"install": False}}), "CustomResourceDefinition")
    for crd in find(render({"crds": {"keep": False}}), "CustomResourceDefinition"):
        assert "annotations" not in crd["metadata"]
