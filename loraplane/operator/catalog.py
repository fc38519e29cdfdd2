"""The operator's client of the control plane (the catalog).

- `POST /internal/v1/versions` (service token): record a version the operator stored, with
  the signature it verified.
- `GET /internal/v1/tenants/{namespace}/signing-policy?base_model=` (service token): whether
  an adapter must be signed and the tenant's signing keys (404: no tenant has the namespace).
- `DELETE /internal/v1/tenants/{tenant}/adapters/{name}` (service token): mark an adapter
  deleted, its versions kept (404: nothing to delete).
- `PUT /internal/v1/tenants/{tenant}/adapters/{name}/rollout` (service token): a
  LoRAAdapter's `spec.rollout`, the weighted split of its versions (or none).
- `PUT/GET/DELETE /internal/v1/pools/{pool}?namespace=` (service token): mirror a ServingPool
  (the catalog names pools by namespace and name, as Kubernetes does), read the pressure and
  base model config its replicas report, forget it when the ServingPool is deleted.

Calls go through `loraplane.internal_api.InternalAPIClient`; its errors (`CatalogError` here)
carry the control plane's error code and whether a retry can help, by its one rule.
"""

from __future__ import annotations

from typing import Any

import httpx

from loraplane.adapters.ingest import AdapterVersion
from loraplane.internal_api import InternalAPIClient, InternalAPIError, json_of

CatalogError = InternalAPIError  # the operator's name for the internal API's error


class CatalogClient:
    """Synchronous (run it off the event loop) and thread-safe: one internal API client."""

    def __init__(
        self,
        base_url: str,
        service_token: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._api = InternalAPIClient(base_url, service_token, timeout=timeout, transport=transport)

    def close(self) -> None:
        """Close the connection pool."""
        self._api.close()

    def record_version(
        self,
        tenant: str,
        name: str,
        version: AdapterVersion,
        *,
        signature: str | None = None,
        signature_key_id: str | None = None,
    ) -> bool:
        """Record a stored version (idempotent; the catalog verifies its signature again);
        True if the catalog did not have it."""
        body = {
            "tenant": tenant,
            "name": name,
            "version": version.version,
            "digest": version.digest,
            "path": version.path,
            "rank": version.rank,
            "alpha": version.alpha,
            "target_modules": list(version.target_modules),
            "size_bytes": version.size_bytes,
            "base_model": version.base_model,
            "created_by": "operator",
            "signature": signature,
            "signature_key_id": signature_key_id,
        }
        response = self._api.request("POST", "/internal/v1/versions", json=body)
        return response.status_code == 201

    def signing_policy(self, namespace: str, base_model: str) -> dict[str, Any]:
        """`{"required", "reason", "keys": [{"key_id", "public_key", "revoked"}]}` for an
        adapter in `namespace` for `base_model` (CatalogError 404: no such tenant)."""
        path = f"/internal/v1/tenants/{namespace}/signing-policy"
        response = self._api.request("GET", path, params={"base_model": base_model})
        policy: dict[str, Any] = json_of(response)
        return policy

    def delete_adapter(self, tenant: str, name: str) -> bool:
        """Mark an adapter deleted (versions kept); False if the catalog had none live."""
        path = f"/internal/v1/tenants/{tenant}/adapters/{name}"
        return self._api.request("DELETE", path, allow=(404,)).status_code != 404

    def set_rollout(self, tenant: str, name: str, weights: dict[int, int] | None) -> dict[str, Any]:
        """Serve `weights` ({version: weight}, summing to 100) for the adapter's plain name,
        or no split (None: a running one is rolled back); the adapter as the catalog has it
        (CatalogError 404: no such adapter or version yet)."""
        path = f"/internal/v1/tenants/{tenant}/adapters/{name}/rollout"
        split = None if weights is None else {str(v): w for v, w in weights.items()}
        adapter: dict[str, Any] = json_of(self._api.request("PUT", path, json={"rollout": split}))
        return adapter

    def _pool(
        self, method: str, namespace: str, name: str, body: Any = None, allow: tuple[int, ...] = ()
    ) -> httpx.Response:
        path = f"/internal/v1/pools/{name}"
        params = {"namespace": namespace}
        return self._api.request(method, path, json=body, params=params, allow=allow)

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A pool as the control plane knows it (with pressure and base model config), or
        None."""
        response = self._pool("GET", namespace, name, allow=(404,))
        if response.status_code == 404:
            return None
        pool: dict[str, Any] = json_of(response)
        return pool

    def ensure_pool(
        self, namespace: str, name: str, base_model: dict[str, Any], limits: dict[str, int]
    ) -> dict[str, Any]:
        """Create the pool, or bring its limits to `limits`; returns the catalog's pool.

        A pool registered with another base model is a `BaseModelConflict` (not transient):
        the control plane keeps a pool's base model for life.
        """
        body = {"namespace": namespace, "name": name, "base_model": base_model, **limits}
        try:
            response = self._pool("PUT", namespace, name, body)
        except InternalAPIError as exc:
            if exc.status == 409:
                raise InternalAPIError(
                    "BaseModelConflict", exc.message, status=409, transient=False
                ) from exc
            raise
        pool: dict[str, Any] = json_of(response)
        return pool

    def delete_pool(self, namespace: str, name: str) -> bool:
        """Forget a pool whose ServingPool is gone; False if the catalog had none."""
        return self._pool("DELETE", namespace, name, allow=(404,)).status_code != 404
