"""The one client of the control plane's internal API (loraplane.internal_api): the rule that
turns an answer or a transport failure into an InternalAPIError, the same for the sync client
(the operator's) and the async one (the data plane's). And one field the data plane's catalog
reads from the resolve answer, the tenant's weight, from a real control plane."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse

from loraplane.controlplane.main import create_app
from loraplane.dataplane.server.catalog import StaticCatalog
from loraplane.dataplane.server.catalog_http import HttpCatalog
from loraplane.internal_api import (
    INVALID_RESPONSE,
    TENANT_KEY_HEADER,
    UNAVAILABLE,
    AsyncInternalAPIClient,
    InternalAPIClient,
    InternalAPIError,
    json_of,
)
from tests.controlplane.conftest import ADMIN_H, BASE_NAME, SERVICE, make_settings

Handler = Callable[[httpx.Request], httpx.Response]
KINDS = ("sync", "async")


def call(kind: str, handler: Handler, method: str = "GET", path: str = "/internal/v1/x",
         *, base_url: str = "http://cp", token: str | None = "svc",
         **kwargs: Any) -> httpx.Response:  # fmt: skip
    """One request through the `kind` client over a mock transport."""
    if kind == "sync":
        sync = InternalAPIClient(base_url, token, transport=httpx.MockTransport(handler))
        try:
            return sync.request(method, path, **kwargs)
        finally:
            sync.close()

    async def run() -> httpx.Response:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        client = AsyncInternalAPIClient(base_url, token, client=http)
        try:
            return await client.request(method, path, **kwargs)
        finally:
            await client.aclose()

    return asyncio.run(run())


def error(kind: str, handler: Handler, **kwargs: Any) -> InternalAPIError:
    with pytest.raises(InternalAPIError) as info:
        call(kind, handler, **kwargs)
    return info.value


def answer(status: int, body: Any = None, **kwargs: Any) -> Handler:
    return lambda request: httpx.Response(status, json=body, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("status", "transient", "unavailable"),
    [
        (400, False, False),
        (401, True, False),  # a service token being rotated
        (403, False, False),
        (404, True, False),  # a tenant or pool not registered yet
        (409, True, False),  # a concurrent change
        (422, False, False),
        (429, True, False),
        (500, True, True),
        (502, True, True),
        (503, True, True),
    ],
)
def test_each_status_class_is_an_error_with_the_control_planes_code(
    kind: str, status: int, transient: bool, unavailable: bool
) -> None:
    body = {"error": {"code": "SomeCode", "message": "what went wrong"}}
    err = error(kind, answer(status, body))
    assert (err.code, err.message, err.status) == ("SomeCode", "what went wrong", status)
    assert (err.transient, err.unavailable) == (transient, unavailable)
    assert err.retry_after is None
    assert str(err) == "SomeCode: what went wrong"


@pytest.mark.parametrize("kind", KINDS)
def test_an_answer_without_an_error_body_is_named_by_its_status(kind: str) -> None:
    text = error(kind, lambda r: httpx.Response(502, text="<html>bad gateway</html>"))
    assert (text.code, text.message, text.status, text.transient) == (
        "HTTP502", "<html>bad gateway</html>", 502, True,
    )  # fmt: skip
    detail = error(kind, answer(422, {"detail": "nope"}))  # JSON, but not the error shape
    assert (detail.code, detail.status, detail.transient) == ("HTTP422", 422, False)
    assert "nope" in detail.message
    for odd in ([1, 2], {"error": "a string"}):
        assert error(kind, answer(400, odd)).code == "HTTP400"
    empty = error(kind, lambda r: httpx.Response(404))
    assert (empty.code, empty.message) == ("HTTP404", "HTTP 404")


@pytest.mark.parametrize("kind", KINDS)
def test_the_control_planes_internal_error_is_control_plane_unavailable(kind: str) -> None:
    err = error(kind, answer(500, {"error": {"code": "InternalError", "message": "boom"}}))
    assert (err.code, err.status, err.transient) == (UNAVAILABLE, 500, True)
    # a 4xx keeps its code, whatever it is
    assert error(kind, answer(400, {"error": {"code": "InternalError"}})).code == "InternalError"


@pytest.mark.parametrize("kind", KINDS)
def test_a_transport_error_is_control_plane_unavailable_without_a_status(kind: str) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def time_out(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("", request=request)

    refused = error(kind, refuse)
    assert (refused.code, refused.status, refused.transient) == (UNAVAILABLE, None, True)
    assert refused.unavailable and refused.retry_after is None
    assert "ConnectError: connection refused" in refused.message
    assert isinstance(refused.__cause__, httpx.ConnectError)
    timeout = error(kind, time_out)
    assert timeout.message.endswith("ReadTimeout") and timeout.status is None


@pytest.mark.parametrize("kind", KINDS)
def test_retry_after_is_read_in_seconds_or_as_a_date(kind: str) -> None:
    busy = {"error": {"code": "RateLimited", "message": "slow down"}}
    assert error(kind, answer(429, busy, headers={"Retry-After": "7"})).retry_after == 7.0
    assert error(kind, answer(503, busy, headers={"Retry-After": "1.5"})).retry_after == 1.5
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    dated = error(kind, answer(503, busy, headers={"Retry-After": later})).retry_after
    assert dated is not None and 100 < dated <= 120
    past = format_datetime(datetime.now(UTC) - timedelta(seconds=60), usegmt=True)
    assert error(kind, answer(503, busy, headers={"Retry-After": past})).retry_after == 0.0
    for odd in ("soon", "nan", "inf"):
        assert error(kind, answer(503, busy, headers={"Retry-After": odd})).retry_after is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_joins_the_base_url_and_sends_the_service_token(kind: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json={"ok": True})

    got = call(kind, handler, "PUT", "/internal/v1/pools/p", base_url="http://cp:8080/api/",
               json={"a": 1}, params={"namespace": "team-b"})  # fmt: skip
    assert got.status_code == 201 and json_of(got) == {"ok": True}
    call(kind, handler, tenant_key="lp_tenant")
    call(kind, handler, token="lp_tenant")  # the public API under a tenant's own key
    call(kind, handler, token=None)
    call(kind, handler, base_url="http://cp", token=None)  # no service token configured
    put, resolve, public, _, anonymous = seen
    assert str(put.url) == "http://cp:8080/api/internal/v1/pools/p?namespace=team-b"
    assert put.method == "PUT" and put.content == b'{"a":1}'
    assert put.headers["Authorization"] == "Bearer svc" and TENANT_KEY_HEADER not in put.headers
    assert resolve.headers["Authorization"] == "Bearer svc"
    assert resolve.headers[TENANT_KEY_HEADER] == "lp_tenant"
    assert public.headers["Authorization"] == "Bearer lp_tenant"
    assert "Authorization" not in anonymous.headers


@pytest.mark.parametrize("kind", KINDS)
def test_allowed_statuses_come_back_as_answers(kind: str) -> None:
    gone = answer(404, {"error": {"code": "NotFound", "message": "no pool"}})
    assert call(kind, gone, allow=(404,)).status_code == 404
    assert error(kind, gone, allow=(409,)).code == "NotFound"


def test_an_accepted_answer_that_is_not_json_is_an_invalid_response() -> None:
    with pytest.raises(InternalAPIError) as info:
        json_of(httpx.Response(200, text="<html>a proxy</html>"))
    assert (info.value.code, info.value.status, info.value.transient) == (
        INVALID_RESPONSE, 200, True,
    )  # fmt: skip


def test_the_async_client_against_a_control_plane_stand_in() -> None:
    """The rule on real answers of a FastAPI app (as the control plane's error handlers
    write them), over ASGI."""
    app = FastAPI()

    @app.get("/internal/v1/resolve")
    def resolve(model: str, authorization: str = Header(""), x_tenant_key: str = Header("")) -> Any:
        if authorization != "Bearer svc":
            return JSONResponse({"error": {"code": "Unauthorized", "message": "bad token"}}, 401)
        if x_tenant_key != "lp_good":
            return JSONResponse({"error": {"code": "InvalidKey", "message": "who?"}}, 401)
        if model == "busy":
            return JSONResponse({"error": {"code": "RateLimited", "message": "later"}}, 429,
                                headers={"Retry-After": "3"})  # fmt: skip
        if model == "broken":
            raise HTTPException(500)
        return {"tenant": "acme", "model": model}

    async def run() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = AsyncInternalAPIClient("http://cp", "svc", client=http)
        path = "/internal/v1/resolve"

        async def fails(**kwargs: Any) -> InternalAPIError:
            with pytest.raises(InternalAPIError) as info:
                await client.request("GET", path, **kwargs)
            return info.value

        ok = await client.request("GET", path, params={"model": "bot"}, tenant_key="lp_good")
        assert json_of(ok) == {"tenant": "acme", "model": "bot"}
        bad = await fails(params={"model": "bot"}, tenant_key="lp_bad")
        assert (bad.code, bad.status, bad.message) == ("InvalidKey", 401, "who?")
        busy = await fails(params={"model": "busy"}, tenant_key="lp_good")
        assert (busy.code, busy.retry_after, busy.transient) == ("RateLimited", 3.0, True)
        broken = await fails(params={"model": "broken"}, tenant_key="lp_good")
        assert broken.unavailable and broken.code == "HTTP500"
        unvalidated = await fails(tenant_key="lp_good")  # no model: FastAPI's own 422
        assert (unvalidated.status, unvalidated.transient) == (422, False)
        await client.aclose()

    asyncio.run(run())


# -- the tenant's weight, from the control plane to the data plane's catalog ------------------


def test_the_data_planes_catalog_reads_each_tenants_weight_from_the_control_plane(
    tmp_path: Path, base_model_dir: Path
) -> None:
    """A real control plane (over ASGI) and the data plane's HttpCatalog: the weight the admin
    sets is the one a resolution carries, per tenant, and a change shows after the TTL."""
    app = create_app(make_settings(tmp_path, f"sqlite:///{tmp_path / 'c.db'}"))
    clock = {"now": 0.0}

    async def run() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp")
        pool = {"name": "pool-a", "base_model": {"name": BASE_NAME, "uri": str(base_model_dir)}}
        assert (await http.post("/v1/pools", json=pool, headers=ADMIN_H)).status_code == 201
        keys = {}
        for name, extra in (("acme", {"weight": 2.5}), ("plain", {})):
            made = await http.post("/v1/tenants", json={"name": name, **extra}, headers=ADMIN_H)
            assert made.status_code == 201, made.text
            key = await http.post(f"/v1/tenants/{name}/keys", json={}, headers=ADMIN_H)
            keys[name] = key.json()["key"]
        catalog = HttpCatalog(
            "http://cp", SERVICE, BASE_NAME, ttl=5.0, client=http, clock=lambda: clock["now"]
        )
        assert (await catalog.resolve(keys["acme"], BASE_NAME)).weight == 2.5
        assert (await catalog.resolve(keys["plain"], BASE_NAME)).weight == 1.0
        patched = await http.patch("/v1/tenants/acme", json={"weight": 0.5}, headers=ADMIN_H)
        assert patched.status_code == 200
        assert (await catalog.resolve(keys["acme"], BASE_NAME)).weight == 2.5  # cached
        clock["now"] = 5.1
        assert (await catalog.resolve(keys["acme"], BASE_NAME)).weight == 0.5
        await catalog.aclose()

    try:
        asyncio.run(run())
    finally:
        app.state.ctx.close()


@pytest.mark.parametrize(
    ("weight", "expected", "warned"),
    [
        (..., 1.0, False),  # a control plane from before weights: no field at all
        (None, 1.0, False),
        (3, 3.0, False),
        (0.25, 0.25, False),
        (0, 1.0, True),
        (-2.0, 1.0, True),
        ("heavy", 1.0, True),
        (True, 1.0, True),
        ([2], 1.0, True),
        (10**400, 1.0, True),  # past any float
    ],
)
def test_a_missing_or_bad_weight_in_a_resolve_answer_is_1_never_an_error(
    weight: Any, expected: float, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    body: dict[str, Any] = {"tenant": "acme", "adapter": None, "requests_per_minute": 60}
    if weight is not ...:
        body["weight"] = weight
    http = httpx.AsyncClient(transport=httpx.MockTransport(answer(200, body)))
    catalog = HttpCatalog("http://cp", "svc", "base", client=http)
    catalog_log = "loraplane.dataplane.server.catalog"
    caplog.set_level(logging.WARNING, logger=catalog_log)
    found = asyncio.run(catalog.resolve("lp_good", "base"))
    assert (found.tenant, found.requests_per_minute, found.weight) == ("acme", 60, expected)
    assert type(found.weight) is float
    # the catalog's own: another test's background thread may log into caplog meanwhile
    warnings = [r.getMessage() for r in caplog.records if r.name == catalog_log]
    assert bool(warnings) == warned, warnings
    if warned:
        assert "for tenant acme, not a positive number: using 1" in warnings[0]


def test_standalone_mode_gives_its_one_tenant_weight_1() -> None:
    catalog = StaticCatalog("base")
    catalog.add("bot", "ab" * 32)
    for model in ("base", "bot"):
        assert asyncio.run(catalog.resolve(None, model)).weight == 1.0


def test_a_get_whose_kept_alive_connection_was_dropped_goes_once_more_and_a_post_does_not() -> None:
    """The server closing a kept-alive connection as the client reuses it (a ReadError) fails
    no GET: it goes once more. A second drop, or any drop of a POST, is the outage error."""
    calls: list[str] = []
    drops = {"GET": 1, "POST": 1}

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if drops[request.method] > 0:
            drops[request.method] -= 1
            raise httpx.ReadError("connection closed", request=request)
        return httpx.Response(200, json={"ok": True})

    async def run() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        client = AsyncInternalAPIClient("http://cp", "svc", client=http)
        assert json_of(await client.request("GET", "/internal/v1/resolve")) == {"ok": True}
        with pytest.raises(InternalAPIError) as info:
            await client.request("POST", "/internal/v1/usage", json={})
        assert info.value.status is None and "ReadError" in info.value.message
        drops["GET"] = 2
        with pytest.raises(InternalAPIError):
            await client.request("GET", "/internal/v1/resolve")
        await client.aclose()

    asyncio.run(run())
    assert calls == ["GET", "GET", "POST", "GET", "GET"]
