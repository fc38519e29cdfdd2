"""The operator's client of the control plane (the catalog).

- `POST /internal/v1/versions` (service token): record a version the operator stored.
- `DELETE /internal/v1/tenants/{tenant}/adapters/{name}` (service token): mark an adapter
  deleted, its versions kept (404: nothing to delete).
- `PUT/GET/DELETE /internal/v1/pools/{pool}?namespace=` (service token): mirror a ServingPool
  (the catalog names pools by namespace and name, as Kubernetes does), read the pressure and
  base model config its replicas report, forget it when the ServingPool is deleted.

Errors are `CatalogError`s carrying the control plane's error code and whether a retry can help.
"""

from __future__ import annotations

from typing import Any

import httpx

from loraplane.adapters.ingest import AdapterVersion


class CatalogError(Exception):
    """A control plane call failed; `code` is its error code (or ours for transport errors)."""

    def __init__(self, code: str, message: str, *, status: int | None, transient: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.transient = transient


class CatalogClient:
    """Synchronous (run it off the event loop) and thread-safe: one httpx client."""

    def __init__(
        self,
        base_url: str,
        service_token: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport
        )
        self._service = {"Authorization": f"Bearer {service_token}"}

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Any = None,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        try:
            return self._http.request(method, path, headers=headers, json=body, params=params)
        except httpx.HTTPError as exc:
            raise CatalogError(
                "ControlPlaneUnavailable",
                f"cannot reach the control plane: {exc}",
                status=None,
                transient=True,
            ) from exc

    @staticmethod
    def _error(response: httpx.Response) -> CatalogError:
        try:
            err = response.json().get("error") or {}
        except ValueError:
            err = {}
        code = str(err.get("code") or f"HTTP{response.status_code}")
        message = str(err.get("message") or response.text[:200])
        transient = response.status_code >= 500 or response.status_code in (401, 404, 409, 429)
        if response.status_code >= 500:
            code = "ControlPlaneUnavailable" if code == "InternalError" else code
        return CatalogError(code, message, status=response.status_code, transient=transient)

    def record_version(self, tenant: str, name: str, version: AdapterVersion) -> bool:
        """Record a stored version (idempotent); True if the catalog did not have it."""
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
        }
        response = self._call("POST", "/internal/v1/versions", self._service, body)
        if response.status_code not in (200, 201):
            raise self._error(response)
        return response.status_code == 201

    def delete_adapter(self, tenant: str, name: str) -> bool:
        """Mark an adapter deleted (versions kept); False if the catalog had none live."""
        path = f"/internal/v1/tenants/{tenant}/adapters/{name}"
        response = self._call("DELETE", path, self._service)
        if response.status_code == 404:
            return False
        if response.status_code not in (200, 204):
            raise self._error(response)
        return True

    def _pool(self, method: str, namespace: str, name: str, body: Any = None) -> httpx.Response:
        path = f"/internal/v1/pools/{name}"
        return self._call(method, path, self._service, body, params={"namespace": namespace})

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A pool as the control plane knows it (with pressure and base model config), or
        None."""
        response = self._pool("GET", namespace, name)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._error(response)
        pool: dict[str, Any] = response.json()
        return pool

    def ensure_pool(
        self, namespace: str, name: str, base_model: dict[str, Any], limits: dict[str, int]
    ) -> dict[str, Any]:
        """Create the pool, or bring its limits to `limits`; returns the catalog's pool.

        A pool registered with another base model is a `BaseModelConflict` (not transient):
        the control plane keeps a pool's base model for life.
        """
        body = {"namespace": namespace, "name": name, "base_model": base_model, **limits}
        response = self._pool("PUT", namespace, name, body)
        if response.status_code == 409:
            error = self._error(response)
            raise CatalogError("BaseModelConflict", error.message, status=409, transient=False)
        if response.status_code not in (200, 201):
            raise self._error(response)
        pool: dict[str, Any] = response.json()
        return pool

    def delete_pool(self, namespace: str, name: str) -> bool:
        """Forget a pool whose ServingPool is gone; False if the catalog had none."""
        response = self._pool("DELETE", namespace, name)
        if response.status_code == 404:
            return False
        if response.status_code not in (200, 204):
            raise self._error(response)
        return True
