"""Render the Helm chart offline with the Helm SDK (helm-python-sdk: no helm binary, no
cluster) and give the manifests back as dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "loraplane"
RELEASE, NAMESPACE = "lp", "loraplane-system"

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (dev extra)")

Manifest = dict[str, Any]

# Strong test tokens (>= 32 characters, >= 10 distinct).
ADMIN = "admin-0123456789abcdefghijklmnopqrstuv"
SERVICE = "service-0123456789abcdefghijklmnopqrstu"

# A production install: external PostgreSQL from an existing Secret, S3 store, existing token
# Secret, ServiceMonitors, several control plane replicas, operator limited to namespaces.
PRODUCTION: dict[str, Any] = {
    "image": {"tag": "1.2.3"},
    "imagePullSecrets": [{"name": "regcred"}],
    "tokens": {"existingSecret": "loraplane-tokens"},
    "database": {"existingSecret": "loraplane-db", "existingSecretKey": "url", "poolSize": 20},
    "store": {
        "uri": "s3://loraplane-adapters/prod",
        "s3": {"endpointUrl": "https://s3.example.com", "credentialsSecret": "loraplane-s3"},
        "importBuckets": ["team-imports"],
    },
    "controlplane": {
        "replicas": 3,
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "controlplane"}},
            }
        ],
    },
    "operator": {
        "watchNamespaces": ["loraplane-system", "team-a", "team-b"],
        "sourceHosts": ["huggingface.co"],
        "extraEnv": [{"name": "LORAPLANE_PRESSURE_STALE_SECONDS", "value": "90"}],
    },
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboards": {"annotations": {"grafana_folder": "loraplane"}},
    },
}

# Chart-made Secrets: the database URL and the tokens from values.
CHART_SECRETS: dict[str, Any] = {
    "database": {"url": "postgresql://loraplane:pw@postgres.db:5432/loraplane"},
    "tokens": {"admin": ADMIN, "service": SERVICE},
    "controlplane": {"replicas": 2},
}

CLUSTER_MODE: dict[str, Any] = {**PRODUCTION, "controlplane": {"replicas": 2, "clusterMode": True}}

# NetworkPolicies fitted to a cluster: a gateway in front of the data plane, an ingress
# controller in front of the control plane, pools in two namespaces, Prometheus by label.
NETWORK: dict[str, Any] = {
    "networkPolicy": {
        "metricsFrom": [
            {
                "namespaceSelector": {"matchLabels": {"team": "observability"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ],
        "controlplane": {
            "apiFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
            ]
        },
        "dataplane": {
            "namespaces": [NAMESPACE, "pools"],
            "apiFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
            ],
        },
    },
}

# Behind the llm-d router with KEDA scaling: the EPP config, an HTTPRoute and a ScaledObject per
# listed pool (tests/charts/test_routing.py).
ROUTING: dict[str, Any] = {
    "pools": [
        {"name": "llama-3-8b", "replicas": {"min": 1, "max": 4}, "hostnames": ["llm.example.com"]},
        {
            "name": "qwen-7b",
            "replicas": {"min": 2, "max": 8},
            "autoscaling": {"deferredPerReplica": 8, "scaleDownStabilizationSeconds": 600},
        },
    ],
    "routing": {"enabled": True, "gateway": {"enabled": True}},
    "autoscaling": {"mode": "keda", "keda": {"prometheusUrl": "http://prometheus.monitoring:9090"}},
}

SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "production": PRODUCTION,
    "chart-secrets": CHART_SECRETS,
    "cluster-mode": CLUSTER_MODE,
    "network-policies": NETWORK,
    "routing-keda": ROUTING,
}


def render_texts(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included)."""
    with helm.Chart.load(CHART) as chart:
        texts: dict[str, str] = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return texts


def render(values: dict[str, Any] | None = None) -> list[Manifest]:
    """Every manifest the chart renders with `values`, hooks included."""
    docs: list[Manifest] = []
    for path, text in sorted(render_texts(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def find(docs: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    """Manifests of `kind` (and `name`)."""
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[Manifest], kind: str, name: str) -> Manifest:
    """The one manifest of `kind` named `name`."""
    found = find(docs, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod_specs(docs: list[Manifest]) -> list[tuple[Manifest, dict[str, Any]]]:
    """(workload, pod spec) of every Deployment and Job."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in ("Deployment", "Job")]
