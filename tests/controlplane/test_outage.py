"""PostgreSQL stopped mid-test: 503 with Retry-After (never a 500), authorization fails
closed, and the service recovers by itself when the database returns, nothing lost."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from loraplane.controlplane import db
from loraplane.controlplane.main import create_app
from tests.controlplane import pg
from tests.controlplane.conftest import ADMIN_H, SERVICE_H, Api, bearer, make_settings

pytestmark = pytest.mark.postgres


@pytest.fixture
def cluster() -> Iterator[pg.PgCluster]:
    """A cluster of this test's own, so stopping it disturbs no other test."""
    bindir = pg.find_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin)")
    c = pg.PgCluster(bindir)
    c.start()
    yield c
    c.destroy()


def test_database_outage_is_503_then_recovers(
    cluster: pg.PgCluster, tmp_path: Path, base_model_dir: Path
) -> None:
    url = cluster.create_database("catalog")
    engine = db.make_engine(url)
    db.upgrade(engine)
    engine.dispose()
    app = create_app(make_settings(tmp_path, url, retry_after_seconds=7))
    with TestClient(app) as client:
        api = Api(client, base_model_dir, tmp_path)
        api.pool()
        key = api.tenant("acme")
        assert api.upload(key, "bot", api.adapter_dir(seed=1)).status_code == 201

        cluster.stop()
        for method, path, headers in (
            ("get", "/v1/adapters", bearer(key)),  # the key cannot be checked: refused
            ("get", "/v1/tenants", ADMIN_H),
            ("post", "/v1/tenants/acme/keys", ADMIN_H),
            ("get", "/internal/v1/resolve?model=bot", {**SERVICE_H, "X-Tenant-Key": key}),
            ("get", "/readyz", {}),
        ):
            r = client.request(method, path, headers=headers, json={})
            assert r.status_code == 503, (path, r.text)
            assert r.headers["Retry-After"] == "7"
            assert r.json()["error"]["code"] == "DatabaseUnavailable"
            assert "Traceback" not in r.text
        r = api.upload(key, "bot", api.adapter_dir(seed=2))
        assert r.status_code == 503
        assert client.get("/healthz").status_code == 200  # alive, just not ready

        cluster.start()
        assert client.get("/readyz").status_code == 200
        r = client.get("/v1/adapters/bot", headers=bearer(key))
        assert r.status_code == 200 and r.json()["current_version"] == 1
        r = api.upload(key, "bot", api.adapter_dir(seed=2))
        assert r.status_code == 201 and r.json()["version"]["version"] == 2

        # The resolve path has no pre-ping: a pooled connection the restart dropped is
        # retried once on a new one, so the first resolution after a restart succeeds.
        resolve = {**SERVICE_H, "X-Tenant-Key": key}
        assert client.get("/internal/v1/resolve?model=bot", headers=resolve).status_code == 200
        cluster.stop()
        cluster.start()
        r = client.get("/internal/v1/resolve?model=bot", headers=resolve)
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
    app.state.ctx.close()
