"""The control plane's REST API as the tenant CLI calls it (httpx, synchronous).

Every failure becomes an `ApiError` carrying the control plane's `{"error": {"code",
"message"}}` and the HTTP status, or, when no answer came, a client-side code
(`ConnectionFailed`, `BadAnswer`) and no status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from loraplane.tenant_cli.multipart import MultipartBody

FILE_FIELD = "files"
POLL_START_S, POLL_MAX_S = 0.5, 3.0
TIMEOUT = httpx.Timeout(30.0, read=600.0)
# Codes of a failed background upload that say nothing about the adapter: send it again.
RETRYABLE = ("Interrupted", "StoreUnavailable", "DatabaseUnavailable", "InternalError")


class ApiError(Exception):
    """A request that failed: the control plane's error code and message, or why no answer
    came (`status` None).

    `refused`: the control plane answered and refused the request (a 4xx, a rejected upload);
    otherwise it could not be reached or could not answer (connection, 5xx, an interrupted
    job), and trying again may help. By default, from the status.
    """

    def __init__(
        self, code: str, message: str, status: int | None = None, *, refused: bool | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.refused = (
            refused if refused is not None else status is not None and 400 <= status < 500
        )


def _error_of(response: httpx.Response) -> ApiError:
    try:
        error = response.json()["error"]
        return ApiError(str(error["code"]), str(error["message"]), response.status_code)
    except (ValueError, KeyError, TypeError):
        text = response.text.strip()[:200] or response.reason_phrase
        return ApiError(f"HTTP{response.status_code}", text, response.status_code)


def _seg(value: str) -> str:
    """One path segment: a name can never reach another route."""
    return quote(value, safe="")


class RestClient:
    """One control plane (`url`) and one credential: a tenant key or the admin token."""

    def __init__(self, url: str, token: str, *, transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=TIMEOUT,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send one request; ApiError unless the answer is 2xx."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(
                "ConnectionFailed", f"cannot reach the control plane at {self.url}: {exc}"
            ) from exc
        if response.is_success:
            return response
        raise _error_of(response)

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON of a 2xx answer."""
        return self._body(self.call(method, path, **kwargs))

    @staticmethod
    def _body(response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            request = response.request
            raise ApiError(
                "BadAnswer",
                f"{request.method} {request.url.path} answered {response.status_code} without JSON",
            ) from None

    # -- tenant ---------------------------------------------------------------------------------

    def list_adapters(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.json("GET", "/v1/adapters")
        return result

    def list_base_models(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.json("GET", "/v1/base-models")
        return result

    def list_versions(self, name: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.json("GET", f"/v1/adapters/{_seg(name)}/versions")
        return result

    def get_adapter(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self.json("GET", f"/v1/adapters/{_seg(name)}")
        return result

    def serve_version(self, name: str, version: int | None) -> dict[str, Any]:
        """Serve `version` and hold it; None: serve the latest and follow later pushes."""
        body = {"current_version": version}
        result: dict[str, Any] = self.json("PATCH", f"/v1/adapters/{_seg(name)}", json=body)
        return result

    def set_rollout(self, name: str, weights: dict[int, int]) -> dict[str, Any]:
        """Split the plain name's requests across versions by weight (summing to 100)."""
        body = {"rollout": {str(v): w for v, w in weights.items()}}
        result: dict[str, Any] = self.json("PATCH", f"/v1/adapters/{_seg(name)}", json=body)
        return result

    def end_rollout(self, name: str, action: str, version: int | None = None) -> dict[str, Any]:
        """`promote` (`version`, or the split's one besides the current) or `rollback`."""
        body = {"version": version} if version is not None else None
        path = f"/v1/adapters/{_seg(name)}/rollout/{action}"
        result: dict[str, Any] = self.json("POST", path, json=body)
        return result

    def pin_version(
        self, name: str, version: int, pool: str, namespace: str, replicas: int
    ) -> dict[str, Any]:
        """Keep `version` resident on `replicas` replicas of the pool."""
        body = {"pool": pool, "namespace": namespace, "replicas": replicas}
        path = f"/v1/adapters/{_seg(name)}/versions/{version}/pin"
        result: dict[str, Any] = self.json("PUT", path, json=body)
        return result

    def unpin_version(self, name: str, version: int, pool: str, namespace: str) -> None:
        path = f"/v1/adapters/{_seg(name)}/versions/{version}/pin"
        self.call("DELETE", path, params={"pool": pool, "namespace": namespace})

    def list_pins(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.json("GET", "/v1/pins")
        return result

    def delete_adapter(self, name: str) -> None:
        self.call("DELETE", f"/v1/adapters/{_seg(name)}")

    def upload(
        self,
        name: str,
        base_model: str,
        files: list[Path],
        on_bytes: Callable[[int], None] | None = None,
        fields: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """POST /v1/adapters with the files as multipart parts (and extra form `fields`: the
        signature): the status (200 identical, 201 new, 202 background job or staged) and
        the answer."""
        text = {"name": name, "base_model": base_model, **(fields or {})}
        body = MultipartBody(text, FILE_FIELD, files, on_bytes)
        headers = {"Content-Type": body.content_type, "Content-Length": str(len(body))}
        response = self.call("POST", "/v1/adapters", content=iter(body), headers=headers)
        return response.status_code, self._body(response)

    def wait_job(
        self,
        job_id: str,
        *,
        timeout_s: float,
        on_status: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll a background upload until it ends: the UploadResult it stored or matched, or
        ApiError with the code the synchronous upload would have answered."""
        location = f"/v1/uploads/{_seg(job_id)}"
        deadline = time.monotonic() + timeout_s
        pause = POLL_START_S
        while True:
            try:
                job: dict[str, Any] = self.json("GET", location)
            except ApiError as exc:
                if exc.status not in (429, 503) or time.monotonic() > deadline:
                    raise
                job = {}  # rate limited or briefly unavailable: keep waiting
            if job.get("status") == "succeeded" and isinstance(job.get("result"), dict):
                result: dict[str, Any] = job["result"]
                return result
            if job.get("status") == "failed":
                error = job.get("error") or {}
                code = str(error.get("code", "Error"))
                raise ApiError(code, str(error.get("message", "")), refused=code not in RETRYABLE)
            if on_status is not None and job:
                on_status(job)
            if time.monotonic() > deadline:
                raise ApiError(
                    "Timeout",
                    f"the upload job {location} has not finished after {timeout_s:g} s; "
                    "it goes on in the background (GET it later)",
                )
            time.sleep(pause)
            pause = min(pause * 1.5, POLL_MAX_S)

    # -- admin ----------------------------------------------------------------------------------

    def create_tenant(self, name: str, quotas: dict[str, Any] | None = None) -> dict[str, Any]:
        """A new tenant; quotas not given take the control plane's defaults."""
        body = {"name": name, **(quotas or {})}
        result: dict[str, Any] = self.json("POST", "/v1/tenants", json=body)
        return result

    def update_tenant(self, name: str, quotas: dict[str, Any]) -> dict[str, Any]:
        """Change the quotas given; the others keep their value."""
        result: dict[str, Any] = self.json("PATCH", f"/v1/tenants/{_seg(name)}", json=quotas)
        return result

    def get_tenant(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self.json("GET", f"/v1/tenants/{_seg(name)}")
        return result

    def delete_tenant(self, name: str) -> None:
        self.call("DELETE", f"/v1/tenants/{_seg(name)}")

    def list_tenants(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.json("GET", "/v1/tenants")
        return result

    def create_key(self, tenant: str, label: str) -> dict[str, Any]:
        path = f"/v1/tenants/{_seg(tenant)}/keys"
        result: dict[str, Any] = self.json("POST", path, json={"name": label})
        return result

    def list_keys(self, tenant: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.json("GET", f"/v1/tenants/{_seg(tenant)}/keys")
        return result

    def revoke_key(self, tenant: str, key_id: int) -> None:
        self.call("DELETE", f"/v1/tenants/{_seg(tenant)}/keys/{key_id}")

    def list_pools(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.json("GET", "/v1/pools")
        return result

    def get_pool(self, name: str, namespace: str) -> dict[str, Any]:
        params = {"namespace": namespace}
        result: dict[str, Any] = self.json("GET", f"/v1/pools/{_seg(name)}", params=params)
        return result

    def create_pool(self, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.json("POST", "/v1/pools", json=body)
        return result

    def update_pool(self, name: str, namespace: str, limits: dict[str, Any]) -> dict[str, Any]:
        """Change the limits given; the others keep their value."""
        path, params = f"/v1/pools/{_seg(name)}", {"namespace": namespace}
        result: dict[str, Any] = self.json("PATCH", path, params=params, json=limits)
        return result

    def delete_pool(self, name: str, namespace: str) -> None:
        self.call("DELETE", f"/v1/pools/{_seg(name)}", params={"namespace": namespace})
