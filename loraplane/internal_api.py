"""The one client of the control plane's internal API (`/internal/v1/...`), shared by the
operator (`InternalAPIClient`: synchronous, its calls run in threads) and the data plane
(`AsyncInternalAPIClient`).

A call joins the control plane's base URL and a path, sends the service token as bearer (or a
tenant's own key, for the public routes the data plane asks under it), the tenant's key in
`X-Tenant-Key` when given (resolve), and has a timeout. A 2xx answer is returned; any other
answer, and any transport error, becomes an `InternalAPIError` by one rule:

- `code`: the control plane's error code from its body `{"error": {"code", "message"}}`,
  `HTTP<status>` when the body has none; `ControlPlaneUnavailable` when the control plane could
  not be reached or failed inside (its `InternalError`);
- `status`: the HTTP status; None for a transport error;
- `transient`: a later retry of the same call may succeed with nobody changing it. The control
  plane was unreachable, failed (5xx) or was busy (429), or said something that changes by
  itself: 401 (a service token being rotated), 404 (a tenant or pool not registered yet), 409
  (a concurrent change). Any other answer (400, 403, 422, ...) means the call itself is wrong;
- `retry_after`: seconds from the answer's Retry-After header, when it has one.

`unavailable` (no answer, or a 5xx) is what the data plane serves stale resolutions through.
Each caller turns these errors into its own in one place: the operator's handlers wait on
`transient` and fail otherwise; the data plane maps `status` to OpenAI errors. No torch, no
web framework: every service imports it.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from loraplane.redact import redact

TENANT_KEY_HEADER = "X-Tenant-Key"
UNAVAILABLE = "ControlPlaneUnavailable"  # our code: no answer, or the control plane failed
INVALID_RESPONSE = "InvalidResponse"  # our code: a 2xx answer whose body is not JSON
# 4xx answers that may change by themselves (see the module's docstring)
TRANSIENT_STATUSES = frozenset({401, 404, 409, 429})
DEFAULT_TIMEOUT_S = 10.0  # the operator's; the data plane's callers pass a shorter one


class InternalAPIError(Exception):
    """A call to the internal API failed; `code` is the control plane's error code (or ours:
    `ControlPlaneUnavailable`, `InvalidResponse`), `status` None when there was no answer."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None,
        transient: bool,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.transient = transient
        self.retry_after = retry_after

    @property
    def unavailable(self) -> bool:
        """The control plane did not answer (transport error) or failed (5xx)."""
        return self.status is None or self.status >= 500


def error_of(response: httpx.Response) -> InternalAPIError:
    """The error a non-2xx answer is (the rule in the module's docstring)."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    code = str(err.get("code") or f"HTTP{status}")
    message = str(err.get("message") or response.text[:200] or f"HTTP {status}")
    if status >= 500 and code == "InternalError":
        code = UNAVAILABLE
    transient = status >= 500 or status in TRANSIENT_STATUSES
    return InternalAPIError(
        code, message, status=status, transient=transient, retry_after=retry_after_of(response)
    )


def unreachable(exc: httpx.HTTPError) -> InternalAPIError:
    """The error a transport failure (no connection, a timeout, a broken answer) is."""
    # an illegal header's text repeats the token: masked (loraplane.redact)
    detail = redact(f"{type(exc).__name__}: {exc}") if str(exc) else type(exc).__name__
    return InternalAPIError(
        UNAVAILABLE, f"cannot reach the control plane: {detail}", status=None, transient=True
    )


def json_of(response: httpx.Response) -> Any:
    """The JSON body of an accepted answer; InternalAPIError `InvalidResponse` (transient: the
    call was right, something between us mangled the answer) when it is not JSON."""
    try:
        return response.json()
    except ValueError as exc:
        raise InternalAPIError(
            INVALID_RESPONSE,
            f"the control plane answered HTTP {response.status_code} with a body that is not JSON",
            status=response.status_code,
            transient=True,
        ) from exc


def retry_after_of(response: httpx.Response) -> float | None:
    """Seconds from a Retry-After header (seconds or an HTTP date); None if absent or odd."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


class _Calls:
    """What the sync and async clients share: the base URL and the headers of a call."""

    def __init__(self, base_url: str, service_token: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self._service_token = service_token

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _headers(self, tenant_key: str | None, token: str | None) -> dict[str, str]:
        headers = {}
        bearer = token if token is not None else self._service_token
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        if tenant_key is not None:
            headers[TENANT_KEY_HEADER] = tenant_key
        return headers


def _accepted(response: httpx.Response, allow: tuple[int, ...]) -> httpx.Response:
    if response.is_success or response.status_code in allow:
        return response
    raise error_of(response)


class InternalAPIClient(_Calls):
    """The synchronous client (run it off the event loop); thread-safe: one httpx client."""

    def __init__(
        self,
        base_url: str,
        service_token: str | None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, service_token)
        self._http = httpx.Client(timeout=timeout, transport=transport)

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        tenant_key: str | None = None,
        token: str | None = None,
        allow: tuple[int, ...] = (),
    ) -> httpx.Response:
        """The answer when it is 2xx or in `allow`; InternalAPIError otherwise. `token` is
        sent as bearer instead of the service token."""
        try:
            response = self._http.request(
                method, self._url(path), json=json, params=params,
                headers=self._headers(tenant_key, token),
            )  # fmt: skip
        except httpx.HTTPError as exc:
            raise unreachable(exc) from exc
        return _accepted(response, allow)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()


class AsyncInternalAPIClient(_Calls):
    """The asynchronous client; `client` (tests: an ASGI or mock transport) is used as given
    and closed with this one."""

    def __init__(
        self,
        base_url: str,
        service_token: str | None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url, service_token)
        self._http = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout))

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        tenant_key: str | None = None,
        token: str | None = None,
        allow: tuple[int, ...] = (),
    ) -> httpx.Response:
        """The answer when it is 2xx or in `allow`; InternalAPIError otherwise. `token` is
        sent as bearer instead of the service token."""
        # a GET whose kept-alive connection the server closed as it was reused (the two sides'
        # idle timeouts race) goes once more, on a new connection: reading repeats nothing
        attempts = 2 if method == "GET" else 1
        for attempt in range(attempts):
            try:
                response = await self._http.request(
                    method, self._url(path), json=json, params=params,
                    headers=self._headers(tenant_key, token),
                )  # fmt: skip
                break
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                if attempt + 1 == attempts:
                    raise unreachable(exc) from exc
            except httpx.HTTPError as exc:
                raise unreachable(exc) from exc
        return _accepted(response, allow)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()
