"""values.schema.json: the defaults pass, and mistakes fail at `helm install`, naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.render import CHART, SCENARIOS, helm, render

BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "typo'd top-level key": ({"controlplan": {"replicas": 2}}, "controlplan"),
    "typo'd nested key": ({"operator": {"watchNamespace": ["a"]}}, "watchNamespace"),
    "replicas as text": ({"controlplane": {"replicas": "two"}}, "/controlplane/replicas"),
    "negative replicas": ({"controlplane": {"replicas": -1}}, "/controlplane/replicas"),
    "weak admin token": ({"tokens": {"admin": "short"}}, "/tokens/admin"),
    "unknown pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "digest without sha256": ({"image": {"digest": "latest"}}, "/image/digest"),
    "relative store path": ({"store": {"uri": "store"}}, "/store/uri"),
    "database URL not PostgreSQL": ({"database": {"url": "mysql://h/db"}}, "/database/url"),
    "bad namespace name": ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watch"),
    "crds.install as text": ({"crds": {"install": "yes"}}, "/crds/install"),
    "bad scrape interval": (
        {"monitoring": {"serviceMonitor": {"interval": "often"}}},
        "/monitoring/serviceMonitor/interval",
    ),
    "env without a name": ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv"),
    "unknown service type": ({"controlplane": {"service": {"type": "Ingress"}}}, "/service/type"),
    "liveness on a privileged port": ({"operator": {"livenessPort": 80}}, "/livenessPort"),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_values_pass_the_schema(name: str) -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values(SCENARIOS[name]))


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_rejects_bad_values(case: str) -> None:
    values, where = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    assert where.split("/")[-1] in str(info.value), info.value


def test_several_control_plane_replicas_need_postgresql() -> None:
    with pytest.raises(helm.HelmError, match="needs PostgreSQL"):
        render({"controlplane": {"replicas": 2}})


def test_schema_is_strict_everywhere_it_describes_an_object() -> None:
    with helm.Chart.load(CHART) as chart:
        schema = chart.schema
    assert schema is not None

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if props is not None:
                assert node.get("additionalProperties") is False, f"{path} is open"
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(schema, "")
