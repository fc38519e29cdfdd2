"""Cluster mode's Kubernetes side: the tenant's `LoRAAdapter` resources, as plain dicts.

In cluster mode (`LORAPLANE_KUBERNETES=1`) an upload does not become a version in-process: the
control plane stages the files and creates (or re-points) the tenant's LoRAAdapter, and the
operator ingests it. This module is the only one that talks to the Kubernetes API. It writes
`spec` only (never status, which is the operator's), and turns every API failure into
`KubernetesUnavailable` (503 with Retry-After).

Needs the official `kubernetes` client (`kubernetes==37.0.0`, as the operator); it is imported
only when cluster mode is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException, OpenApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import load_incluster_config
from kubernetes.config.kube_config import load_kube_config

from loraplane.controlplane.errors import Conflict, RetryLater

GROUP = "loraplane.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "loraadapters"
KIND = "LoRAAdapter"
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_SECONDS = 10.0


class KubernetesUnavailable(RetryLater):
    """The Kubernetes API could not be reached or refused the request."""

    code = "KubernetesUnavailable"


def load_configuration() -> client.Configuration:
    """In-cluster credentials, else the local kubeconfig (`KUBECONFIG`); ConfigException if
    neither is there."""
    configuration = client.Configuration()
    try:
        load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except ConfigException:
        load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


@dataclass(frozen=True, slots=True)
class AppliedAdapter:
    """The LoRAAdapter that now points at the source."""

    namespace: str
    name: str
    source_uri: str
    created: bool

    @property
    def resource(self) -> str:
        """`<namespace>/<name>`."""
        return f"{self.namespace}/{self.name}"


def source_of(uri: str, signature: str | None, key_id: str | None) -> dict[str, Any]:
    """A LoRAAdapter's `spec.source`: the uri and the upload's signature. As a merge patch
    the None values delete the fields, so a re-pointed resource never keeps the signature of
    the source before."""
    return {"uri": uri, "signature": signature, "signatureKeyId": key_id}


def adapter_manifest(
    namespace: str,
    name: str,
    base_model: str,
    uri: str,
    signature: str | None = None,
    key_id: str | None = None,
) -> dict[str, Any]:
    """A new LoRAAdapter: the tenant's adapter `name` of `base_model`, read from `uri`."""
    source = {k: v for k, v in source_of(uri, signature, key_id).items() if v is not None}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "loraplane-controlplane"},
        },
        "spec": {"baseModel": base_model, "source": source},
    }


class AdapterResources:
    """Create, re-point and delete LoRAAdapters (blocking: run off the event loop)."""

    def __init__(self, configuration: client.Configuration, *, retry_after: int) -> None:
        self.api = client.ApiClient(configuration)
        self.custom = client.CustomObjectsApi(self.api)
        self.retry_after = retry_after

    def close(self) -> None:
        """Release the connection pool."""
        self.api.close()  # type: ignore[no-untyped-call]

    def _unavailable(self, what: str, exc: Exception) -> KubernetesUnavailable:
        detail = f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else "no answer"
        return KubernetesUnavailable(
            f"the Kubernetes API failed to {what} ({detail}); try again later",
            retry_after=self.retry_after,
        )

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The LoRAAdapter, or None."""
        try:
            obj = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._unavailable(f"read {namespace}/{name}", exc) from exc
        except (OpenApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(f"read {namespace}/{name}", exc) from exc
        return obj if isinstance(obj, dict) else None

    def apply(
        self,
        namespace: str,
        name: str,
        *,
        base_model: str,
        uri: str,
        signature: str | None = None,
        key_id: str | None = None,
    ) -> AppliedAdapter:
        """Create the LoRAAdapter, or merge-patch only its `spec.source` (the uri and the
        signature fields).

        Conflict when the existing resource is for another base model (`baseModel` is
        immutable); KubernetesUnavailable when the API fails.
        """
        for _ in range(3):  # a create that loses a race to another writer becomes a patch
            existing = self.get(namespace, name)
            try:
                if existing is None:
                    self.custom.create_namespaced_custom_object(
                        GROUP,
                        VERSION,
                        namespace,
                        PLURAL,
                        adapter_manifest(namespace, name, base_model, uri, signature, key_id),
                        _request_timeout=REQUEST_TIMEOUT_SECONDS,
                    )
                    return AppliedAdapter(namespace, name, uri, created=True)
                current = (existing.get("spec") or {}).get("baseModel")
                if current != base_model:
                    raise Conflict(
                        f"adapter {name!r} is for base model {current!r}, not {base_model!r}; "
                        "delete it first or use another name"
                    )
                self.custom.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    name,
                    {"spec": {"source": source_of(uri, signature, key_id)}},
                    _content_type=MERGE_PATCH,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
                return AppliedAdapter(namespace, name, uri, created=False)
            except ApiException as exc:
                if exc.status in (404, 409):  # deleted or created meanwhile: look again
                    continue
                raise self._unavailable(f"write {namespace}/{name}", exc) from exc
            except (OpenApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                raise self._unavailable(f"write {namespace}/{name}", exc) from exc
        raise KubernetesUnavailable(
            f"{namespace}/{name} kept changing while it was written; try again",
            retry_after=self.retry_after,
        )

    def delete(self, namespace: str, name: str) -> bool:
        """Delete the LoRAAdapter (the operator's finalizer marks the catalog); False if absent."""
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise self._unavailable(f"delete {namespace}/{name}", exc) from exc
        except (OpenApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(f"delete {namespace}/{name}", exc) from exc
        return True
