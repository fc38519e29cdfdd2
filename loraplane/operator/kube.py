"""The few Kubernetes API calls the operator makes itself (Kopf makes the rest).

A thin, synchronous wrapper over the official client (run it off the event loop) that speaks
plain dicts: read a Secret, patch a resource's status, create-or-patch the Deployment, Service
and InferencePool a pool owns, and ask discovery whether a resource type is served. The
operator never patches a LoRAAdapter's or ServingPool's spec.
"""

from __future__ import annotations

import base64
import json
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import load_incluster_config
from kubernetes.config.kube_config import load_kube_config

from loraplane.operator.specs import GROUP, VERSION

# Lists (containers, env, ports) are replaced whole, so removed entries really go.
MERGE_PATCH = "application/merge-patch+json"


def load_configuration() -> client.Configuration:
    """In-cluster credentials, else the local kubeconfig."""
    configuration = client.Configuration()
    try:
        load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except ConfigException:
        load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


def _json(response: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(response.data)
    return data


class KubeApi:
    """Secrets, status patches and pool children, as dicts."""

    def __init__(self, configuration: client.Configuration) -> None:
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def close(self) -> None:
        """Release the connection pool."""
        self.api.close()  # type: ignore[no-untyped-call]

    def read_secret(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's data, decoded; None if there is no such Secret."""
        try:
            secret = _json(
                self.core.read_namespaced_secret(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = secret.get("data") or {}
        out = {k: base64.b64decode(v).decode("utf-8") for k, v in data.items()}
        out.update(secret.get("stringData") or {})
        return out

    def patch_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge `status` into a custom resource's status (the status subresource)."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, plural, name, {"status": status}
        )

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in group/version (its CRD is installed)."""
        try:
            found = _json(self.custom.get_api_resources(group, version, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:  # the group/version is not served at all
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources") or [])

    def read_custom(
        self, group: str, version: str, plural: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """A namespaced custom object, or None."""
        try:
            return _json(
                self.custom.get_namespaced_custom_object(
                    group, version, namespace, plural, name, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def apply_custom(
        self, group: str, version: str, plural: str, manifest: dict[str, Any], exists: bool
    ) -> None:
        """Create a namespaced custom object, or merge-patch it to `manifest`."""
        meta = manifest["metadata"]
        if exists:
            self.custom.patch_namespaced_custom_object(
                group, version, meta["namespace"], plural, meta["name"], manifest
            )
        else:
            self.custom.create_namespaced_custom_object(
                group, version, meta["namespace"], plural, manifest
            )

    def delete_custom(
        self, group: str, version: str, plural: str, namespace: str, name: str
    ) -> None:
        """Delete a namespaced custom object (gone already is fine)."""
        try:
            self.custom.delete_namespaced_custom_object(group, version, namespace, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def read_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Deployment, or None."""
        try:
            return _json(
                self.apps.read_namespaced_deployment(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def apply_deployment(self, manifest: dict[str, Any], exists: bool) -> None:
        """Create the Deployment, or patch it to `manifest` (a rollout when the pod changes)."""
        meta = manifest["metadata"]
        if exists:
            self.apps.patch_namespaced_deployment(
                meta["name"], meta["namespace"], manifest, _content_type=MERGE_PATCH
            )
        else:
            self.apps.create_namespaced_deployment(meta["namespace"], cast(Any, manifest))

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        """Set a Deployment's replicas."""
        self.apps.patch_namespaced_deployment(
            name, namespace, {"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH
        )

    def apply_service(self, manifest: dict[str, Any]) -> None:
        """Create the Service, or patch its ports and selector."""
        meta = manifest["metadata"]
        try:
            self.core.read_namespaced_service(
                meta["name"], meta["namespace"], _preload_content=False
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.core.create_namespaced_service(meta["namespace"], cast(Any, manifest))
            return
        self.core.patch_namespaced_service(
            meta["name"], meta["namespace"], manifest, _content_type=MERGE_PATCH
        )
