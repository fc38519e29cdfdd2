"""Fixtures for the control plane: the app on SQLite and on a real PostgreSQL, a tiny base
model, tenants with keys, and adapters crafted by the adapter core's test helpers.

PostgreSQL: LORAPLANE_TEST_DATABASE_URL if set (a server where databases may be created),
else a throwaway cluster started for the session from /usr/lib/postgresql/*/bin, else the
postgres-marked tests are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import create_engine, text

from loraplane.controlplane import db
from loraplane.controlplane.main import create_app
from loraplane.controlplane.models import Base
from loraplane.controlplane.settings import Settings
from loraplane.readiness import NotReady, wait_ok
from tests.adapters.crafting import (
    TINY_BASE,
    TINY_BASE_CONFIG,
    TINY_BASE_NAME,
    lora_config,
    lora_tensors,
    write_adapter,
)
from tests.controlplane import pg

REPO = Path(__file__).resolve().parents[2]
ADMIN = "admin-" + "a1b2c3d4e5f6g7h8i9j0" * 2
SERVICE = "service-" + "k1l2m3n4o5p6q7r8s9t0" * 2
BASE_NAME, BASE_CONFIG, BASE = TINY_BASE_NAME, TINY_BASE_CONFIG, TINY_BASE
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


# -- PostgreSQL ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """A URL on a PostgreSQL server where the tests may create databases."""
    given = os.environ.get("LORAPLANE_TEST_DATABASE_URL")
    if given:
        yield Settings(database_url=given).effective_database_url
        return
    bindir = pg.find_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL: set LORAPLANE_TEST_DATABASE_URL or install postgresql")
    cluster = pg.PgCluster(bindir)
    try:
        cluster.start()
        yield cluster.url()
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def pg_test_url(pg_admin_url: str) -> str:
    """One migrated database for the session; tests truncate it before use."""
    url = pg.create_database(pg_admin_url, f"cp_{uuid.uuid4().hex[:8]}")
    engine = db.make_engine(url)
    db.upgrade(engine)
    engine.dispose()
    return url


def truncate_all(url: str) -> None:
    """Empty every table (and restart ids) in a PostgreSQL catalog."""
    engine = create_engine(url)
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty catalog: a SQLite file, or the session's PostgreSQL database."""
    if request.param == "sqlite":
        path = tmp_path / "catalog.db"
        shutil.copy(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("pg_test_url")
    truncate_all(url)
    return url


# -- the app ------------------------------------------------------------------------------------


def make_settings(tmp: Path, database_url: str, **overrides: Any) -> Settings:
    """Settings for a test app: strong tokens, a local store in `tmp`."""
    values: dict[str, Any] = {
        "data_dir": tmp / "state",
        "database_url": database_url,
        "store": str(tmp / "store"),
        "admin_token": SecretStr(ADMIN),
        "service_token": SecretStr(SERVICE),
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    """The test app's settings."""
    return make_settings(tmp_path, database_url)


@pytest.fixture
def app(settings: Settings) -> Iterator[FastAPI]:
    """The control plane app; its engine is disposed afterwards."""
    application = create_app(settings)
    yield application
    application.state.ctx.close()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """A TestClient of the app."""
    with TestClient(app) as c:
        yield c


# -- helpers ------------------------------------------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    """The Authorization header for a token."""
    return {"Authorization": f"Bearer {token}"}


def start_command(tmp_path: Path, port: int, *args: str) -> subprocess.Popen[str]:
    """`loraplane controlplane --port PORT ARGS` as a user runs it (embedded mode in
    `tmp_path`, output and errors in one pipe), once its /healthz answers 200."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAPLANE_DATA_DIR": str(tmp_path),
           "LORAPLANE_ADMIN_TOKEN": ADMIN, "LORAPLANE_SERVICE_TOKEN": SERVICE}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplane", "controlplane", "--port", str(port), *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_ok(f"http://127.0.0.1:{port}/healthz", 60, alive=proc)
    except NotReady as e:
        proc.kill()
        what = "exited" if e.stopped else "did not start"
        raise AssertionError(f"the control plane {what}: {proc.communicate()[0]}") from None
    return proc


ADMIN_H = bearer(ADMIN)
SERVICE_H = bearer(SERVICE)


@dataclass
class Api:
    """Short-hands over a client: admin set-up and tenant uploads."""

    client: TestClient
    base_model_dir: Path
    work: Path
    keys: dict[str, str] = field(default_factory=dict)

    def tenant(self, name: str, **quotas: Any) -> str:
        """Create a tenant and one key; return the key."""
        r = self.client.post("/v1/tenants", json={"name": name, **quotas}, headers=ADMIN_H)
        assert r.status_code == 201, r.text
        r = self.client.post(f"/v1/tenants/{name}/keys", json={"name": "k"}, headers=ADMIN_H)
        assert r.status_code == 201, r.text
        self.keys[name] = r.json()["key"]
        return self.keys[name]

    def pool(self, name: str = "pool-a", **limits: Any) -> dict[str, Any]:
        """Register a pool serving the tiny base model."""
        body = {
            "name": name,
            "base_model": {"name": BASE_NAME, "uri": str(self.base_model_dir)},
            **limits,
        }
        r = self.client.post("/v1/pools", json=body, headers=ADMIN_H)
        assert r.status_code == 201, r.text
        result: dict[str, Any] = r.json()
        return result

    def adapter_dir(self, seed: int = 0, r: int = 8, **config: Any) -> Path:
        """A valid adapter folder with distinct content per seed."""
        out = self.work / f"adapter-{uuid.uuid4().hex[:8]}"
        return write_adapter(out, lora_config(r=r, **config), lora_tensors(BASE, r, seed=seed))

    def upload(
        self,
        key: str,
        name: str,
        source: Path,
        base_model: str = BASE_NAME,
        headers: dict[str, str] | None = None,
        fields: dict[str, str] | None = None,
    ) -> Any:
        """POST /v1/adapters with a folder's files or one archive (and extra form `fields`,
        such as a signature); the response."""
        paths = sorted(source.iterdir()) if source.is_dir() else [source]
        files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in paths]
        return self.client.post(
            "/v1/adapters",
            data={"name": name, "base_model": base_model, **(fields or {})},
            files=files,
            headers={**bearer(key), **(headers or {})},
        )

    def wait_upload(self, key: str, location: str, timeout: float = 60.0) -> dict[str, Any]:
        """Poll a background upload until it has an outcome; its last state."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.client.get(location, headers=bearer(key))
            assert r.status_code == 200, r.text
            job: dict[str, Any] = r.json()
            if job["status"] in ("succeeded", "failed"):
                return job
            assert time.monotonic() < deadline, f"upload still {job['status']} after {timeout}s"
            time.sleep(0.05)


@pytest.fixture
def api(client: TestClient, base_model_dir: Path, tmp_path: Path) -> Api:
    """Helpers over `client`."""
    work = tmp_path / "work"
    work.mkdir()
    return Api(client, base_model_dir, work)


@pytest.fixture
def ready(api: Api) -> Api:
    """A pool and two tenants (acme, globex) with keys."""
    api.pool()
    api.tenant("acme")
    api.tenant("globex")
    return api
