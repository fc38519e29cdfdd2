"""The chart renders, lints clean, and every manifest is a valid Kubernetes object whose
containers run commands the `loraplane` CLI parses, with settings its components read."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from loraplane.cli import build_parser
from loraplane.controlplane.settings import Settings
from loraplane.operator.settings import OperatorSettings
from tests.charts.render import (
    ADMIN,
    CHART,
    CHART_SECRETS,
    CLUSTER_MODE,
    NAMESPACE,
    PRODUCTION,
    RELEASE,
    SCENARIOS,
    Manifest,
    find,
    helm,
    one,
    pod_specs,
    render,
    render_texts,
)

FULL = f"{RELEASE}-loraplane"
# Kinds kubernetes-validate has no schema for (they are not built into Kubernetes); their
# structure is checked by the tests below instead.
NOT_BUILT_IN = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),  # tests/charts/test_routing.py
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
# The oldest (Chart.yaml kubeVersion) and the newest Kubernetes kubernetes-validate knows.
KUBE_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
CONTROLPLANE_ENV = {f"LORAPLANE_{name.upper()}" for name in Settings.model_fields}
OPERATOR_ENV = {f"LORAPLANE_{f.name.upper()}" for f in dataclasses.fields(OperatorSettings)}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    name: str = request.param
    return name, render(SCENARIOS[name])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_chart_lints_clean(name: str) -> None:
    report = helm.lint(CHART, SCENARIOS[name], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_every_manifest_passes_kubernetes_validate_strict(
    scenario: tuple[str, list[Manifest]],
) -> None:
    name, docs = scenario
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    assert ("apiextensions.k8s.io/v1", "CustomResourceDefinition") in kinds
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in NOT_BUILT_IN:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} ({version}): {exc}")


def test_every_resource_is_namespaced_to_the_release_or_cluster_scoped(
    scenario: tuple[str, list[Manifest]],
) -> None:
    name, docs = scenario
    cluster_scoped = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    # the data plane's NetworkPolicies go to the namespaces holding ServingPools
    pools = SCENARIOS[name].get("networkPolicy", {}).get("dataplane", {}).get("namespaces")
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] in cluster_scoped:
            assert "namespace" not in meta
        elif doc["kind"] == "NetworkPolicy" and meta["name"] == f"{FULL}-dataplane":
            assert meta["namespace"] in (pools or [NAMESPACE]), meta
        elif doc["kind"] not in ("Role", "RoleBinding"):
            assert meta["namespace"] == NAMESPACE, meta
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE


def _parse(container: dict[str, Any]) -> argparse.Namespace:
    assert container["command"] == ["loraplane"], container["command"]
    try:
        return build_parser().parse_args(container["args"])
    except SystemExit:
        pytest.fail(f"`loraplane {' '.join(container['args'])}` does not parse")


def test_containers_run_loraplane_commands_that_parse(
    scenario: tuple[str, list[Manifest]],
) -> None:
    _, docs = scenario
    expected = {
        f"{FULL}-controlplane": ("loraplane.controlplane.cli", "_serve"),
        f"{FULL}-operator": ("loraplane.operator.cli", "run_operator"),
        f"{FULL}-migrations": ("loraplane.controlplane.cli", "_migrate"),
    }
    seen = set()
    for workload, pod in pod_specs(docs):
        (container,) = pod["containers"]
        args = _parse(container)
        name = workload["metadata"]["name"]
        assert (args.func.__module__, args.func.__name__) == expected[name]
        seen.add(name)
        if name.endswith("-controlplane"):
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert (args.host, args.port) == ("0.0.0.0", ports["http"])
            assert args.internal_port == ports["internal"]  # internal routes, /metrics
        if name.endswith("-operator"):
            # the liveness probe asks Kopf's --liveness endpoint; metrics on their own port
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert args.liveness == f"http://0.0.0.0:{ports['liveness']}/healthz"
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert (args.metrics_host, args.metrics_port) == ("0.0.0.0", ports["metrics"])
    assert {f"{FULL}-controlplane", f"{FULL}-operator"} <= seen


def test_environment_variables_are_settings_the_components_read(
    scenario: tuple[str, list[Manifest]],
) -> None:
    _, docs = scenario
    for workload, pod in pod_specs(docs):
        (container,) = pod["containers"]
        known = (
            OPERATOR_ENV
            if workload["metadata"]["name"].endswith("-operator")
            else (CONTROLPLANE_ENV)
        )
        names = [e["name"] for e in container["env"]]
        assert len(names) == len(set(names)), f"duplicate env: {names}"
        unknown = {n for n in names if n.startswith("LORAPLANE_")} - known
        assert not unknown, f"{workload['metadata']['name']}: {unknown} are not settings"


def test_secrets_the_pods_read_are_rendered_or_named_in_values(
    scenario: tuple[str, list[Manifest]],
) -> None:
    name, docs = scenario
    rendered = {d["metadata"]["name"]: d for d in find(docs, "Secret")}
    uses_existing = name in ("production", "cluster-mode")
    existing = {"loraplane-tokens", "loraplane-db", "loraplane-s3"} if uses_existing else set()
    for workload, pod in pod_specs(docs):
        (container,) = pod["containers"]
        for env in container["env"]:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                continue
            if ref["name"] in existing:
                continue
            secret = rendered.get(ref["name"])
            assert secret is not None, f"{workload['metadata']['name']} reads {ref}"
            assert ref["key"] in secret["data"]
        for source in container.get("envFrom", []):
            assert source["secretRef"]["name"] in existing


def test_pods_run_non_root_with_read_only_root_filesystems_resources_and_probes(
    scenario: tuple[str, list[Manifest]],
) -> None:
    name, docs = scenario
    for workload, pod in pod_specs(docs):
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
        if workload["kind"] == "Deployment":
            assert container["livenessProbe"]
        if workload["metadata"]["name"] == f"{FULL}-controlplane":
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            # only cluster mode calls the Kubernetes API (it creates LoRAAdapters)
            assert pod["automountServiceAccountToken"] is (name == "cluster-mode")


def test_default_install_uses_the_app_version_image_sqlite_and_no_migrations_job() -> None:
    docs = render()
    with helm.Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    for _, pod in pod_specs(docs):
        assert pod["containers"][0]["image"] == f"ghcr.io/loraplane/loraplane:{app_version}"
    cp = one(docs, "Deployment", f"{FULL}-controlplane")
    env = {e["name"] for e in cp["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "LORAPLANE_DATABASE_URL" not in env  # SQLite on the data volume
    assert cp["spec"]["strategy"]["type"] == "Recreate"
    assert not find(docs, "Job")
    assert not find(docs, "ServiceMonitor")
    # generated tokens are strong enough for the control plane's start-up check
    tokens = one(docs, "Secret", f"{FULL}-tokens")
    for value in tokens["data"].values():
        assert len(base64.b64decode(value)) >= 32


def test_operator_runs_once_standalone_with_recreate() -> None:
    op = one(render(), "Deployment", f"{FULL}-operator")
    assert op["spec"]["replicas"] == 1
    assert op["spec"]["strategy"]["type"] == "Recreate"
    env = {e["name"]: e for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    # the operator (and the data plane replicas it starts) call the internal port
    url = env["LORAPLANE_CONTROLPLANE_URL"]["value"]
    assert url == f"http://{FULL}-controlplane-internal.{NAMESPACE}.svc:8081"
    service = one(render(), "Service", f"{FULL}-controlplane")
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("http", 8080)]
    internal = one(render(), "Service", f"{FULL}-controlplane-internal")
    assert [(p["name"], p["port"]) for p in internal["spec"]["ports"]] == [("internal", 8081)]


def test_production_values_wire_the_database_secret_replicas_and_monitoring() -> None:
    docs = render(PRODUCTION)
    cp = one(docs, "Deployment", f"{FULL}-controlplane")
    assert cp["spec"]["replicas"] == 3
    assert "strategy" not in cp["spec"]  # rolling updates with PostgreSQL
    container = cp["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["LORAPLANE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "loraplane-db",
        "key": "url",
    }
    assert env["LORAPLANE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "loraplane-tokens"
    assert env["LORAPLANE_STORE"]["value"] == "s3://loraplane-adapters/prod"
    assert container["image"] == "ghcr.io/loraplane/loraplane:1.2.3"
    assert not find(docs, "Secret")  # every Secret is an existing one
    assert one(docs, "PodDisruptionBudget", f"{FULL}-controlplane")
    job = one(docs, "Job", f"{FULL}-migrations")
    job_env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert job_env[0]["valueFrom"]["secretKeyRef"] == {"name": "loraplane-db", "key": "url"}
    monitors = {m["metadata"]["name"]: m for m in find(docs, "ServiceMonitor")}
    assert set(monitors) == {f"{FULL}-controlplane", f"{FULL}-operator"}
    ports = {f"{FULL}-controlplane": "internal", f"{FULL}-operator": "metrics"}
    for name, monitor in monitors.items():
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (endpoint,) = monitor["spec"]["endpoints"]
        assert (endpoint["port"], endpoint["path"]) == (ports[name], "/metrics")
    pod_monitor = one(docs, "PodMonitor", f"{FULL}-dataplane")
    assert pod_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # the control plane's metrics: its internal Service only (the public port answers 404)
    cp_selector = monitors[f"{FULL}-controlplane"]["spec"]["selector"]["matchLabels"]
    internal = one(docs, "Service", f"{FULL}-controlplane-internal")
    assert cp_selector.items() <= internal["metadata"]["labels"].items()
    assert internal["spec"]["ports"][0]["name"] == "internal"
    service = one(docs, "Service", f"{FULL}-controlplane")
    assert not cp_selector.items() <= service["metadata"]["labels"].items()
    # The operator's monitor selects its metrics Service, whose port reaches the container's.
    op_selector = monitors[f"{FULL}-operator"]["spec"]["selector"]["matchLabels"]
    op_service = one(docs, "Service", f"{FULL}-operator-metrics")
    assert op_selector.items() <= op_service["metadata"]["labels"].items()
    operator = one(docs, "Deployment", f"{FULL}-operator")
    pod_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert op_service["spec"]["selector"].items() <= pod_labels.items()
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert op_service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert (
        str(container_ports["metrics"])
        == container["args"][container["args"].index("--metrics-port") + 1]
    )


def test_dataplane_pod_monitor_scrapes_the_metrics_port_of_the_pods_the_operator_builds() -> None:
    from loraplane.operator import manifests
    from loraplane.operator.specs import PoolSpec
    from tests.operator.conftest import pool_body

    monitor = one(render(PRODUCTION), "PodMonitor", f"{FULL}-dataplane")
    spec = PoolSpec.parse(pool_body("llama-3-8b", Path("/models/llama"))["spec"])
    deployment = manifests.deployment("llama-3-8b", "loraplane-system", spec,
                                      controlplane_url="http://cp:8081", replicas=1)  # fmt: skip
    pod = deployment["spec"]["template"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert endpoint["port"] == "metrics"
    assert str(ports["metrics"]) == container["args"][container["args"].index("--metrics-port") + 1]
    # the pool's Service (what tenants reach) does not expose the metrics port
    service = manifests.service("llama-3-8b", "loraplane-system")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # dashboards select on `pool`, relabelled from the pod's loraplane.io/pool label
    (relabel,) = endpoint["relabelings"]
    assert relabel["targetLabel"] == "pool"
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_loraplane_io_pool"]
    assert "loraplane.io/pool" in pod["metadata"]["labels"]


def test_migrations_job_is_a_pre_install_and_pre_upgrade_hook() -> None:
    docs = render(CHART_SECRETS)
    job = one(docs, "Job", f"{FULL}-migrations")
    hook_secret = one(docs, "Secret", f"{FULL}-database-migrations")
    for doc in (job, hook_secret):
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    # the Secret the Job reads exists before the Job (hooks run by ascending weight)
    weight = int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert int(hook_secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < weight
    ref = job["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == hook_secret["metadata"]["name"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # the release's own database Secret carries the same URL for the Deployment
    url = base64.b64decode(one(docs, "Secret", f"{FULL}-database")["data"]["database-url"])
    assert base64.b64decode(hook_secret["data"]["database-url"]) == url
    tokens = one(docs, "Secret", f"{FULL}-tokens")
    assert base64.b64decode(tokens["data"]["admin-token"]).decode() == ADMIN


def test_migrations_can_be_turned_off() -> None:
    docs = render({**CHART_SECRETS, "migrations": {"enabled": False}})
    assert not find(docs, "Job")
    assert not find(docs, "Secret", f"{FULL}-database-migrations")


def _rules(role: Manifest) -> set[tuple[str, str, str]]:
    out = set()
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out


OPERATOR_RULES = (
    {("loraplane.io", "loraadapters", verb) for verb in ("get", "list", "watch", "patch")}
    | {("loraplane.io", "servingpools", verb) for verb in ("get", "list", "watch", "patch")}
    | {
        ("loraplane.io", "loraadapters/status", "patch"),
        ("loraplane.io", "servingpools/status", "patch"),
        ("loraplane.io", "servingpools/finalizers", "update"),
        ("apps", "deployments", "get"),
        ("apps", "deployments", "create"),
        ("apps", "deployments", "patch"),
        ("", "services", "get"),
        ("", "services", "create"),
        ("", "services", "patch"),
        *(
            ("inference.networking.k8s.io", "inferencepools", verb)
            for verb in ("get", "create", "patch", "delete")
        ),
        ("", "secrets", "get"),
        ("", "events", "create"),
    }
)
CRD_DISCOVERY = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}


def test_operator_rbac_all_namespaces_is_exactly_what_it_uses() -> None:
    docs = render()
    (role,) = find(docs, "ClusterRole")
    assert _rules(role) == OPERATOR_RULES | CRD_DISCOVERY
    assert not any("*" in part for rule in _rules(role) for part in rule)
    assert not find(docs, "Role")
    (binding,) = find(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{FULL}-operator", "namespace": NAMESPACE}
    ]
    op = one(docs, "Deployment", f"{FULL}-operator")
    assert op["spec"]["template"]["spec"]["serviceAccountName"] == f"{FULL}-operator"
    assert "--all-namespaces" in op["spec"]["template"]["spec"]["containers"][0]["args"]


def test_operator_rbac_listed_namespaces_gets_a_role_in_each() -> None:
    docs = render(PRODUCTION)
    namespaces = PRODUCTION["operator"]["watchNamespaces"]
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces)
    for role in roles:
        assert _rules(role) == OPERATOR_RULES
    bindings = find(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces)
    (cluster_role,) = find(docs, "ClusterRole")
    assert _rules(cluster_role) == CRD_DISCOVERY
    args = one(docs, "Deployment", f"{FULL}-operator")["spec"]["template"]["spec"]
    parsed = _parse(args["containers"][0])
    assert parsed.namespace == namespaces and not parsed.all_namespaces


def test_control_plane_gets_no_kubernetes_api_access() -> None:
    docs = render(PRODUCTION)
    subjects = [
        s["name"]
        for b in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding")
        for s in b["subjects"]
    ]
    assert f"{FULL}-controlplane" not in subjects
    sa = one(docs, "ServiceAccount", f"{FULL}-controlplane")
    assert sa["automountServiceAccountToken"] is False


def test_cluster_mode_gives_the_control_plane_exactly_loraadapter_access() -> None:
    docs = render(CLUSTER_MODE)
    role = one(docs, "ClusterRole", f"{FULL}-controlplane")
    assert role["rules"] == [
        {
            "apiGroups": ["loraplane.io"],
            "resources": ["loraadapters"],
            "verbs": ["get", "create", "patch", "delete"],
        }
    ]
    binding = one(docs, "ClusterRoleBinding", f"{FULL}-controlplane")
    assert binding["subjects"][0]["name"] == f"{FULL}-controlplane"
    deployment = one(docs, "Deployment", f"{FULL}-controlplane")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["LORAPLANE_KUBERNETES"] == "1"


def test_dashboards_are_configmaps_for_the_grafana_sidecar() -> None:
    docs = render(PRODUCTION)
    maps = [m for m in find(docs, "ConfigMap") if "dashboard" in m["metadata"]["name"]]
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert len(maps) == len(files) == 3
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "loraplane"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / key).read_text())
    assert not find(render({"monitoring": {"dashboards": {"enabled": False}}}), "ConfigMap")


def test_notes_warn_about_evaluation_storage() -> None:
    notes = render_texts()["loraplane/templates/NOTES.txt"]
    assert "SQLite" in notes and "emptyDir" in notes
    production = render_texts(PRODUCTION)["loraplane/templates/NOTES.txt"]
    assert "WARNING" not in production
