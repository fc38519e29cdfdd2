"""Imports from allowlisted S3 buckets (moto over HTTP), and the app behind a real uvicorn
server on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from loraplane.controlplane.main import create_app
from tests import s3server
from tests.controlplane.conftest import ADMIN_H, SERVICE_H, Api, bearer, make_settings
from tests.servers import serve_in_thread


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with s3server.moto_s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def import_api(
    s3_endpoint: str, tmp_path: Path, database_url: str, base_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Api]:  # fmt: skip
    for var, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        monkeypatch.setenv(var, value)
    settings = make_settings(
        tmp_path, database_url, import_buckets=["allowed"], s3_endpoint_url=s3_endpoint
    )
    app = create_app(settings)
    with TestClient(app) as client:
        api = Api(client, base_model_dir, tmp_path)
        api.pool()
        api.tenant("acme")
        yield api
    app.state.ctx.close()


def test_import_from_allowlisted_bucket_folder(import_api: Api, s3_endpoint: str) -> None:
    s3 = s3server.s3_client(s3_endpoint)
    for bucket in ("allowed", "other"):
        s3.create_bucket(Bucket=bucket)
        for p in import_api.adapter_dir(seed=4).iterdir():
            s3.put_object(Bucket=bucket, Key=f"team/bot/{p.name}", Body=p.read_bytes())
    key = import_api.keys["acme"]
    body = {"name": "bot", "base_model": "tiny", "source_uri": "s3://allowed/team/bot"}
    r = import_api.client.post("/v1/adapters", json=body, headers=bearer(key))
    assert r.status_code == 201, r.text
    assert r.json()["version"]["version"] == 1
    for uri, code in (
        ("s3://other/team/bot", "SourceNotAllowed"),
        ("https://example.com/a.tar.gz", "SourceNotAllowed"),
        ("file:///etc/passwd", "SourceNotAllowed"),
        ("s3://allowed/nothing-here", "SourceNotFound"),
    ):
        r = import_api.client.post(
            "/v1/adapters", json={**body, "source_uri": uri}, headers=bearer(key)
        )
        assert r.status_code == 422, (uri, r.text)
        assert r.json()["error"]["code"] == code
    r = import_api.client.post("/v1/adapters", json={**body, "path": "/x"}, headers=bearer(key))
    assert r.status_code == 400


def test_import_in_the_background(import_api: Api, s3_endpoint: str) -> None:
    s3 = s3server.s3_client(s3_endpoint)
    s3.create_bucket(Bucket="allowed")
    for p in import_api.adapter_dir(seed=5).iterdir():
        s3.put_object(Bucket="allowed", Key=f"team/bot/{p.name}", Body=p.read_bytes())
    key = import_api.keys["acme"]
    prefer = {**bearer(key), "Prefer": "respond-async"}
    body = {"name": "bot", "base_model": "tiny", "source_uri": "s3://allowed/team/bot"}
    r = import_api.client.post("/v1/adapters", json=body, headers=prefer)
    assert r.status_code == 202, r.text
    job = import_api.wait_upload(key, r.headers["Location"])
    assert job["status"] == "succeeded" and job["result"]["version"]["version"] == 1, job
    # A URI outside the allowlist is refused at once; a missing object fails its job.
    refused = {**body, "source_uri": "s3://other/team/bot"}
    r = import_api.client.post("/v1/adapters", json=refused, headers=prefer)
    assert r.status_code == 422 and r.json()["error"]["code"] == "SourceNotAllowed"
    missing = {**body, "source_uri": "s3://allowed/nothing-here"}
    r = import_api.client.post("/v1/adapters", json=missing, headers=prefer)
    job = import_api.wait_upload(key, r.headers["Location"])
    assert job["status"] == "failed" and job["error"]["code"] == "SourceNotFound", job


@pytest.fixture
def live_server(tmp_path: Path, database_url: str) -> Iterator[str]:
    app = create_app(make_settings(tmp_path, database_url))
    with serve_in_thread(app) as url:
        yield url
    app.state.ctx.close()


def test_real_http_server_end_to_end(
    live_server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    with httpx.Client(base_url=live_server, timeout=30) as http:
        assert http.get("/healthz").status_code == 200
        body = {"name": "pool-a", "base_model": {"name": "tiny", "uri": str(base_model_dir)}}
        assert http.post("/v1/pools", json=body, headers=ADMIN_H).status_code == 201
        assert http.post("/v1/tenants", json={"name": "acme"}, headers=ADMIN_H).status_code == 201
        key = http.post("/v1/tenants/acme/keys", json={}, headers=ADMIN_H).json()["key"]
        api = Api(http, base_model_dir, tmp_path)  # type: ignore[arg-type]
        r = api.upload(key, "bot", api.adapter_dir(seed=9))
        assert r.status_code == 201, r.text
        r = http.get(
            "/internal/v1/resolve", params={"model": "bot@1"},
            headers={**SERVICE_H, "X-Tenant-Key": key},
        )  # fmt: skip
        assert r.status_code == 200 and r.json()["version"] == 1
        assert "loraplane_controlplane_requests_total" in http.get("/metrics").text
