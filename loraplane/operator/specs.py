"""Typed views of the two custom resources' specs, with the defaults the CRDs declare.

The API server applies the CRD defaults; these views apply the same ones (from the same
constants) so the operator behaves identically when a field is missing, e.g. against an API
server that does not default. Parsing is pure: a spec that can never work raises `SpecError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplane.adapters.base_model import (
    BaseModelSpec,
    fp8_block_split_problem,
    tensor_parallel_problem,
    w4_split_problem,
)
from loraplane.sizes import parse_bytes, parse_memory

GROUP = "loraplane.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ADAPTERS = "loraadapters"
POOLS = "servingpools"

# Patterns shared with the control plane's request schemas (schemas/common.py).
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$"
RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
BASE_MODEL_URI = r"^(s3://[^\s]+|/[^\s]*)$"
# a signature as cosign prints it (base64, at most 512 characters) and a signing key's id
SIGNATURE = r"^[A-Za-z0-9+/]{1,510}={0,2}$"
SIGNING_KEY_ID = r"^[0-9a-f]{16}$"
SOURCE_URI = (
    r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]+"
    r"|https://[A-Za-z0-9.-]+(:[0-9]{1,5})?/[^\s]*"
    r"|upload://[A-Za-z0-9][A-Za-z0-9._-]{0,127})$"
)

# ServingPool defaults (the CRD's `default:` values come from here).
DEFAULT_MIN_REPLICAS = 1
DEFAULT_MAX_REPLICAS = 1
DEFAULT_MAX_LORA_RANK = 64
# lora.maxLoras and lora.maxCpuLoras default to the data plane's auto sizing (memory decides);
# lora.memory to its default share (--lora-memory 0.1)
LORA_MEMORY = r"^[0-9. ]+[A-Za-z]{0,3}$"  # the CRD's coarse check; parse_memory decides
CPU_LORA_BYTES = (
    r"^[0-9]+(\.[0-9]+)? ?[A-Za-z]{0,3}$"  # the CRD's coarse check; parse_bytes decides
)
DEFAULT_DEVICE = "cuda"
DEFAULT_DEFERRED_PER_REPLICA = 4
DEFAULT_WAITING_ADAPTERS_PER_REPLICA = 2
DEFAULT_SCALE_UP_SECONDS = 30
DEFAULT_SCALE_DOWN_SECONDS = 300
DEFAULT_TOKEN_KEY = "token"  # noqa: S105 - a key name in a Secret, not a secret
# who writes the Deployment's replica count: the operator's policy, or a KEDA ScaledObject
AUTOSCALING_MODES = ("operator", "keda")
DEFAULT_AUTOSCALING_MODE = "operator"
# spec.routing: the endpoint picker (EPP) of the Gateway API Inference Extension. The llm-d
# router's charts serve it as Service `<release, at most 40 characters>-epp` on port 9002; a
# dead picker costs affinity, not availability (every replica can load every adapter).
SERVICE_NAME = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
DEFAULT_EPP_PORT = 9002
FAILURE_MODES = ("FailOpen", "FailClose")
DEFAULT_FAILURE_MODE = "FailOpen"

# what `loraplane serve --quantization` takes (the data plane's config.QUANTIZATIONS, which the
# operator does not import; tests/operator/test_units.py checks the two agree)
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
MAX_TENSOR_PARALLEL_SIZE = 8  # the GPUs of one node
GPU_RESOURCE = "nvidia.com/gpu"
# what `loraplane serve --kv-cache-dtype` takes (config.KV_CACHE_DTYPES, checked the same way)
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")


MAX_ROLLOUT_VERSIONS = 4  # the catalog's bound (controlplane/crud/rollouts.py)


class SpecError(ValueError):
    """A spec the operator can never act on (the CRD schema should have refused it)."""


def _get(obj: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = obj.get(key) or {}
    if not isinstance(value, Mapping):
        raise SpecError(f"spec.{key} must be an object")
    return value


def _int(obj: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = obj.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SpecError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _opt_int(obj: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    return None if obj.get(key) is None else _int(obj, key, low, low, high)


def _lora_memory(value: object) -> str | None:
    """spec.lora.memory as the data plane will read it (`--lora-memory`), or None."""
    if value is None:
        return None
    try:
        parse_memory(value if isinstance(value, str | int | float) else repr(value))
    except ValueError as e:
        raise SpecError(f"spec.lora.memory: {e}") from None
    return str(value)


def _cpu_lora_bytes(value: object) -> int | None:
    """spec.lora.maxCpuLoraBytes in bytes, as the data plane will read it
    (`--max-cpu-lora-bytes`), or None."""
    if value is None:
        return None
    try:
        return parse_bytes(value if isinstance(value, str | int) else repr(value), "size")
    except ValueError as e:
        raise SpecError(f"spec.lora.maxCpuLoraBytes: {e}") from None


def _match(pattern: str, value: object, field: str) -> str:
    if not isinstance(value, str) or not re.match(pattern, value):
        raise SpecError(f"{field} {value!r} does not match {pattern}")
    return value


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A LoRAAdapter's spec: which base model, where the files are, the served name."""

    base_model: str
    source_uri: str
    secret_name: str | None
    served_name: str | None
    # `spec.source.signature` (base64, as cosign sign-blob prints it) and `signatureKeyId`
    signature: str | None = None
    signature_key_id: str | None = None

    @classmethod
    def parse_rollout(cls, spec: Mapping[str, Any]) -> dict[int, int] | None:
        """`spec.rollout` as {version: weight} (None when absent or empty: no split); a
        SpecError, in words, for a split the catalog would refuse."""
        items = spec.get("rollout")
        if not items:
            return None
        if not isinstance(items, list) or len(items) > MAX_ROLLOUT_VERSIONS:
            raise SpecError(f"spec.rollout is a list of at most {MAX_ROLLOUT_VERSIONS} versions")
        weights: dict[int, int] = {}
        for item in items:
            version = item.get("version") if isinstance(item, Mapping) else None
            weight = item.get("weight") if isinstance(item, Mapping) else None
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise SpecError("spec.rollout[].version is a version number (1 or more)")
            if not isinstance(weight, int) or isinstance(weight, bool) or not 0 <= weight <= 100:
                raise SpecError("spec.rollout[].weight is an integer from 0 to 100")
            if version in weights:
                raise SpecError(f"spec.rollout names version {version} twice")
            weights[version] = weight
        if sum(weights.values()) != 100:
            raise SpecError(
                f"spec.rollout's weights sum to 100; these sum to {sum(weights.values())}"
            )
        return weights

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> AdapterSpec:
        """Read and check a LoRAAdapter's spec."""
        source = _get(spec, "source")
        secret = source.get("secretRef") or {}
        served = spec.get("servedName")
        signature = source.get("signature")
        key_id = source.get("signatureKeyId")
        return cls(
            base_model=_match(MODEL_NAME, spec.get("baseModel"), "spec.baseModel"),
            source_uri=_match(SOURCE_URI, source.get("uri"), "spec.source.uri"),
            secret_name=(
                _match(DNS_SUBDOMAIN, secret.get("name"), "spec.source.secretRef.name")
                if secret
                else None
            ),
            served_name=_match(RESOURCE_NAME, served, "spec.servedName") if served else None,
            signature=(
                _match(SIGNATURE, signature.strip(), "spec.source.signature")
                if isinstance(signature, str) and signature.strip()
                else None
            ),
            signature_key_id=(
                _match(SIGNING_KEY_ID, key_id, "spec.source.signatureKeyId") if key_id else None
            ),
        )

    def catalog_name(self, metadata_name: str) -> str:
        """The adapter's name in the catalog and the API: servedName or metadata.name."""
        name = self.served_name or metadata_name
        return _match(RESOURCE_NAME, name, "the adapter name (servedName or metadata.name)")


@dataclass(frozen=True, slots=True)
class SecretKeyRef:
    """A key of a Secret in the pool's namespace."""

    name: str
    key: str


@dataclass(frozen=True, slots=True)
class Autoscaling:
    """The pool's scaling targets (per replica) and stabilization windows."""

    enabled: bool = True
    mode: str = DEFAULT_AUTOSCALING_MODE
    deferred_per_replica: int = DEFAULT_DEFERRED_PER_REPLICA
    waiting_adapters_per_replica: int = DEFAULT_WAITING_ADAPTERS_PER_REPLICA
    scale_up_seconds: int = DEFAULT_SCALE_UP_SECONDS
    scale_down_seconds: int = DEFAULT_SCALE_DOWN_SECONDS

    @property
    def operator_scales(self) -> bool:
        """Whether the operator writes the replica count (else a KEDA ScaledObject or an HPA
        owns it, and the operator never touches it)."""
        return self.enabled and self.mode == "operator"


@dataclass(frozen=True, slots=True)
class Routing:
    """spec.routing: an InferencePool selecting the pool's pods, for a Gateway (or the llm-d
    router) whose endpoint picker routes each request to a replica, LoRA affinity included."""

    inference_pool: bool = False
    picker_service: str | None = None  # None: the llm-d router's name for a release = the pool
    picker_port: int = DEFAULT_EPP_PORT
    failure_mode: str = DEFAULT_FAILURE_MODE

    def picker_name(self, pool: str) -> str:
        """The endpoint picker's Service: as given, else `<pool, 40 characters>-epp`."""
        return self.picker_service or f"{pool[:40]}-epp"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A ServingPool's spec with defaults applied."""

    base_model_name: str
    base_model_uri: str
    model_volume_claim: str | None
    image: str
    min_replicas: int
    max_replicas: int
    max_loras: int | None  # None: auto
    max_lora_rank: int
    max_cpu_loras: int | None  # None: auto
    max_cpu_lora_bytes: int | None  # host bytes of the host tier; None: no byte limit
    lora_memory: str | None  # None: the data plane's default
    device: str
    resources: dict[str, Any]
    cuda_graphs: bool | None  # None: the data plane's default (on for cuda)
    quantization: str | None  # "fp8": the base quantized at load (--quantization)
    tensor_parallel_size: int  # processes (GPUs) each replica splits the base over
    kv_cache_dtype: str | None  # "fp8": the KV cache in float8 e4m3 (--kv-cache-dtype)
    autoscaling: Autoscaling
    routing: Routing
    service_token: SecretKeyRef | None
    admin_token: SecretKeyRef | None
    store: str | None
    store_volume_claim: str | None

    @property
    def model_on_volume(self) -> bool:
        """Whether the base model is on `model_volume_claim`, which only the pool's pods mount
        (at `base_model_uri`): its config.json then comes from their pressure reports."""
        return self.model_volume_claim is not None and not self.base_model_uri.startswith("s3://")

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> PoolSpec:
        """Read and check a ServingPool's spec."""
        base = _get(spec, "baseModel")
        replicas = _get(spec, "replicas")
        lora = _get(spec, "lora")
        scaling = _get(spec, "autoscaling")
        low = _int(replicas, "min", DEFAULT_MIN_REPLICAS, 1, 1000)
        high = _int(replicas, "max", max(low, DEFAULT_MAX_REPLICAS), 1, 1000)
        if low > high:
            raise SpecError(f"spec.replicas.min {low} is above spec.replicas.max {high}")
        image = spec.get("image")
        if not isinstance(image, str) or not image:
            raise SpecError("spec.image must be a container image reference")
        device = spec.get("device", DEFAULT_DEVICE)
        if device not in ("cpu", "cuda"):
            raise SpecError(f"spec.device must be cpu or cuda, got {device!r}")
        cuda_graphs = spec.get("cudaGraphs")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise SpecError(f"spec.cudaGraphs must be true or false, got {cuda_graphs!r}")
        if cuda_graphs and device != "cuda":
            raise SpecError("spec.cudaGraphs needs spec.device cuda")
        quantization = spec.get("quantization")
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise SpecError(
                f"spec.quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
            )
        tp = _int(spec, "tensorParallelSize", 1, 1, MAX_TENSOR_PARALLEL_SIZE)
        gpus = ((spec.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE)
        if tp > 1 and device == "cuda" and gpus is not None and str(gpus) != str(tp):
            raise SpecError(
                f"spec.resources.limits {GPU_RESOURCE} is {gpus}, but spec.tensorParallelSize"
                f" {tp} needs {tp} (leave it unset: the pod asks for {tp})"
            )
        if tp > 1 and cuda_graphs:
            raise SpecError("spec.cudaGraphs is not supported with spec.tensorParallelSize > 1 yet")
        kv_cache_dtype = spec.get("kvCacheDtype")
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SpecError(
                f"spec.kvCacheDtype must be one of {', '.join(KV_CACHE_DTYPES)}, got"
                f" {kv_cache_dtype!r}"
            )
        claim = base.get("volumeClaim")
        store_claim = spec.get("storeVolumeClaim")
        return cls(
            base_model_name=_match(MODEL_NAME, base.get("name"), "spec.baseModel.name"),
            base_model_uri=_match(BASE_MODEL_URI, base.get("uri"), "spec.baseModel.uri"),
            model_volume_claim=_match(DNS_SUBDOMAIN, claim, "volumeClaim") if claim else None,
            image=image,
            min_replicas=low,
            max_replicas=high,
            max_loras=_opt_int(lora, "maxLoras", 1, 1024),
            max_lora_rank=_int(lora, "maxLoraRank", DEFAULT_MAX_LORA_RANK, 1, 4096),
            max_cpu_loras=_opt_int(lora, "maxCpuLoras", 1, 100_000),
            max_cpu_lora_bytes=_cpu_lora_bytes(lora.get("maxCpuLoraBytes")),
            lora_memory=_lora_memory(lora.get("memory")),
            device=device,
            resources=dict(_get(spec, "resources")),
            cuda_graphs=cuda_graphs,
            quantization=quantization,
            tensor_parallel_size=tp,
            kv_cache_dtype=kv_cache_dtype,
            autoscaling=Autoscaling(
                enabled=bool(scaling.get("enabled", True)),
                mode=_enum(scaling, "mode", AUTOSCALING_MODES, DEFAULT_AUTOSCALING_MODE),
                deferred_per_replica=_int(
                    scaling, "deferredPerReplica", DEFAULT_DEFERRED_PER_REPLICA, 1, 1_000_000
                ),
                waiting_adapters_per_replica=_int(
                    scaling,
                    "waitingAdaptersPerReplica",
                    DEFAULT_WAITING_ADAPTERS_PER_REPLICA,
                    1,
                    1_000_000,
                ),
                scale_up_seconds=_int(
                    scaling, "scaleUpStabilizationSeconds", DEFAULT_SCALE_UP_SECONDS, 0, 3600
                ),
                scale_down_seconds=_int(
                    scaling, "scaleDownStabilizationSeconds", DEFAULT_SCALE_DOWN_SECONDS, 0, 86400
                ),
            ),
            routing=_routing(_get(spec, "routing")),
            service_token=_secret_ref(spec, "serviceTokenSecretRef"),
            admin_token=_secret_ref(spec, "adminTokenSecretRef"),
            store=spec.get("store") or None,
            store_volume_claim=(
                _match(DNS_SUBDOMAIN, store_claim, "storeVolumeClaim") if store_claim else None
            ),
        )


def _secret_ref(spec: Mapping[str, Any], key: str) -> SecretKeyRef | None:
    ref = _get(spec, key)
    if not ref:
        return None
    return SecretKeyRef(
        name=_match(DNS_SUBDOMAIN, ref.get("name"), f"spec.{key}.name"),
        key=str(ref.get("key") or DEFAULT_TOKEN_KEY),
    )


def _enum(obj: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = obj.get(key, default)
    if value not in allowed:
        raise SpecError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _routing(routing: Mapping[str, Any]) -> Routing:
    pool = _get(routing, "inferencePool")
    picker = _get(routing, "endpointPicker")
    service = picker.get("service")
    return Routing(
        inference_pool=bool(pool.get("enabled", False)),
        picker_service=(
            _match(SERVICE_NAME, service, "spec.routing.endpointPicker.service")
            if service
            else None
        ),
        picker_port=_int(picker, "port", DEFAULT_EPP_PORT, 1, 65535),
        failure_mode=_enum(picker, "failureMode", FAILURE_MODES, DEFAULT_FAILURE_MODE),
        # endpointPicker.adapterAffinity is deprecated and read by nobody: the picker always
        # finds adapter names on the gateway-metrics port (manifests.GATEWAY_METRICS_PORT)
    )


def check_quantization(
    asked: str | None, stored: str | None, base: BaseModelSpec, size: int = 1, group: int = 0,
    block: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """SpecError when the data plane would refuse the base's weights in the form
    spec.quantization (`asked`) and its checkpoint (`stored`: "int4", "fp8", "unsupported",
    None) give, split over `size` ranks (a 4-bit checkpoint's groups of `group` inputs, a
    block-wise FP8 one's scale `block`)."""
    if stored == "unsupported":
        raise SpecError(
            "the base model's quantization_config is a form the data plane does not serve"
            " (FP8 float-quantized, 4-bit AWQ, GPTQ or pack-quantized, or 16 bits)"
        )
    if stored == "int4" and (problem := w4_split_problem(base, size, group)) is not None:
        raise SpecError(f"spec.tensorParallelSize {size}: {problem}")
    if stored == "fp8" and block and (problem := fp8_block_split_problem(base, size, block)):
        raise SpecError(f"spec.tensorParallelSize {size}: {problem}")
    if stored == "int4" and asked is not None:
        raise SpecError(
            f"spec.quantization {asked}: the base model is a 4-bit checkpoint (AWQ, GPTQ or"
            " pack-quantized), served as it is stored: leave spec.quantization out"
        )


def check_tensor_parallel(size: int, base: BaseModelSpec) -> None:
    """SpecError when `base` cannot be split over `size` processes (the data plane's rule,
    `base_model.tensor_parallel_problem`)."""
    problem = tensor_parallel_problem(
        base.model_type, base.num_heads, base.num_kv_heads, base.intermediate_size, size,
        base.moe_intermediate_size,
    )  # fmt: skip
    if problem is not None:
        raise SpecError(f"spec.tensorParallelSize {size}: {problem}")
