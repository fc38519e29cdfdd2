"""The operator's client of the control plane (the catalog).

- `POST /internal/v1/versions` (service token): record a version the operator stored.
- `DELETE /internal/v1/tenants/{tenant}/adapters/{name}` (service token): mark an adapter
  deleted, its versions kept. The control plane does not serve this route yet; its 404 answer
  is taken as "nothing to delete" and reported as `deleted=False, supported=False`.
- `GET/POST/PATCH /v1/pools[/{pool}]` (admin token): mirror a ServingPool and read the pressure
  its replicas report.

Errors are `CatalogError`s carrying the control plane's error code and whether a retry can help.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from loraplane.adapters.ingest import AdapterVersion

ROUTE_MISSING = "Not Found"  # the message of the control plane's 404 for an unknown route


class CatalogError(Exception):
    """A control plane call failed; `code` is its error code (or ours for transport errors)."""

    def __init__(self, code: str, message: str, *, status: int | None, transient: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.transient = transient


@dataclass(frozen=True, slots=True)
class Deleted:
    """The outcome of marking an adapter deleted."""

    deleted: bool
    supported: bool = True


class CatalogClient:
    """Synchronous (run it off the event loop) and thread-safe: one httpx client."""

    def __init__(
        self,
        base_url: str,
        service_token: str,
        admin_token: str | None = None,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport
        )
        self._service = {"Authorization": f"Bearer {service_token}"}
        self._admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else None

    @property
    def has_admin(self) -> bool:
        """Whether pools can be mirrored and their pressure read (needs the admin token)."""
        return self._admin is not None

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(
        self, method: str, path: str, headers: dict[str, str], body: Any = None
    ) -> httpx.Response:
        try:
            return self._http.request(method, path, headers=headers, json=body)
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

    def delete_adapter(self, tenant: str, name: str) -> Deleted:
        """Mark an adapter deleted (versions kept); a missing adapter is already done."""
        path = f"/internal/v1/tenants/{tenant}/adapters/{name}"
        response = self._call("DELETE", path, self._service)
        if response.status_code in (200, 204):
            return Deleted(deleted=True)
        if response.status_code in (404, 405):
            error = self._error(response)
            return Deleted(deleted=False, supported=error.message != ROUTE_MISSING)
        raise self._error(response)

    def _admin_headers(self) -> dict[str, str]:
        if self._admin is None:
            raise CatalogError(
                "NoAdminToken", "LORAPLANE_ADMIN_TOKEN is not set", status=None, transient=False
            )
        return self._admin

    def get_pool(self, name: str) -> dict[str, Any] | None:
        """A pool as the control plane knows it (with pressure), or None."""
        response = self._call("GET", f"/v1/pools/{name}", self._admin_headers())
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._error(response)
        pool: dict[str, Any] = response.json()
        return pool

    def ensure_pool(
        self, name: str, base_model: dict[str, str], limits: dict[str, int]
    ) -> dict[str, Any]:
        """Create the pool, or bring its limits to `limits`; returns the catalog's pool.

        A pool registered with another base model is a `BaseModelConflict` (not transient):
        the control plane keeps a pool's base model for life.
        """
        current = self.get_pool(name)
        if current is None:
            body = {"name": name, "base_model": base_model, **limits}
            response = self._call("POST", "/v1/pools", self._admin_headers(), body)
            if response.status_code == 201:
                created: dict[str, Any] = response.json()
                return created
            if response.status_code != 409:
                raise self._error(response)
            current = self.get_pool(name)
            if current is None:
                raise CatalogError("Conflict", "pool vanished", status=409, transient=True)
        if current.get("base_model") != base_model:
            raise CatalogError(
                "BaseModelConflict",
                f"the control plane's pool {name!r} serves {current.get('base_model')}",
                status=409,
                transient=False,
            )
        changes = {k: v for k, v in limits.items() if current.get(k) != v}
        if not changes:
            return current
        response = self._call("PATCH", f"/v1/pools/{name}", self._admin_headers(), changes)
        if response.status_code != 200:
            raise self._error(response)
        updated: dict[str, Any] = response.json()
        return updated
