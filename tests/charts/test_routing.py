"""The chart behind the llm-d router and with KEDA: the endpoint picker's config (an
EndpointPickerConfig with the LoRA affinity scorer beside llm-d's default scorers), an HTTPRoute
per pool to the InferencePool the operator makes, and with `autoscaling.mode: keda` a
ScaledObject per pool whose queries read what the operator exports."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loraplane.operator import autoscaling, inferencepool, manifests
from loraplane.operator import specs as s
from loraplane.operator.metrics import PoolMetrics
from loraplane.operator.specs import PoolSpec
from tests.charts.render import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROUTING,
    find,
    helm,
    one,
    render,
    render_texts,
)
from tests.operator.conftest import pool_body

FULL = f"{RELEASE}-loraplane"
EPP_CONFIG = f"{FULL}-epp-config"
# The llm-d router's EndpointPickerConfig (apiVersion llm-d.ai/v1alpha1), from its Go types
# (llm-d/llm-d-router apix/config/v1alpha1/endpointpickerconfig_types.go): unknown top-level
# fields are not part of it.
EPP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "plugins", "schedulingProfiles"],
    "properties": {
        "apiVersion": {"enum": ["llm-d.ai/v1alpha1"]},
        "kind": {"enum": ["EndpointPickerConfig"]},
        "featureGates": {"type": "array", "items": {"type": "string"}},
        "plugins": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type"],
                "properties": {
                    "name": {"type": "string"},
                    "type": {"type": "string", "minLength": 1},
                    "parameters": {"type": "object"},
                },
            },
        },
        "schedulingProfiles": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "plugins"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "plugins": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["pluginRef"],
                            "properties": {
                                "pluginRef": {"type": "string"},
                                "weight": {"type": "number"},
                            },
                        },
                    },
                },
            },
        },
        "dataLayer": {"type": "object"},
        "flowControl": {"type": "object"},
        "requestHandler": {"type": "object"},
    },
}
# Plugin type names as the llm-d router registers them (its plugins' *Type constants and
# READMEs); the last four are scorers.
SOURCE, EXTRACTOR = "metrics-data-source", "core-metrics-extractor"
SCORERS = ["queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer",
           "lora-affinity-scorer"]  # fmt: skip


def _with(**changes: Any) -> dict[str, Any]:
    values = copy.deepcopy(ROUTING)
    for key, value in changes.items():
        values[key] = value
    return values


def _epp_config(cm: dict[str, Any]) -> dict[str, Any]:
    ((key, text),) = cm["data"].items()
    assert key == "epp-config.yaml"
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def test_routing_and_keda_render_nothing_by_default() -> None:
    docs = render()
    assert not find(docs, "ScaledObject") and not find(docs, "HTTPRoute")
    assert not find(docs, "ConfigMap", EPP_CONFIG)
    # pools listed without routing or keda get nothing either
    quiet = render({"pools": ROUTING["pools"]})
    assert not find(quiet, "ScaledObject") and not find(quiet, "HTTPRoute")


def test_epp_config_adds_lora_affinity_to_the_queue_kv_cache_and_prefix_scorers() -> None:
    config = _epp_config(one(render(ROUTING), "ConfigMap", EPP_CONFIG))
    jsonschema.validate(config, EPP_SCHEMA)
    types = [p["type"] for p in config["plugins"]]
    assert types == [SOURCE, EXTRACTOR, *SCORERS]
    source = config["plugins"][0]["parameters"]
    # by default the replicas' gateway-metrics port, the one that names their adapters (the
    # gateway test, test_gateway_affinity.py, scrapes it on a real server)
    assert source == {"scheme": "http", "path": "/metrics", "port": 8003}
    routed = pool_body("p", Path("/models/m"), routing={"inferencePool": {"enabled": True}})
    pool = PoolSpec.parse(routed["spec"])
    dep = manifests.deployment("p", NAMESPACE, pool, controlplane_url="http://cp", replicas=1)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["gateway-metrics"] == source["port"] != ports["http"]
    # a plugin without a name is named by its type; every reference resolves
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    weights = {ref["pluginRef"]: ref["weight"] for ref in profile["plugins"]}
    assert set(weights) <= names
    assert weights == dict(zip(SCORERS, [2, 2, 3, 10], strict=True))


def test_epp_config_follows_the_weights_and_metrics_port_and_goes_to_each_pool_namespace() -> None:
    routing = {
        "enabled": True,
        "endpointPicker": {
            "weights": {"queue": 1, "kvCache": 1, "prefixCache": 2, "loraAffinity": 5},
            "metricsPort": 8010,
        },
    }
    pools = [
        {"name": "a"},
        {"name": "b", "namespace": "pools"},
        {"name": "c", "namespace": "pools"},
    ]
    maps = find(render({"routing": routing, "pools": pools}), "ConfigMap", EPP_CONFIG)
    assert sorted(m["metadata"]["namespace"] for m in maps) == sorted([NAMESPACE, "pools"])
    config = _epp_config(maps[0])
    jsonschema.validate(config, EPP_SCHEMA)
    assert config["plugins"][0]["parameters"]["port"] == 8010
    weights = [ref["weight"] for ref in config["schedulingProfiles"][0]["plugins"]]
    assert weights == [1, 1, 2, 5]
    # 0: the InferencePool's target port (no port parameter)
    zero = {"enabled": True, "endpointPicker": {"metricsPort": 0}}
    source = _epp_config(one(render({"routing": zero}), "ConfigMap", EPP_CONFIG))["plugins"][0]
    assert "port" not in source["parameters"]


def test_httproutes_send_only_the_openai_api_to_each_pools_inference_pool() -> None:
    routes = {r["metadata"]["name"]: r for r in find(render(ROUTING), "HTTPRoute")}
    assert set(routes) == {"llama-3-8b", "qwen-7b"}
    for name, route in routes.items():
        assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert route["metadata"]["namespace"] == NAMESPACE
        assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
        (rule,) = route["spec"]["rules"]
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
        # the backend is the InferencePool the operator makes for the pool of that name
        spec = PoolSpec.parse(pool_body(name, Path("/models/m"))["spec"])
        made = inferencepool.manifest(name, NAMESPACE, spec)
        assert rule["backendRefs"] == [
            {
                "group": made["apiVersion"].split("/")[0],
                "kind": made["kind"],
                "name": made["metadata"]["name"],
            }
        ]
        assert rule["timeouts"] == {"request": "300s"}
    assert routes["llama-3-8b"]["spec"]["hostnames"] == ["llm.example.com"]
    assert "hostnames" not in routes["qwen-7b"]["spec"]


def _exported_metric_names() -> set[str]:
    metrics = PoolMetrics()
    policy = autoscaling.ScalePolicy(1, 2, 4, 2, 0, 0)
    metrics.observe("ns", "p", replicas=1, ready=1, policy=policy, pressure=autoscaling.Pressure())
    return {family.name for family in metrics.registry.collect()}


def test_scaled_objects_scale_each_pools_deployment_from_the_operators_pressure() -> None:
    scaled = {o["metadata"]["name"]: o for o in find(render(ROUTING), "ScaledObject")}
    assert set(scaled) == {"llama-3-8b", "qwen-7b"}
    exported = _exported_metric_names()
    expected = {  # name: (min, max, deferred target, waiting target, up, down window)
        "llama-3-8b": (1, 4, 4, 2, 30, 300),
        "qwen-7b": (2, 8, 8, 2, 30, 600),
    }
    for name, obj in scaled.items():
        low, high, deferred, waiting, up, down = expected[name]
        spec = obj["spec"]
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        assert obj["metadata"]["namespace"] == NAMESPACE
        # the Deployment the operator makes for the pool
        pool = PoolSpec.parse(pool_body(name, Path("/models/m"))["spec"])
        deployment = manifests.deployment(name, NAMESPACE, pool, controlplane_url="http://cp",
                                          replicas=None)  # fmt: skip
        target = spec["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == (
            deployment["apiVersion"],
            deployment["kind"],
            deployment["metadata"]["name"],
        )
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (low, high)
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == up
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == down
        triggers = {t["name"]: t for t in spec["triggers"]}
        assert set(triggers) == {"deferred", "waiting-adapters"}
        for trigger_name, threshold in (("deferred", deferred), ("waiting-adapters", waiting)):
            trigger = triggers[trigger_name]
            meta = trigger["metadata"]
            assert trigger["type"] == "prometheus"
            assert meta["serverAddress"] == "http://prometheus.monitoring:9090"
            assert meta["threshold"] == str(threshold)
            assert meta["ignoreNullValues"] == "false"
            query = meta["query"]
            assert f'pool_namespace="{NAMESPACE}",pool="{name}"' in query
            assert f'signal="{trigger_name.replace("-", "_")}"' in query
            assert query.endswith(f"* {threshold})")
            used = set(re.findall(r"(loraplane_[a-z_]+)\{", query))
            assert used and used <= exported, used - exported


def test_keda_targets_default_to_the_servingpool_crds() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["autoscaling"]["mode"] == "operator"
    assert values["autoscaling"]["keda"]["targets"] == {
        "deferredPerReplica": s.DEFAULT_DEFERRED_PER_REPLICA,
        "waitingAdaptersPerReplica": s.DEFAULT_WAITING_ADAPTERS_PER_REPLICA,
        "scaleUpStabilizationSeconds": s.DEFAULT_SCALE_UP_SECONDS,
        "scaleDownStabilizationSeconds": s.DEFAULT_SCALE_DOWN_SECONDS,
    }
    assert values["autoscaling"]["mode"] in s.AUTOSCALING_MODES


def test_keda_mode_needs_a_prometheus_and_each_pools_bounds() -> None:
    with pytest.raises(helm.HelmError, match="prometheusUrl"):
        render(_with(autoscaling={"mode": "keda"}))
    with pytest.raises(helm.HelmError, match="replicas"):
        render(_with(pools=[{"name": "unbounded"}]))


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "an hpa mode": ({"autoscaling": {"mode": "hpa"}}, "mode"),
    "a pool name in capitals": ({"pools": [{"name": "Llama"}]}, "name"),
    "a negative weight": (
        {"routing": {"enabled": True, "endpointPicker": {"weights": {"queue": -1}}}},
        "queue",
    ),
    "prometheus without a scheme": (
        {"autoscaling": {"mode": "keda", "keda": {"prometheusUrl": "prometheus:9090"}}},
        "prometheusUrl",
    ),
    "a pool min of 0": ({"pools": [{"name": "a", "replicas": {"min": 0, "max": 1}}]}, "min"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_schema_rejects_bad_routing_and_autoscaling_values(case: str) -> None:
    values, where = BAD[case]
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    assert where in str(info.value), info.value


def test_notes_remind_that_keda_pools_need_their_spec_mode() -> None:
    notes = render_texts(ROUTING)["loraplane/templates/NOTES.txt"]
    assert "KEDA scales llama-3-8b, qwen-7b" in notes
    assert "spec.autoscaling.mode: keda" in notes
    assert "KEDA" not in render_texts()["loraplane/templates/NOTES.txt"]
