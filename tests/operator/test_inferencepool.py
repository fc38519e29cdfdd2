"""ServingPool routing and external autoscaling: the InferencePool the operator owns (checked
against the upstream CRD's shape on the emulated cluster) follows the spec and goes when routing
is turned off; without the CRD the pool says so, serves on, and picks the CRD up once it is
installed; an InferencePool it does not own is left alone; with `autoscaling.mode: keda` the
operator reports pressure but never writes the replica count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from loraplane.cli import build_parser
from loraplane.operator import crds, inferencepool, manifests
from loraplane.operator.specs import PoolSpec, SpecError
from tests.operator import inferencepool_crd
from tests.operator.conftest import (
    PLATFORM,
    Cluster,
    ControlPlane,
    StartOperator,
    pool_body,
)
from tests.operator.harness import wait_for
from tests.operator.test_pools import _report

POOL = "tiny-pool"
ROUTED = {"inferencePool": {"enabled": True}}
SPEC = {
    "baseModel": {"name": "tiny", "uri": "/models/tiny"},
    "image": "img:1",
    "replicas": {"min": 1, "max": 4},
}


# -- pure: spec, manifests ------------------------------------------------------------------


def test_routing_and_autoscaling_mode_default_to_off_and_operator_as_the_crd_says() -> None:
    pool = PoolSpec.parse(SPEC)
    assert not pool.routing.inference_pool and pool.autoscaling.operator_scales
    props = crds.pool_schema()["properties"]["spec"]["properties"]
    picker = props["routing"]["properties"]["endpointPicker"]["properties"]
    assert picker["port"]["default"] == pool.routing.picker_port == 9002
    assert picker["failureMode"]["default"] == pool.routing.failure_mode == "FailOpen"
    assert props["autoscaling"]["properties"]["mode"]["default"] == pool.autoscaling.mode
    assert manifests.ENGINE_LABEL not in manifests.pod_labels(POOL, pool)
    assert "--api-metrics-adapters" not in manifests.serve_args(pool, "http://cp:8080")
    assert "default" not in picker["adapterAffinity"]  # deprecated: nothing reads it


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"autoscaling": {"mode": "hpa"}}, "mode"),
        ({"routing": {"endpointPicker": {"failureMode": "FailSoft"}}}, "failureMode"),
        ({"routing": {"endpointPicker": {"port": 0}}}, "port"),
        ({"routing": {"endpointPicker": {"service": "Router_EPP"}}}, "service"),
    ],
)
def test_bad_routing_or_autoscaling_mode_is_a_spec_error(
    change: dict[str, Any], where: str
) -> None:
    with pytest.raises(SpecError, match=where):
        PoolSpec.parse({**SPEC, **change})


def test_keda_mode_or_disabled_autoscaling_leave_the_count_to_someone_else() -> None:
    keda = PoolSpec.parse({**SPEC, "autoscaling": {"mode": "keda"}})
    off = PoolSpec.parse({**SPEC, "autoscaling": {"enabled": False}})
    assert not keda.autoscaling.operator_scales and not off.autoscaling.operator_scales


def test_inference_pool_selects_the_pods_on_the_api_port_and_names_the_picker() -> None:
    pool = PoolSpec.parse({**SPEC, "routing": ROUTED})
    body = inferencepool.manifest(POOL, PLATFORM, pool)
    inferencepool_crd.validate(body)
    assert body["apiVersion"] == "inference.networking.k8s.io/v1"
    assert body["spec"]["selector"] == {"matchLabels": {"loraplane.io/pool": POOL}}
    assert body["spec"]["targetPorts"] == [{"number": manifests.PORT}]
    assert body["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": f"{POOL}-epp",  # the llm-d router charts' EPP Service for a release = the pool
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    # the selector picks the pool's pods, which say they speak vLLM's metrics protocol
    pod = manifests.pod_labels(POOL, pool)
    assert body["spec"]["selector"]["matchLabels"].items() <= pod.items()
    assert pod[manifests.ENGINE_LABEL] == "vllm"
    # a 63-character pool's default picker is the llm-d charts' 40-character name
    assert pool.routing.picker_name("p" * 63) == "p" * 40 + "-epp"


def test_every_pod_serves_the_gateway_metrics_port_whatever_adapter_affinity_says() -> None:
    """The picker's port is on every pool's pods, a port of its own that the CLI parses;
    the deprecated adapterAffinity is accepted and changes nothing."""
    plain = PoolSpec.parse({**SPEC, "routing": ROUTED})
    args = manifests.serve_args(plain, "http://cp:8080")
    parsed = build_parser().parse_args(args)
    assert parsed.gateway_metrics_port == manifests.GATEWAY_METRICS_PORT
    assert len({manifests.PORT, manifests.METRICS_PORT, manifests.GATEWAY_METRICS_PORT}) == 3
    assert parsed.api_metrics_adapters is None
    dep = manifests.deployment(POOL, PLATFORM, plain, controlplane_url="http://cp", replicas=1)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": manifests.PORT, "metrics": manifests.METRICS_PORT,
                     "gateway-metrics": manifests.GATEWAY_METRICS_PORT}  # fmt: skip
    for affinity in (True, False):
        routing = {**ROUTED, "endpointPicker": {"adapterAffinity": affinity}}
        pool = PoolSpec.parse({**SPEC, "routing": routing})
        assert manifests.serve_args(pool, "http://cp:8080") == args
        assert pool == plain


# -- on the emulated cluster ----------------------------------------------------------------


def _install_crd(cluster: Cluster) -> None:
    client.ApiextensionsV1Api(cluster.api).create_custom_resource_definition(
        inferencepool_crd.crd(), _preload_content=False
    )


def _inference_pool(cluster: Cluster) -> dict[str, Any] | None:
    found = cluster.emulator.objects(
        inferencepool_crd.PLURAL, group=inferencepool_crd.GROUP, version=inferencepool_crd.VERSION
    )
    return next((p for p in found if p["metadata"]["name"] == POOL), None)


def _condition(cluster: Cluster, type_: str) -> dict[str, Any] | None:
    conditions = cluster.get("servingpools", PLATFORM, POOL).get("status", {}).get("conditions")
    return next((c for c in conditions or [] if c["type"] == type_), None)


def _wait_condition(cluster: Cluster, reason: str) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: (c := _condition(cluster, inferencepool.CONDITION)) and c["reason"] == reason and c,
        what=f"InferencePoolReady {reason}",
    )
    return found


def _deployment(cluster: Cluster) -> dict[str, Any] | None:
    found = cluster.emulator.objects("deployments", group="apps", version="v1")
    return next((d for d in found if d["metadata"]["name"] == POOL), None)


def _args(cluster: Cluster) -> list[str]:
    dep = _deployment(cluster)
    return [] if dep is None else list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def _patch(cluster: Cluster, spec: dict[str, Any]) -> None:
    cluster.patch("servingpools", PLATFORM, POOL, {"spec": spec})


@pytest.mark.k8s
def test_routed_pool_owns_an_inference_pool_that_follows_its_spec_and_goes_when_turned_off(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    _install_crd(cluster)
    start_operator()
    pool = cluster.create("servingpools", PLATFORM, pool_body(POOL, base_model_dir, routing=ROUTED))
    created = wait_for(lambda: _inference_pool(cluster), what="the InferencePool")
    inferencepool_crd.validate(created)
    assert created["metadata"]["namespace"] == PLATFORM
    assert created["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "loraplane.io/v1alpha1",
            "kind": "ServingPool",
            "name": POOL,
            "uid": pool["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert created["spec"]["selector"] == {"matchLabels": {"loraplane.io/pool": POOL}}
    assert created["spec"]["targetPorts"] == [{"number": 8000}]
    assert created["spec"]["endpointPickerRef"]["name"] == f"{POOL}-epp"
    ready = _wait_condition(cluster, "Created")
    assert ready["status"] == "True" and ready["observedGeneration"] == 1
    assert not any(e["reason"] == "Deprecated" for e in cluster.events(PLATFORM))
    # the selector picks the Deployment's pods, labelled for the EPP's metrics extractor
    template = _deployment(cluster)["spec"]["template"]  # type: ignore[index]
    labels = template["metadata"]["labels"]
    assert created["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels["llm-d.ai/engine-type"] == "vllm"
    assert template["spec"]["containers"][0]["ports"][0]["containerPort"] == 8000

    # another picker: the InferencePool follows; the deprecated adapterAffinity changes nothing
    picker = {"service": "router-epp", "port": 9100, "failureMode": "FailClose",
              "adapterAffinity": True}  # fmt: skip
    _patch(cluster, {"routing": {"endpointPicker": picker}})
    updated = wait_for(
        lambda: (
            (p := _inference_pool(cluster))
            and p["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
            and p
        ),
        what="the InferencePool's new picker",
    )
    inferencepool_crd.validate(updated)
    assert updated["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "router-epp",
        "port": {"number": 9100},
        "failureMode": "FailClose",
    }
    assert updated["metadata"]["uid"] == created["metadata"]["uid"]  # patched, not replaced
    assert _wait_condition(cluster, "Updated")["observedGeneration"] == 2
    args = _args(cluster)
    assert "--api-metrics-adapters" not in args
    wait_for(
        lambda: any(e["reason"] == "Deprecated" and "adapterAffinity" in e["message"]
                    for e in cluster.events(PLATFORM)),
        what="the deprecation warning Event",
    )  # fmt: skip
    assert args[args.index("--gateway-metrics-port") + 1] == str(manifests.GATEWAY_METRICS_PORT)

    # routing off: the owned InferencePool goes, the pool serves on through its Service
    _patch(cluster, {"routing": {"inferencePool": {"enabled": False}}})
    wait_for(lambda: _inference_pool(cluster) is None, what="the InferencePool to go")
    disabled = _wait_condition(cluster, "Disabled")
    assert disabled["status"] == "False" and "deleted" in disabled["message"]
    assert _deployment(cluster) is not None
    assert _condition(cluster, "Registered")["status"] == "True"  # type: ignore[index]


@pytest.mark.k8s
def test_without_the_crd_the_pool_says_so_serves_on_and_picks_it_up_once_installed(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    start_operator()
    cluster.create("servingpools", PLATFORM, pool_body(POOL, base_model_dir, routing=ROUTED))
    missing = _wait_condition(cluster, "CRDNotInstalled")
    assert missing["status"] == "False"
    assert "inferencepools.inference.networking.k8s.io/v1 is not served" in missing["message"]
    # everything else about the pool is fine
    assert _deployment(cluster) is not None
    wait_for(
        lambda: (c := _condition(cluster, "Registered")) and c["status"] == "True",
        what="the catalog mirror",
    )
    wait_for(
        lambda: any(e["reason"] == "CRDNotInstalled" for e in cluster.events(PLATFORM)),
        what="the warning Event",
    )
    assert _inference_pool(cluster) is None
    body = inferencepool.manifest(POOL, PLATFORM, PoolSpec.parse({**SPEC, "routing": ROUTED}))
    with pytest.raises(ApiException) as info:  # as an API server without the CRD answers
        cluster.custom.create_namespaced_custom_object(
            inferencepool.GROUP, inferencepool.VERSION, PLATFORM, inferencepool.PLURAL, body
        )
    assert info.value.status == 404

    _install_crd(cluster)  # the timer looks again (with backoff) and makes it
    created = wait_for(lambda: _inference_pool(cluster), what="the InferencePool")
    inferencepool_crd.validate(created)
    ready = _wait_condition(cluster, "Created")
    assert ready["status"] == "True"
    assert _condition(cluster, "Registered")["status"] == "True"  # type: ignore[index]


@pytest.mark.k8s
def test_an_inference_pool_the_pool_does_not_own_is_left_alone(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    _install_crd(cluster)
    theirs = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": PLATFORM},
        "spec": {
            "selector": {"matchLabels": {"app": "someone-else"}},
            "targetPorts": [{"number": 9000}],
            "endpointPickerRef": {"name": "their-epp", "port": {"number": 9002}},
        },
    }
    cluster.custom.create_namespaced_custom_object(
        "inference.networking.k8s.io", "v1", PLATFORM, "inferencepools", theirs
    )
    start_operator()
    cluster.create("servingpools", PLATFORM, pool_body(POOL, base_model_dir, routing=ROUTED))
    refused = _wait_condition(cluster, "NotOwned")
    assert refused["status"] == "False"
    left = _inference_pool(cluster)
    assert left is not None and left["spec"] == theirs["spec"]
    assert "ownerReferences" not in left["metadata"]
    # turning routing off does not delete what it never owned
    _patch(cluster, {"routing": {"inferencePool": {"enabled": False}}})
    _wait_condition(cluster, "Disabled")
    assert _inference_pool(cluster) is not None


@pytest.mark.k8s
def test_keda_mode_reports_pressure_but_never_writes_the_replica_count(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    op = start_operator()
    autoscaling = {"mode": "keda", "deferredPerReplica": 4, "scaleUpStabilizationSeconds": 0}
    cluster.create(
        "servingpools", PLATFORM, pool_body(POOL, base_model_dir, autoscaling=autoscaling)
    )
    dep = wait_for(lambda: _deployment(cluster), what="the Deployment")
    assert dep["spec"]["replicas"] == 1  # created at min; from then on the ScaledObject's
    wait_for(
        lambda: (
            controlplane.admin.get(f"/v1/pools/{POOL}", params={"namespace": PLATFORM}).status_code
            == 200
        ),
        what="the catalog's pool",
    )
    _report(controlplane, f"{POOL}-a", deferred=11)  # the operator's policy would run 3
    status = wait_for(
        lambda: (
            (s := cluster.get("servingpools", PLATFORM, POOL).get("status", {}))
            .get("pressure", {})
            .get("deferred")
            == 11
            and s
        ),
        what="the pressure in status",
    )
    assert status["desiredReplicas"] == 1
    # what a KEDA prometheus trigger reads: the pool's pressure and need, on the operator's /metrics
    samples = {
        (s.name, s.labels.get("signal")): s.value
        for family in text_string_to_metric_families(op.ctx.metrics.render().decode())
        for s in family.samples
        if (s.labels.get("pool_namespace"), s.labels.get("pool")) == (PLATFORM, POOL)
    }
    assert samples[("loraplane_pool_pressure", "deferred")] == 11
    assert samples[("loraplane_pool_needed_replicas", None)] == 3  # ceil(11 / 4)

    # KEDA scales the Deployment; a spec change rolls the pods but keeps KEDA's count
    cluster.apps.patch_namespaced_deployment(POOL, PLATFORM, {"spec": {"replicas": 2}})
    _patch(cluster, {"lora": {"maxLoraRank": 32}})
    wait_for(
        lambda: "32" in _args(cluster),
        what="the rollout",
    )
    wait_for(
        lambda: cluster.get("servingpools", PLATFORM, POOL)["status"].get("desiredReplicas") == 2,
        what="the status to follow KEDA's count",
    )
    assert _deployment(cluster)["spec"]["replicas"] == 2  # type: ignore[index]
    assert not any(e["reason"] in ("ScaledUp", "ScaledDown") for e in cluster.events(PLATFORM))
