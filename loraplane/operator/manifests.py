"""Pure builders of the Deployment and Service a ServingPool owns.

The data plane runs `loraplane serve` with the pool's base model and LoRA limits, in catalog
mode (`--controlplane-url`), reporting pressure as the pool (`LORAPLANE_POOL_NAMESPACE`,
`LORAPLANE_POOL`) and the pod (`LORAPLANE_REPLICA`). Owner references are added by the caller
(`kopf.adopt`).
"""

from __future__ import annotations

from typing import Any

from loraplane.operator.specs import GPU_RESOURCE, PoolSpec, SecretKeyRef

PORT = 8000
# every metric, per-tenant ones included (`--metrics-port`): on the pods only, never on the
# pool's Service; the chart's PodMonitor scrapes it and its NetworkPolicy admits monitoring only
METRICS_PORT = 8002
# the endpoint picker's view (`--gateway-metrics-port`): vLLM's protocol gauges with the adapter
# names its LoRA affinity reads, no tenant label; on the pods only, scraped by the picker (the
# chart's EndpointPickerConfig), whose pods alone its NetworkPolicy admits. The API port's
# /metrics never names adapters.
GATEWAY_METRICS_PORT = 8003
CONTAINER = "dataplane"
STORE_MOUNT = "/var/lib/loraplane/store"
# usage not yet delivered to the control plane (LORAPLANE_USAGE_SPOOL_DIR): an emptyDir, which
# outlives a crashed container (its restart in the same pod reads it back)
SPOOL_MOUNT = "/var/lib/loraplane/usage-spool"
MANAGED_BY = "loraplane-operator"
SHM_PER_RANK_GIB = 1  # /dev/shm per tensor-parallel rank
# The llm-d router's EPP reads a pod's metrics by its engine type (vLLM-compatible here).
ENGINE_LABEL = "llm-d.ai/engine-type"


def labels(pool: str) -> dict[str, str]:
    """Labels on a pool's children and their pods; `selector_labels` is the stable subset."""
    return {
        "app.kubernetes.io/name": "loraplane-dataplane",
        "app.kubernetes.io/instance": pool,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "loraplane.io/pool": pool,
    }


def pod_labels(pool: str, spec: PoolSpec) -> dict[str, str]:
    """Labels on a pool's pods: the children's, plus the engine type once an InferencePool
    routes to them (not before: a label change rolls the pods; the merge patch keeps it after
    routing is turned off, where it is harmless)."""
    engine = {ENGINE_LABEL: "vllm"} if spec.routing.inference_pool else {}
    return {**labels(pool), **engine}


def selector_labels(pool: str) -> dict[str, str]:
    """What the Deployment and Service select on (never changes for a pool)."""
    return {"loraplane.io/pool": pool}


def serve_args(spec: PoolSpec, controlplane_url: str) -> list[str]:
    """The `loraplane serve` arguments for a pool."""
    return [
        "serve",
        "--model",
        spec.base_model_uri,
        "--served-model-name",
        spec.base_model_name,
        "--max-loras",
        "auto" if spec.max_loras is None else str(spec.max_loras),
        "--max-lora-rank",
        str(spec.max_lora_rank),
        *([] if spec.max_cpu_loras is None else ["--max-cpu-loras", str(spec.max_cpu_loras)]),
        *(
            []
            if spec.max_cpu_lora_bytes is None
            else ["--max-cpu-lora-bytes", str(spec.max_cpu_lora_bytes)]
        ),
        *([] if spec.lora_memory is None else ["--lora-memory", spec.lora_memory]),
        "--device",
        spec.device,
        *({None: [], True: ["--cuda-graphs"], False: ["--no-cuda-graphs"]}[spec.cuda_graphs]),
        *([] if spec.quantization is None else ["--quantization", spec.quantization]),
        *(
            []
            if spec.tensor_parallel_size == 1
            else ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
        ),
        *([] if spec.kv_cache_dtype is None else ["--kv-cache-dtype", spec.kv_cache_dtype]),
        "--host",
        "0.0.0.0",  # noqa: S104 - a pod serves on its own address
        "--port",
        str(PORT),
        "--metrics-port",
        str(METRICS_PORT),
        "--gateway-metrics-port",
        str(GATEWAY_METRICS_PORT),
        "--controlplane-url",
        controlplane_url,
    ]


def _secret_env(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _env(pool: str, namespace: str, spec: PoolSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "LORAPLANE_POOL", "value": pool},
        {"name": "LORAPLANE_POOL_NAMESPACE", "value": namespace},
        {"name": "LORAPLANE_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "LORAPLANE_USAGE_SPOOL_DIR", "value": SPOOL_MOUNT},
    ]
    if spec.service_token:
        env.append(_secret_env("LORAPLANE_SERVICE_TOKEN", spec.service_token))
    if spec.admin_token:
        env.append(_secret_env("LORAPLANE_ADMIN_TOKEN", spec.admin_token))
    store = spec.store or (STORE_MOUNT if spec.store_volume_claim else None)
    if store:
        env.append({"name": "LORAPLANE_STORE", "value": store})
    return env


def _volumes(spec: PoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if spec.model_on_volume:
        claim = {"claimName": spec.model_volume_claim, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": spec.base_model_uri, "readOnly": True})
    if spec.store_volume_claim:
        claim = {"claimName": spec.store_volume_claim}
        volumes.append({"name": "store", "persistentVolumeClaim": claim})
        mounts.append({"name": "store", "mountPath": spec.store or STORE_MOUNT})
    if spec.tensor_parallel_size > 1:
        # the ranks' shared memory (NCCL's transport between the GPUs of a node; the
        # container runtime's default /dev/shm is 64 MiB)
        size = f"{SHM_PER_RANK_GIB * spec.tensor_parallel_size}Gi"
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})  # noqa: S108 - the pod's own
    # the spool file is at most 4 MiB, and its replacement is written beside it
    volumes.append({"name": "usage-spool", "emptyDir": {"sizeLimit": "16Mi"}})
    mounts.append({"name": "usage-spool", "mountPath": SPOOL_MOUNT})
    return volumes, mounts


def resources(spec: PoolSpec) -> dict[str, Any]:
    """The container's resources: the spec's, asking for a GPU per tensor-parallel rank on
    cuda (unless the spec says it already)."""
    out = {key: dict(value) for key, value in spec.resources.items()}
    if spec.device == "cuda" and spec.tensor_parallel_size > 1:
        for key in ("limits", "requests"):
            out.setdefault(key, {}).setdefault(GPU_RESOURCE, str(spec.tensor_parallel_size))
    return out


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 3,
    }


def deployment(
    name: str,
    namespace: str,
    spec: PoolSpec,
    *,
    controlplane_url: str,
    replicas: int | None,
) -> dict[str, Any]:
    """The pool's Deployment; `replicas` None leaves the count to someone else (an HPA)."""
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["loraplane"],
        "args": serve_args(spec, controlplane_url),
        "env": _env(name, namespace, spec),
        "ports": [
            {"name": "http", "containerPort": PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
            {"name": "gateway-metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"},
        ],
        # The startup probe waits for the model (/ready: loaded), up to 30 minutes (a large
        # model from a volume or the network), and kills a load hung past that; liveness and
        # readiness begin only once it passed, so a loading pod is never killed. Liveness
        # (/health: the engine thread runs) restarts a pod 30 s after its engine thread died;
        # readiness (/ready: the engine steps) takes a stalled or failing pod out of rotation
        # within 10 s of /ready saying so, and back as soon as it steps again.
        "startupProbe": _probe("/ready", 10, 180),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),
        "resources": resources(spec),
        "volumeMounts": mounts,
    }
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "template": {
                "metadata": {"labels": pod_labels(name, spec)},
                "spec": {"containers": [container], "volumes": volumes},
            },
        },
    }
    if replicas is not None:
        body["spec"]["replicas"] = replicas
    return body


def service(name: str, namespace: str) -> dict[str, Any]:
    """The pool's ClusterIP Service on port 8000."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def initial_replicas(spec: PoolSpec, current: int | None) -> int:
    """Replicas to write with a spec change: the current count kept within [min, max]."""
    if current is None:
        return spec.min_replicas
    return max(spec.min_replicas, min(spec.max_replicas, current))
