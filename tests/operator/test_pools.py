"""ServingPool end to end: children with owner references, rollout, catalog mirror, status
and autoscaling from the pressure reported to the control plane."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.operator.conftest import (
    BASE_NAME,
    PLATFORM,
    SERVICE,
    Cluster,
    ControlPlane,
    StartOperator,
    pool_body,
)
from tests.operator.harness import wait_for
from tests.servers import free_port

pytestmark = pytest.mark.k8s
IN_PLATFORM = {"namespace": PLATFORM}


def _deployment(cluster: Cluster, name: str, namespace: str = PLATFORM) -> dict[str, Any] | None:
    for d in cluster.emulator.objects("deployments", group="apps", version="v1"):
        if (d["metadata"]["namespace"], d["metadata"]["name"]) == (namespace, name):
            return d
    return None


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_pool_gets_its_deployment_and_service_with_arguments_and_owner_references(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    start_operator()
    pool = cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    dep = wait_for(lambda: _deployment(cluster, "tiny-pool"), what="the Deployment")
    owner = {
        "apiVersion": "loraplane.io/v1alpha1",
        "kind": "ServingPool",
        "name": "tiny-pool",
        "uid": pool["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert dep["metadata"]["ownerReferences"] == [owner]
    assert dep["metadata"]["namespace"] == PLATFORM
    assert dep["spec"]["replicas"] == 1
    container = dep["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert container["command"] == ["loraplane"] and args[0] == "serve"
    assert _arg(args, "--model") == str(base_model_dir)
    assert _arg(args, "--served-model-name") == BASE_NAME
    assert (_arg(args, "--max-loras"), _arg(args, "--max-lora-rank")) == ("4", "16")
    assert _arg(args, "--max-cpu-loras") == "8"
    assert _arg(args, "--controlplane-url") == controlplane.url
    assert _arg(args, "--port") == "8000"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in container["env"]}
    assert env["LORAPLANE_POOL"]["value"] == "tiny-pool"
    assert env["LORAPLANE_POOL_NAMESPACE"]["value"] == PLATFORM
    assert env["LORAPLANE_SERVICE_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "loraplane-tokens",
        "key": "service",
    }
    svc = wait_for(
        lambda: [s for s in cluster.emulator.objects("services", group="", version="v1")],
        what="the Service",
    )[0]
    assert svc["metadata"]["ownerReferences"] == [owner]
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"] == {"loraplane.io/pool": "tiny-pool"}

    # the pool is mirrored into the control plane
    mirrored = wait_for(
        lambda: (
            (r := controlplane.admin.get("/v1/pools/tiny-pool", params=IN_PLATFORM)).status_code
            == 200
            and r.json()
        ),
        what="the catalog's pool",
    )
    assert mirrored["base_model"] == {"name": BASE_NAME, "uri": str(base_model_dir)}
    assert mirrored["max_lora_rank"] == 16

    # a spec change rolls out (patch), and reaches the catalog
    cluster.patch("servingpools", PLATFORM, "tiny-pool", {"spec": {"lora": {"maxLoraRank": 32}}})
    wait_for(
        lambda: (
            _arg(
                _deployment(cluster, "tiny-pool")["spec"]["template"]["spec"]["containers"][0][
                    "args"
                ],
                "--max-lora-rank",
            )
            == "32"
        ),  # type: ignore[index]
        what="the rollout",
    )
    wait_for(
        lambda: (
            controlplane.admin.get("/v1/pools/tiny-pool", params=IN_PLATFORM).json()[
                "max_lora_rank"
            ]
            == 32
        ),
        what="the catalog's new limit",
    )
    obj = cluster.get("servingpools", PLATFORM, "tiny-pool")
    assert obj["metadata"]["generation"] == 2
    assert obj["spec"]["lora"]["maxLoraRank"] == 32  # as the user wrote it: no spec writes
    registered = {c["type"]: c for c in obj["status"]["conditions"]}["Registered"]
    assert registered["status"] == "True"

    # deleting the ServingPool removes it from the catalog (its finalizer is released)
    cluster.custom.delete_namespaced_custom_object(
        "loraplane.io", "v1alpha1", PLATFORM, "servingpools", "tiny-pool"
    )
    wait_for(lambda: not cluster.emulator.objects("servingpools"), what="the pool to go")
    assert controlplane.admin.get("/v1/pools/tiny-pool", params=IN_PLATFORM).status_code == 404


def test_pool_max_cpu_lora_bytes_reaches_the_deployment_args_and_the_catalog(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    """spec.lora.maxCpuLoraBytes: the replicas' --max-cpu-lora-bytes in bytes and the catalog
    pool's max_cpu_lora_bytes; taken out of the spec, it goes from both."""
    start_operator()
    lora = {"maxLoras": 4, "maxLoraRank": 16, "maxCpuLoras": 8, "maxCpuLoraBytes": "512MiB"}
    cluster.create("servingpools", PLATFORM, pool_body("bytes-pool", base_model_dir, lora=lora))

    def args() -> list[str]:
        dep = _deployment(cluster, "bytes-pool")
        return [] if dep is None else dep["spec"]["template"]["spec"]["containers"][0]["args"]

    wait_for(lambda: "--max-cpu-lora-bytes" in args(), what="the Deployment")
    assert _arg(args(), "--max-cpu-lora-bytes") == str(512 << 20)
    assert _arg(args(), "--max-cpu-loras") == "8"

    def catalog_limit() -> object:
        r = controlplane.admin.get("/v1/pools/bytes-pool", params=IN_PLATFORM)
        return r.json()["max_cpu_lora_bytes"] if r.status_code == 200 else "missing"

    wait_for(lambda: catalog_limit() == 512 << 20, what="the catalog's byte limit")
    cluster.patch("servingpools", PLATFORM, "bytes-pool",
                  {"spec": {"lora": {"maxCpuLoraBytes": None}}})  # fmt: skip
    wait_for(lambda: "--max-cpu-lora-bytes" not in args(), what="the rollout without it")
    wait_for(lambda: catalog_limit() is None, what="the catalog's byte limit cleared")


def _report(
    controlplane: ControlPlane, replica: str, deferred: int, namespace: str = PLATFORM
) -> None:
    body = {"namespace": namespace, "pool": "tiny-pool", "replica": replica,
            "deferred": deferred, "waiting_adapters": 1, "cpu_bytes": 4096}  # fmt: skip
    r = httpx.post(
        f"{controlplane.url}/internal/v1/pressure",
        json=body,
        headers={"Authorization": f"Bearer {SERVICE}"},
    )
    assert r.status_code == 200, r.text


def test_pool_scales_up_from_reported_pressure_and_records_it_in_status(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    op = start_operator()
    server, _ = op.ctx.metrics.serve("127.0.0.1", free_port())
    metrics_url = f"http://127.0.0.1:{server.server_port}/metrics"
    autoscaling = {"deferredPerReplica": 4, "scaleUpStabilizationSeconds": 0}
    cluster.create(
        "servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir, autoscaling=autoscaling)
    )
    wait_for(
        lambda: controlplane.admin.get("/v1/pools/tiny-pool", params=IN_PLATFORM).status_code == 200
    )
    # the emulator has no controller: say the Deployment's pods are up
    cluster.apps.patch_namespaced_deployment_status(
        "tiny-pool", PLATFORM, {"status": {"replicas": 1, "readyReplicas": 1}}
    )
    _report(controlplane, "tiny-pool-a", deferred=11)  # needs ceil(11 / 4) = 3 replicas

    dep = wait_for(
        lambda: (d := _deployment(cluster, "tiny-pool")) and d["spec"]["replicas"] == 3 and d,
        what="the scale-up",
    )
    assert dep["spec"]["replicas"] == 3
    status = wait_for(
        lambda: (
            (s := cluster.get("servingpools", PLATFORM, "tiny-pool").get("status", {})).get(
                "desiredReplicas"
            )
            == 3
            and s
        ),
        what="the status",
    )
    assert status["pressure"]["deferred"] == 11
    assert status["pressure"]["replicasReporting"] == 1
    assert status["pressure"]["hostAdapterMemoryUsed"] == 4096  # the host tier's bytes
    assert status["readyReplicas"] == 1
    assert status["lastScaleTime"].endswith("Z")
    # Kopf posts events in the background: wait for it rather than race it
    wait_for(
        lambda: any(
            e["reason"] == "ScaledUp" and "1 -> 3" in e["message"] for e in cluster.events(PLATFORM)
        ),
        what="the ScaledUp event",
    )

    # The operator's /metrics (the Autoscaling dashboard's source), scraped over HTTP.
    def scraped() -> dict[str, float]:
        text = httpx.get(metrics_url, timeout=5).text
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = dict(sample.labels)
                if labels.pop("pool", None) != "tiny-pool":
                    continue
                assert labels.pop("pool_namespace") == PLATFORM
                found[sample.name + "".join(f",{k}={v}" for k, v in sorted(labels.items()))] = (
                    sample.value
                )
        return found

    metrics = wait_for(
        lambda: (m := scraped()).get("loraplane_pool_ready_replicas") == 1 and m,
        what="the pool's metrics",
    )
    try:
        assert metrics["loraplane_pool_replicas"] == 3
        assert metrics["loraplane_pool_needed_replicas"] == 3  # ceil(11 / 4)
        assert metrics["loraplane_pool_replicas_bound,bound=min"] == 1
        assert metrics["loraplane_pool_replicas_bound,bound=max"] == 3
        assert metrics["loraplane_pool_autoscaling_target,signal=deferred_per_replica"] == 4
        assert metrics["loraplane_pool_pressure,signal=deferred"] == 11
        assert metrics["loraplane_pool_pressure,signal=replicas_reporting"] == 1
        assert metrics["loraplane_pool_pressure,signal=host_adapter_memory_used"] == 4096
        assert metrics["loraplane_pool_scale_events_total,direction=up"] == 1
        assert metrics["loraplane_pool_scale_events_total,direction=down"] == 0
        # A deleted pool's series go with it.
        cluster.custom.delete_namespaced_custom_object(
            "loraplane.io", "v1alpha1", PLATFORM, "servingpools", "tiny-pool"
        )
        wait_for(lambda: not scraped(), what="the pool's series to go")
    finally:
        server.shutdown()


def test_pools_named_alike_in_two_namespaces_have_their_own_catalog_entry_and_scale(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    base_model_dir: Path,
) -> None:
    """Pressure reported for one ServingPool never scales its namesake in another namespace."""
    other = "platform-b"
    cluster.core.create_namespace({"metadata": {"name": other}})
    start_operator()
    autoscaling = {"deferredPerReplica": 4, "scaleUpStabilizationSeconds": 0}
    for namespace in (PLATFORM, other):
        body = pool_body("tiny-pool", base_model_dir, autoscaling=autoscaling)
        body["metadata"]["namespace"] = namespace
        cluster.create("servingpools", namespace, body)
    listed = wait_for(
        lambda: len(p := controlplane.admin.get("/v1/pools").json()) == 2 and p,
        what="two catalog pools",
    )
    assert {(p["namespace"], p["name"]) for p in listed} == {
        (other, "tiny-pool"),
        (PLATFORM, "tiny-pool"),
    }
    deployment = wait_for(lambda: _deployment(cluster, "tiny-pool", other), what="Deployment")
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert (env["LORAPLANE_POOL_NAMESPACE"], env["LORAPLANE_POOL"]) == (other, "tiny-pool")

    _report(controlplane, "tiny-pool-a", deferred=11, namespace=other)  # needs 3 replicas
    wait_for(
        lambda: (d := _deployment(cluster, "tiny-pool", other)) and d["spec"]["replicas"] == 3,
        what="the scale-up in platform-b",
    )
    # the namesake saw no pressure: several timer ticks later it still runs its minimum
    wait_for(
        lambda: (
            cluster.get("servingpools", PLATFORM, "tiny-pool")
            .get("status", {})
            .get("desiredReplicas")
            == 1
        ),
        what="the status of the pool in the platform namespace",
    )
    status = cluster.get("servingpools", PLATFORM, "tiny-pool")["status"]
    assert "pressure" not in status
    assert _deployment(cluster, "tiny-pool")["spec"]["replicas"] == 1  # type: ignore[index]
    mirrored = controlplane.admin.get("/v1/pools/tiny-pool", params=IN_PLATFORM).json()
    assert mirrored["pressure"] is None


def _layout_condition(cluster: Cluster, name: str) -> dict[str, Any] | None:
    pool = cluster.get("servingpools", PLATFORM, name)
    found = [c for c in pool.get("status", {}).get("conditions", []) if c["type"] == "LayoutValid"]
    return found[0] if found else None


def test_a_split_pool_asks_for_a_gpu_per_rank_and_an_unsplittable_base_is_refused(
    cluster: Cluster, controlplane: ControlPlane, start_operator: StartOperator,
    base_model_dir: Path,
) -> None:  # fmt: skip
    start_operator()
    body = pool_body("split", base_model_dir, device="cuda", tensorParallelSize=2)
    cluster.create("servingpools", PLATFORM, body)
    dep = wait_for(lambda: _deployment(cluster, "split"), what="the Deployment")
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert _arg(container["args"], "--tensor-parallel-size") == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # the tiny base has 4 attention heads: 3 processes cannot split them
    cluster.create("servingpools", PLATFORM, pool_body("odd", base_model_dir,
                                                       tensorParallelSize=3))  # fmt: skip

    def refused() -> str | None:
        for pool in cluster.emulator.objects("servingpools", group="loraplane.io",
                                             version="v1alpha1"):  # fmt: skip
            if pool["metadata"]["name"] == "odd":
                for cond in pool.get("status", {}).get("conditions", []):
                    if cond["type"] == "LayoutValid" and cond["status"] == "False":
                        assert cond["reason"] == "InvalidTensorParallelSize"
                        return str(cond["message"])
        return None

    message = wait_for(refused, what="the refusal of the odd pool")
    assert (
        "spec.tensorParallelSize 3: tensor parallel size 3 does not divide num_attention_heads (4)"
        in (message)
    )
    assert _deployment(cluster, "odd") is None
    # fp8 asked of a 4-bit checkpoint (the data plane would refuse it): no pods either
    awq = base_model_dir.parent / "awq-base"
    shutil.copytree(base_model_dir, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (awq / "config.json").write_text(json.dumps(config))
    cluster.create("servingpools", PLATFORM, pool_body("awq", awq, quantization="fp8"))

    cond = wait_for(lambda: _layout_condition(cluster, "awq"),
                    what="the awq pool's LayoutValid condition")  # fmt: skip
    assert (cond["status"], cond["reason"]) == ("False", "UnsupportedQuantization")
    assert "the base model is a 4-bit checkpoint" in cond["message"]
    assert _deployment(cluster, "awq") is None
    # an unsplit pool asking for no quantization is checked too: a bitsandbytes checkpoint
    bnb = base_model_dir.parent / "bnb"
    bnb.mkdir()
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bnb / "config.json").write_text(json.dumps(config))
    cluster.create("servingpools", PLATFORM, pool_body("bnb", bnb))
    cond = wait_for(lambda: _layout_condition(cluster, "bnb"), what="bnb's LayoutValid")
    assert (cond["status"], cond["reason"]) == ("False", "UnsupportedQuantization")
    assert "quantization_config is a form the data plane does not serve" in cond["message"]
    assert _deployment(cluster, "bnb") is None
    # and the split pool's layout is valid
    cond = wait_for(lambda: _layout_condition(cluster, "split"), what="split's LayoutValid")
    assert (cond["status"], cond["reason"]) == ("True", "Valid")
