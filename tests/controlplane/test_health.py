"""Health, readiness, metrics, rate limits and error shapes."""

from __future__ import annotations

from tests.controlplane.conftest import ADMIN_H, Api, bearer


def test_healthz_readyz(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").json() == {"status": "ready"}


def test_metrics_count_requests_by_route_template_and_status(ready: Api) -> None:
    ready.client.get("/v1/adapters/some-name", headers=bearer(ready.keys["acme"]))
    text = ready.client.get("/metrics").text
    assert (
        'loraplane_controlplane_requests_total{method="GET",route="/v1/adapters/{name}",status="404"}'
        in text
    )
    assert "loraplane_controlplane_request_duration_seconds_bucket" in text
    assert "some-name" not in text


def test_rate_limit_answers_429_with_retry_after(api: Api) -> None:
    key = api.tenant("acme", requests_per_minute=3)
    codes = [api.client.get("/v1/adapters", headers=bearer(key)).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = api.client.get("/v1/adapters", headers=bearer(key))
    assert r.status_code == 429 and r.json()["error"]["code"] == "RateLimited"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    # other tenants and the admin are not affected
    other = api.tenant("globex")
    assert api.client.get("/v1/adapters", headers=bearer(other)).status_code == 200
    assert api.client.get("/v1/tenants", headers=ADMIN_H).status_code == 200


def test_unknown_route_and_method_have_the_error_shape(api: Api) -> None:
    r = api.client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "NotFound"
    r = api.client.put("/v1/tenants", headers=ADMIN_H)
    assert r.status_code == 405 and "error" in r.json()


def test_malformed_json_is_400(api: Api) -> None:
    r = api.client.post(
        "/v1/tenants", content=b"{not json", headers={**ADMIN_H, "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "InvalidRequest"
