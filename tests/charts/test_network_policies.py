"""The chart's NetworkPolicies (docs/security.md), rendered and then evaluated with the
Kubernetes NetworkPolicy rules (a pod selected by a policy takes only what some rule admits;
peers are pod selectors in the policy's namespace, namespace selectors, or both ANDed), for
pods placed as a cluster would place them: the chart's Deployments, the data plane pods the
operator builds (loraplane/operator/manifests.py), a tenant's pod, Prometheus, a gateway."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from loraplane.operator import manifests
from loraplane.operator.specs import PoolSpec
from tests.charts.render import NAMESPACE, NETWORK, Manifest, find, helm, one, render
from tests.operator.conftest import pool_body

FULL = "lp-loraplane"
NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Pod:
    """A pod as a NetworkPolicy sees it: its namespace (and that one's labels), labels, and
    named container ports."""

    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    namespace_labels: dict[str, str] = field(default_factory=dict)

    @property
    def ns_labels(self) -> dict[str, str]:
        return {NAME_LABEL: self.namespace, **self.namespace_labels}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions In/NotIn/Exists) matches `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_admits(peer: dict[str, Any], policy_ns: str, src: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not addressed by IP here
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is None and src.namespace != policy_ns:
        return False
    if ns_sel is not None and not selects(ns_sel, src.ns_labels):
        return False
    return pod_sel is None or selects(pod_sel, src.labels)


def admitted(policies: list[Manifest], src: Pod, dst: Pod, port: str) -> bool:
    """Whether `src` may open a connection to `dst`'s named `port`."""
    assert port in dst.ports, f"{port} is not a port of {dst.labels}"
    applying = [
        p
        for p in policies
        if p["metadata"]["namespace"] == dst.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], dst.labels)
    ]
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] in (port, dst.ports[port]) for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(peer_admits(peer, dst.namespace, src) for peer in peers):
                return True
    return False


def chart_pod(docs: list[Manifest], component: str) -> Pod:
    dep = one(docs, "Deployment", f"{FULL}-{component}")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return Pod(NAMESPACE, dep["spec"]["template"]["metadata"]["labels"], ports)


def dataplane_pod(namespace: str, pool: str = "llama") -> Pod:
    spec = PoolSpec.parse(pool_body(pool, Path("/models/llama"))["spec"])
    dep = manifests.deployment(pool, namespace, spec, controlplane_url="http://cp", replicas=1)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return Pod(namespace, dep["spec"]["template"]["metadata"]["labels"], ports)


TENANT = Pod("team-a", {"app": "chatbot"})
PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
# the endpoint picker of the llm-d router's chart for a pool `llama`, beside the pool's pods
PICKER = Pod(NAMESPACE, {"inferencepool": "llama-epp", "app.kubernetes.io/name": "llama-epp"})


def matrix(values: dict[str, Any]) -> tuple[list[Manifest], dict[str, Pod]]:
    docs = render(values)
    return find(docs, "NetworkPolicy"), {
        "controlplane": chart_pod(docs, "controlplane"),
        "operator": chart_pod(docs, "operator"),
        "dataplane": dataplane_pod(NAMESPACE),
    }


def test_policies_are_on_by_default_and_select_every_component() -> None:
    policies, pods = matrix({})
    assert {p["metadata"]["name"] for p in policies} == {
        f"{FULL}-controlplane",
        f"{FULL}-operator",
        f"{FULL}-dataplane",
    }
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress is not restricted
    for name, pod in pods.items():
        assert any(selects(p["spec"]["podSelector"], pod.labels) for p in policies), name
    # every port a rule names is a port of the pods the policy selects
    for policy in policies:
        selected = [p for p in pods.values() if selects(policy["spec"]["podSelector"], p.labels)]
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert all(port["port"] in p.ports for p in selected), port


def test_by_default_a_tenant_reaches_the_apis_and_nothing_else() -> None:
    policies, pods = matrix({})
    cp, op, dp = pods["controlplane"], pods["operator"], pods["dataplane"]
    expected = {
        # (source, destination, port): admitted
        ("tenant", "dataplane", "http"): True,
        ("tenant", "dataplane", "metrics"): False,
        ("tenant", "controlplane", "http"): True,
        ("tenant", "controlplane", "internal"): False,
        ("tenant", "operator", "metrics"): False,
        ("prometheus", "dataplane", "metrics"): True,
        ("prometheus", "controlplane", "internal"): True,
        ("prometheus", "operator", "metrics"): True,
        ("operator", "controlplane", "internal"): True,
        ("dataplane", "controlplane", "internal"): True,
        ("dataplane", "dataplane", "metrics"): False,  # another replica scrapes nothing
        ("controlplane", "operator", "metrics"): False,
        # the gateway-metrics port names adapters: the endpoint picker alone reads it
        ("picker", "dataplane", "gateway-metrics"): True,
        ("picker", "dataplane", "http"): True,
        ("picker", "dataplane", "metrics"): False,
        ("tenant", "dataplane", "gateway-metrics"): False,
        ("prometheus", "dataplane", "gateway-metrics"): False,
        ("dataplane", "dataplane", "gateway-metrics"): False,
    }
    sources = {"tenant": TENANT, "prometheus": PROMETHEUS, "operator": op, "dataplane": dp,
               "controlplane": cp, "picker": PICKER}  # fmt: skip
    got = {key: admitted(policies, sources[key[0]], pods[key[1]], key[2]) for key in expected}
    assert got == expected
    # a tenant's own pod that copies the data plane's labels, in its namespace, is no replica
    impostor = Pod("team-a", dp.labels)
    assert not admitted(policies, impostor, cp, "internal")
    # nor is a pod labelled like a picker in another namespace a picker of these pools
    assert not admitted(policies, Pod("team-a", PICKER.labels), dp, "gateway-metrics")


def test_gateway_metrics_from_names_the_picker_or_closes_the_port() -> None:
    router = Pod("gateway", {"app": "router-epp"})
    peers = [{"namespaceSelector": {"matchLabels": {NAME_LABEL: "gateway"}},
              "podSelector": {"matchLabels": {"app": "router-epp"}}}]  # fmt: skip
    policies, pods = matrix({"networkPolicy": {"dataplane": {"gatewayMetricsFrom": peers}}})
    assert admitted(policies, router, pods["dataplane"], "gateway-metrics")
    assert not admitted(policies, PICKER, pods["dataplane"], "gateway-metrics")
    closed, pods = matrix({"networkPolicy": {"dataplane": {"gatewayMetricsFrom": []}}})
    assert not admitted(closed, PICKER, pods["dataplane"], "gateway-metrics")
    assert admitted(closed, PICKER, pods["dataplane"], "http")


def test_configured_peers_limit_each_api_port_to_its_callers() -> None:
    policies, pods = matrix(NETWORK)
    cp, dp = pods["controlplane"], pods["dataplane"]
    gateway = Pod("gateway", {"app": "epp"})
    ingress = Pod("ingress", {"app": "nginx"})
    prometheus = Pod(
        "o11y", {"app.kubernetes.io/name": "prometheus"}, {}, {"team": "observability"}
    )
    assert admitted(policies, gateway, dp, "http")
    assert not admitted(policies, TENANT, dp, "http")
    assert not admitted(policies, gateway, dp, "metrics")
    assert admitted(policies, ingress, cp, "http")
    assert not admitted(policies, TENANT, cp, "http")
    assert not admitted(policies, gateway, cp, "internal")
    assert admitted(policies, prometheus, dp, "metrics")
    assert admitted(policies, prometheus, cp, "internal")
    # the default monitoring namespace is no longer enough: the configured peer is
    assert not admitted(policies, PROMETHEUS, dp, "metrics")
    # pools in a second namespace: their pods are covered, and call the internal port
    other = dataplane_pod("pools")
    assert admitted(policies, gateway, other, "http")
    assert not admitted(policies, TENANT, other, "http")
    assert not admitted(policies, TENANT, other, "metrics")
    assert admitted(policies, other, cp, "internal")
    assert not admitted(policies, dataplane_pod("team-a"), cp, "internal")  # not a pool namespace


def test_empty_metrics_from_closes_every_metrics_port() -> None:
    policies, pods = matrix({"networkPolicy": {"metricsFrom": []}})
    assert not admitted(policies, PROMETHEUS, pods["dataplane"], "metrics")
    assert not admitted(policies, PROMETHEUS, pods["operator"], "metrics")
    assert not admitted(policies, PROMETHEUS, pods["controlplane"], "internal")
    assert admitted(policies, pods["operator"], pods["controlplane"], "internal")


def test_policies_can_be_turned_off() -> None:
    assert not find(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


@pytest.mark.parametrize(
    "values",
    [
        {"networkPolicy": {"metricsFrom": [{"namespace": "monitoring"}]}},
        {"networkPolicy": {"dataplane": {"apiFrom": [{}]}}},
        {"networkPolicy": {"dataplane": {"namespaces": ["Bad_NS"]}}},
        {"networkPolicy": {"enabled": "yes"}},
    ],
)
def test_schema_refuses_malformed_policy_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(values)
