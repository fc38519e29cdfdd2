"""A ServingPool's InferencePool (`inference.networking.k8s.io/v1`, Gateway API Inference
Extension).

With `spec.routing.inferencePool.enabled` the operator creates and owns an InferencePool named
like the pool: it selects the pool's pods (`loraplane.io/pool`), targets their API port and
names the endpoint picker (EPP) that routes each request to a replica. Traffic goes to the API
port; the EPP scrapes the replicas' vLLM-compatible metrics on their gateway-metrics port (the
chart's EndpointPickerConfig says which port) and scores them (the llm-d router's
`lora-affinity-scorer` prefers a replica whose GPU already holds the request's adapter).

The InferencePool CRD belongs to the cluster, not to loraplane. Where it is not installed the
pool says so in its `InferencePoolReady` condition (`CRDNotInstalled`) and serves on through its
Service; the pool timer looks again now and then (`RETRY_REASONS`). An InferencePool of that name
the pool does not own is never touched (`NotOwned`). Turning routing off deletes the owned one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from loraplane.operator import manifests
from loraplane.operator.kube import KubeApi
from loraplane.operator.specs import PoolSpec

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
KIND = "InferencePool"
CONDITION = "InferencePoolReady"
# reasons a later look may change without a spec change: the CRD or the RBAC may arrive, the
# API server may answer again
RETRY_REASONS = frozenset({"CRDNotInstalled", "Forbidden", "APIError"})


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of the InferencePool: the condition to report."""

    ready: bool
    reason: str
    message: str


def manifest(name: str, namespace: str, spec: PoolSpec) -> dict[str, Any]:
    """The InferencePool of pool `name` (owner references are added by the caller)."""
    routing = spec.routing
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": manifests.labels(name)},
        "spec": {
            "selector": {"matchLabels": manifests.selector_labels(name)},
            "targetPorts": [{"number": manifests.PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": routing.picker_name(name),
                "port": {"number": routing.picker_port},
                "failureMode": routing.failure_mode,
            },
        },
    }


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Whether `obj` names the object with `uid` among its owners."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return uid is not None and any(ref.get("uid") == uid for ref in refs)


def _describe(name: str, namespace: str, spec: PoolSpec) -> str:
    routing = spec.routing
    return (
        f"InferencePool {namespace}/{name} selects loraplane.io/pool={name} on port "
        f"{manifests.PORT}; endpoint picker Service {routing.picker_name(name)}:"
        f"{routing.picker_port} ({routing.failure_mode})"
    )


def _api_error(exc: ApiException, doing: str) -> Outcome:
    if exc.status == 403:
        return Outcome(
            False,
            "Forbidden",
            f"the operator may not {doing} inferencepools.{GROUP}: grant it get, create, "
            "patch and delete (the chart's RBAC does)",
        )
    return Outcome(False, "APIError", f"{doing} the InferencePool: {exc.status} {exc.reason}")


def reconcile(
    kube: KubeApi,
    owner: kopf.Body,
    name: str,
    namespace: str,
    spec: PoolSpec,
    *,
    reported: bool,
) -> Outcome | None:
    """Bring the pool's InferencePool to the spec (blocking); the condition to report, or None
    when there is nothing to say (routing off and never reported on)."""
    uid = owner.get("metadata", {}).get("uid")
    if not spec.routing.inference_pool:
        if not reported:  # never enabled: no call to an API that may not exist
            return None
        return _disable(kube, name, namespace, uid)
    try:
        if not kube.serves(GROUP, VERSION, PLURAL):
            return Outcome(
                False,
                "CRDNotInstalled",
                f"{PLURAL}.{GROUP}/{VERSION} is not served: install the Gateway API Inference "
                "Extension CRDs; the pool serves through its Service meanwhile",
            )
        current = kube.read_custom(GROUP, VERSION, PLURAL, namespace, name)
        if current is not None and not owned_by(current, uid):
            return Outcome(
                False,
                "NotOwned",
                f"an InferencePool {namespace}/{name} exists that this pool does not own: "
                "left as it is (delete it, or rename one of them)",
            )
        body = manifest(name, namespace, spec)
        kopf.adopt(body, owner=owner)
        kube.apply_custom(GROUP, VERSION, PLURAL, body, exists=current is not None)
    except ApiException as exc:
        return _api_error(exc, "manage")
    except HTTPError as exc:  # no answer at all: the timer looks again
        return Outcome(False, "APIError", f"managing the InferencePool: {exc}")
    reason = "Created" if current is None else "Updated"
    return Outcome(True, reason, _describe(name, namespace, spec))


def _disable(kube: KubeApi, name: str, namespace: str, uid: str | None) -> Outcome:
    message = "spec.routing.inferencePool.enabled is false"
    try:
        if not kube.serves(GROUP, VERSION, PLURAL):
            return Outcome(False, "Disabled", message)
        current = kube.read_custom(GROUP, VERSION, PLURAL, namespace, name)
        if current is not None and owned_by(current, uid):
            kube.delete_custom(GROUP, VERSION, PLURAL, namespace, name)
            message += f": InferencePool {namespace}/{name} deleted"
    except (ApiException, HTTPError) as exc:
        failed = _api_error(exc, "delete") if isinstance(exc, ApiException) else None
        return Outcome(False, "Disabled", f"{message}; {failed.message if failed else exc}")
    return Outcome(False, "Disabled", message)


def condition_of(conditions: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any] | None:
    """The pool's InferencePoolReady condition, if it has one."""
    return next((c for c in conditions or [] if c.get("type") == CONDITION), None)
