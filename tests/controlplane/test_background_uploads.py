"""Background ingest (embedded mode): big uploads and `Prefer: respond-async` answer 202 with
a job the tenant polls at `/v1/uploads/{id}`; the job ends as the synchronous upload would
have (the same version, or the same error code), and nothing is lost across restarts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from loraplane.controlplane import db, jobs
from loraplane.controlplane.crud import jobs as crud_jobs
from loraplane.controlplane.main import create_app
from loraplane.controlplane.models import UploadJob, utcnow
from loraplane.controlplane.settings import Settings
from tests.adapters.test_bad_corpus import Case
from tests.controlplane.conftest import Api, bearer, make_settings
from tests.controlplane.test_adapters import store_files
from tests.controlplane.test_bad_uploads import SAMPLES

ASYNC = {"Prefer": "respond-async"}


def accepted(r: Any) -> str:
    """The Location of a 202 background upload."""
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] in ("pending", "running") and job["result"] is None
    assert r.headers["Location"] == f"/v1/uploads/{job['id']}"
    return str(r.headers["Location"])


def test_respond_async_upload_is_a_job_that_stores_the_version(ready: Api) -> None:
    key = ready.keys["acme"]
    source = ready.adapter_dir(seed=1)
    r = ready.upload(key, "bot", source, headers=ASYNC)
    assert r.headers["Preference-Applied"] == "respond-async"
    job = ready.wait_upload(key, accepted(r))
    assert job["status"] == "succeeded" and job["error"] is None, job
    assert job["result"]["created"] is True and job["result"]["version"]["version"] == 1
    assert job["name"] == "bot" and job["size_bytes"] > 0 and job["finished_at"] is not None
    adapter = ready.client.get("/v1/adapters/bot", headers=bearer(key)).json()
    assert adapter["current_version"] == 1
    assert adapter["current"]["digest"] == job["result"]["version"]["digest"]

    # Identical content in the background: the same version, not a new one.
    again = ready.wait_upload(key, accepted(ready.upload(key, "bot", source, headers=ASYNC)))
    assert again["status"] == "succeeded"
    assert again["result"]["created"] is False and again["result"]["version"]["version"] == 1
    # New content: the next version, as a synchronous upload would give.
    sync = ready.upload(key, "bot", ready.adapter_dir(seed=2))
    assert sync.status_code == 201 and sync.json()["version"]["version"] == 2

    listed = ready.client.get("/v1/uploads", headers=bearer(key)).json()
    assert [j["id"] for j in listed] == [again["id"], job["id"]]  # newest first


@pytest.mark.parametrize("case", SAMPLES, ids=[c.id for c in SAMPLES])
def test_rejected_adapter_fails_the_job_with_its_reason_code_and_stores_nothing(
    ready: Api, settings: Settings, tmp_path: Path, case: Case
) -> None:
    key = ready.keys["acme"]
    before = store_files(settings)
    build = tmp_path / "case"
    build.mkdir()
    job = ready.wait_upload(
        key, accepted(ready.upload(key, "bad", case.build(build), headers=ASYNC))
    )
    assert job["status"] == "failed" and job["result"] is None
    assert job["error"]["code"] == case.code.value
    assert case.fragment in job["error"]["message"]
    assert store_files(settings) == before
    assert ready.client.get("/v1/adapters/bad", headers=bearer(key)).status_code == 404


def test_what_can_be_refused_before_reading_is_refused_at_once(ready: Api) -> None:
    key = ready.keys["acme"]
    bad_name = ready.upload(key, "Bad Name", ready.adapter_dir(), headers=ASYNC)
    assert bad_name.status_code == 400, bad_name.text
    unknown = ready.upload(key, "bot", ready.adapter_dir(), base_model="nope", headers=ASYNC)
    assert unknown.status_code == 422 and unknown.json()["error"]["code"] == "UnknownBaseModel"
    assert ready.client.get("/v1/uploads", headers=bearer(key)).json() == []


def test_another_tenants_upload_is_404(ready: Api) -> None:
    owner, other = ready.keys["acme"], ready.keys["globex"]
    location = accepted(ready.upload(owner, "bot", ready.adapter_dir(), headers=ASYNC))
    r = ready.client.get(location, headers=bearer(other))
    assert r.status_code == 404 and r.json()["error"]["code"] == "NotFound"
    assert ready.client.get("/v1/uploads", headers=bearer(other)).json() == []
    assert ready.wait_upload(owner, location)["status"] == "succeeded"


@pytest.fixture
def app_with(tmp_path: Path, database_url: str, base_model_dir: Path) -> Iterator[Any]:
    """Build an app with some settings overridden: `app_with(**overrides) -> Api`."""
    apps: list[Any] = []

    def build(**overrides: Any) -> Api:
        app = create_app(make_settings(tmp_path, database_url, **overrides))
        apps.append(app)
        client = TestClient(app)
        work = tmp_path / f"work-{len(apps)}"
        work.mkdir()
        return Api(client, base_model_dir, work)

    yield build
    for app in apps:
        app.state.ctx.close()


def test_uploads_over_the_threshold_go_to_the_background(app_with: Any) -> None:
    api = app_with(background_ingest_bytes=1)
    api.pool()
    key = api.tenant("acme")
    r = api.upload(key, "bot", api.adapter_dir())
    assert "Preference-Applied" not in r.headers
    job = api.wait_upload(key, accepted(r))
    assert job["status"] == "succeeded" and job["result"]["version"]["version"] == 1


class Gate:
    """Holds every background ingest until opened (ingest itself is replaced: this tests
    the queue, not the adapter core)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.entered = threading.Semaphore(0)
        real = jobs.ingest_adapter

        def held(*args: Any, **kwargs: Any) -> Any:
            self.entered.release()
            assert self.open.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(jobs, "ingest_adapter", held)


def test_queue_cap_is_429_and_shutdown_fails_queued_jobs_as_interrupted(
    app_with: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    api = app_with(ingest_workers=1, max_pending_uploads=2)
    api.pool()
    key = api.tenant("acme")
    running = accepted(api.upload(key, "one", api.adapter_dir(seed=1), headers=ASYNC))
    assert gate.entered.acquire(timeout=30)
    queued = accepted(api.upload(key, "two", api.adapter_dir(seed=2), headers=ASYNC))
    full = api.upload(key, "three", api.adapter_dir(seed=3), headers=ASYNC)
    assert full.status_code == 429 and full.json()["error"]["code"] == "RateLimited"
    assert int(full.headers["Retry-After"]) >= 1

    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    closing = threading.Thread(target=ctx.uploads.close)
    closing.start()
    gate.open.set()  # the running job finishes; the queued one never starts
    closing.join(30)
    assert not closing.is_alive()
    assert api.wait_upload(key, running)["status"] == "succeeded"
    failed = api.wait_upload(key, queued)
    assert failed["status"] == "failed" and failed["error"]["code"] == "Interrupted"
    assert list(ctx.store.staging_dir().iterdir()) == []  # no upload left behind


def test_unfinished_jobs_read_as_interrupted(app_with: Any, database_url: str) -> None:
    api = app_with()
    api.pool()
    key = api.tenant("acme")
    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    with db.session_scope(ctx.sessions) as session:
        from loraplane.controlplane.crud.tenants import get_tenant

        tenant = get_tenant(session, name="acme")
        old = crud_jobs.create_job(
            session, tenant=tenant, adapter="old", base_model="m", size_bytes=1, actor="t"
        )
        fresh = crud_jobs.create_job(
            session, tenant=tenant, adapter="fresh", base_model="m", size_bytes=1, actor="t"
        )
        session.execute(
            update(UploadJob)
            .where(UploadJob.id == old.id)
            .values(created_at=utcnow() - timedelta(hours=2))
        )
        session.commit()
    # Older than the timeout (1 h): its process is gone, whatever the database.
    job = api.client.get(f"/v1/uploads/{old.id}", headers=bearer(key)).json()
    assert job["status"] == "failed" and job["error"]["code"] == "Interrupted"
    fresh_state = api.client.get(f"/v1/uploads/{fresh.id}", headers=bearer(key)).json()
    if database_url.startswith("sqlite"):
        # A SQLite catalog has one process: a restart fails what it left unfinished.
        assert fresh_state["status"] == "pending"
        restarted = app_with()
        job = restarted.client.get(f"/v1/uploads/{fresh.id}", headers=bearer(key)).json()
        assert job["status"] == "failed" and job["error"]["code"] == "Interrupted"
    else:
        # Several replicas may share PostgreSQL: a young job may be another replica's.
        assert fresh_state["status"] == "pending"
        restarted = app_with()
        job = restarted.client.get(f"/v1/uploads/{fresh.id}", headers=bearer(key)).json()
        assert job["status"] == "pending"


def test_finished_jobs_are_pruned_after_the_retention_period(ready: Api) -> None:
    key = ready.keys["acme"]
    first = ready.wait_upload(key, accepted(ready.upload(key, "a", ready.adapter_dir(seed=1),
                                                         headers=ASYNC)))  # fmt: skip
    second = ready.wait_upload(key, accepted(ready.upload(key, "b", ready.adapter_dir(seed=2),
                                                          headers=ASYNC)))  # fmt: skip
    ctx = ready.client.app.state.ctx  # type: ignore[attr-defined]
    with db.session_scope(ctx.sessions) as session:
        session.execute(
            update(UploadJob)
            .where(UploadJob.id == first["id"])
            .values(finished_at=utcnow() - timedelta(days=8))
        )
        session.commit()
    # The next queued upload prunes jobs that ended more than 7 days ago (the default).
    third = accepted(ready.upload(key, "c", ready.adapter_dir(seed=3), headers=ASYNC))
    ready.wait_upload(key, third)
    assert ready.client.get(f"/v1/uploads/{first['id']}", headers=bearer(key)).status_code == 404
    listed = [j["id"] for j in ready.client.get("/v1/uploads", headers=bearer(key)).json()]
    assert second["id"] in listed and third.rsplit("/", 1)[1] in listed
    # The version the pruned job made is untouched: jobs are a view, the catalog is the record.
    assert ready.client.get("/v1/adapters/a", headers=bearer(key)).json()["current_version"] == 1
