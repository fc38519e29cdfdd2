"""An adapter's life in the catalog: serve a chosen version and hold it across pushes, follow
the latest again, roll back, delete; what the data plane resolves at each step; the audit
trail; and migration 0005 that brought `follow_latest` (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, Table, insert, inspect, select
from sqlalchemy.orm import Session

from loraplane.controlplane import db
from loraplane.controlplane.crud.adapters import version_ranges
from loraplane.controlplane.models import Adapter, AuditEvent
from tests.controlplane import pg
from tests.controlplane.conftest import BASE_NAME, SERVICE_H, Api, bearer

ASYNC = {"Prefer": "respond-async"}


def served(api: Api, key: str, model: str = "bot") -> int | None:
    """The version the data plane's resolve gives for `model` (None: 404)."""
    r = api.client.get(
        "/internal/v1/resolve", params={"model": model}, headers={**SERVICE_H, "X-Tenant-Key": key}
    )
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["adapter"] == model.split("@")[0] and len(body["digest"]) == 64
    version: int = body["version"]
    return version


def patch(api: Api, key: str, version: int | None, name: str = "bot") -> Any:
    return api.client.patch(
        f"/v1/adapters/{name}", json={"current_version": version}, headers=bearer(key)
    )


def state(api: Api, key: str, name: str = "bot") -> tuple[int | None, int | None, bool]:
    """(current_version, latest_version, follow_latest) of an adapter."""
    body = api.client.get(f"/v1/adapters/{name}", headers=bearer(key)).json()
    return body["current_version"], body["latest_version"], body["follow_latest"]


def audit_events(api: Api) -> list[tuple[str, str, dict[str, Any] | None]]:
    sessions = api.client.app.state.ctx.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        rows = session.scalars(select(AuditEvent).order_by(AuditEvent.id))
        return [(e.action, e.target, e.detail) for e in rows]


def push(api: Api, key: str, seed: int, name: str = "bot") -> Any:
    r = api.upload(key, name, api.adapter_dir(seed=seed))
    assert r.status_code in (200, 201), r.text
    return r.json()


def test_a_served_version_holds_across_later_pushes(ready: Api) -> None:
    key = ready.keys["acme"]
    push(ready, key, 1)
    push(ready, key, 2)
    assert state(ready, key) == (2, 2, True)  # a new adapter follows its latest

    r = patch(ready, key, 1)
    assert r.status_code == 200, r.text
    assert (r.json()["current_version"], r.json()["follow_latest"]) == (1, False)
    assert r.json()["current"]["version"] == 1
    assert served(ready, key) == 1

    third = push(ready, key, 3)
    assert (third["version"]["version"], third["current_version"]) == (3, 1)  # v1 still serves
    assert state(ready, key) == (1, 3, False)
    assert served(ready, key) == 1
    assert served(ready, key, "bot@3") == 3  # a pinned request reaches the new version
    again = push(ready, key, 2)  # identical content: the stored v2, and still v1 serving
    assert (again["created"], again["current_version"]) == (False, 1)
    listed = ready.client.get("/v1/adapters", headers=bearer(key)).json()
    assert [(a["name"], a["current_version"], a["follow_latest"]) for a in listed] == [
        ("bot", 1, False)
    ]


def test_current_version_null_serves_the_latest_and_follows_later_pushes(ready: Api) -> None:
    key = ready.keys["acme"]
    for seed in (1, 2, 3):
        push(ready, key, seed)
    assert patch(ready, key, 1).status_code == 200
    r = patch(ready, key, None)
    assert r.status_code == 200, r.text
    assert (r.json()["current_version"], r.json()["follow_latest"]) == (3, True)
    assert served(ready, key) == 3
    fourth = push(ready, key, 4)
    assert fourth["current_version"] == 4
    assert state(ready, key) == (4, 4, True)
    assert served(ready, key) == 4
    # serving the latest version by number holds it too: the choice is what is held
    assert patch(ready, key, 4).json()["follow_latest"] is False
    assert push(ready, key, 5)["current_version"] == 4


def test_rolling_back_serves_the_older_version_and_forward_again(ready: Api) -> None:
    key = ready.keys["acme"]
    push(ready, key, 1)
    push(ready, key, 2)
    assert patch(ready, key, 1).json()["current_version"] == 1  # roll back
    assert served(ready, key) == 1
    assert patch(ready, key, 2).json()["current_version"] == 2  # and forward
    assert served(ready, key) == 2
    assert state(ready, key) == (2, 2, False)


def test_a_version_that_does_not_exist_is_404_naming_the_versions_there_are(ready: Api) -> None:
    key = ready.keys["acme"]
    for seed in (1, 2, 3):
        push(ready, key, seed)
    r = patch(ready, key, 9)
    assert r.status_code == 404
    assert r.json()["error"] == {
        "code": "NotFound",
        "message": "adapter 'bot' has no version 9; its versions: v1-v3",
    }
    assert state(ready, key) == (3, 3, True)  # nothing changed
    assert patch(ready, key, 2, name="nobody").status_code == 404
    other = patch(ready, ready.keys["globex"], 1)  # another tenant's adapter: 404, not 403
    assert other.status_code == 404 and other.json()["error"]["message"] == (
        "adapter 'bot' not found"
    )


@pytest.mark.parametrize(
    "body", [{}, {"current_version": 0}, {"current_version": 1.5}, {"current_version": 1, "x": 1}]
)
def test_a_malformed_patch_is_400_and_changes_nothing(ready: Api, body: dict[str, Any]) -> None:
    key = ready.keys["acme"]
    push(ready, key, 1)
    r = ready.client.patch("/v1/adapters/bot", json=body, headers=bearer(key))
    assert r.status_code == 400, r.text
    assert state(ready, key) == (1, 1, True)


def test_version_ranges_name_every_version_in_few_words() -> None:
    assert version_ranges([]) == "none"
    assert version_ranges([1]) == "v1"
    assert version_ranges([1, 2, 3, 5, 7, 8]) == "v1-v3, v5, v7-v8"


def test_each_change_is_audited_with_what_served_before_and_after(ready: Api) -> None:
    key = ready.keys["acme"]
    push(ready, key, 1)
    push(ready, key, 2)
    patch(ready, key, 1)
    patch(ready, key, None)
    ready.client.delete("/v1/adapters/bot", headers=bearer(key))
    changes = [e for e in audit_events(ready) if not e[0].startswith("adapter.version.")]
    target = "tenants/acme/adapters/bot"
    assert [e for e in changes if e[1] == target] == [
        (
            "adapter.set_current_version",
            target,
            {"from": 2, "to": 1, "follow_latest_before": True, "follow_latest": False},
        ),
        (
            "adapter.follow_latest",
            target,
            {"from": 1, "to": 2, "follow_latest_before": False, "follow_latest": True},
        ),
        ("adapter.delete", target, None),
    ]


def test_delete_stops_serving_frees_the_quota_keeps_the_files_and_a_push_starts_afresh(
    api: Api,
) -> None:
    api.pool()
    key = api.tenant("acme", max_adapters=1)
    other = api.tenant("globex")
    push(api, key, 1)
    push(api, key, 2)
    patch(api, key, 1)
    store = Path(api.client.app.state.ctx.settings.effective_store)  # type: ignore[attr-defined]
    files = sorted(store.rglob("adapters/acme/bot/*/adapter_model.safetensors"))
    assert len(files) == 2

    full = api.upload(key, "second", api.adapter_dir(seed=9))
    assert full.status_code == 409
    message = full.json()["error"]["message"]
    assert message.endswith(
        "delete one (`loraplane adapters delete NAME` or the console's Delete) or ask for a "
        "higher quota"
    )

    assert api.client.delete("/v1/adapters/bot", headers=bearer(other)).status_code == 404
    assert served(api, key) == 1  # another tenant's delete touched nothing
    r = api.client.delete("/v1/adapters/bot", headers=bearer(key))
    assert r.status_code == 204 and r.content == b""
    assert api.client.get("/v1/adapters/bot", headers=bearer(key)).status_code == 404
    assert api.client.get("/v1/adapters", headers=bearer(key)).json() == []
    assert served(api, key) is None
    assert served(api, key, "bot@2") is None  # no version of a deleted adapter resolves
    again = api.client.delete("/v1/adapters/bot", headers=bearer(key))
    assert again.status_code == 404
    assert all(f.exists() for f in files)  # stored versions stay until retention removes them

    assert api.upload(key, "second", api.adapter_dir(seed=9)).status_code == 201  # quota freed
    assert api.client.delete("/v1/adapters/second", headers=bearer(key)).status_code == 204
    revived = push(api, key, 3)  # the old name, new content: the next number, following
    assert (revived["version"]["version"], revived["current_version"]) == (3, 3)
    assert state(api, key) == (3, 3, True)
    assert push(api, key, 4)["current_version"] == 4


def test_versions_the_operator_records_follow_the_same_rule(ready: Api) -> None:
    """Cluster mode: the operator stores a LoRAAdapter's new content and records it through
    the internal API; a held adapter keeps serving its version, a following one moves."""
    key = ready.keys["acme"]
    tenant = "acme"  # the tenant's namespace

    def record(version: int) -> Any:
        body = {
            "tenant": tenant, "name": "gitops", "version": version, "digest": f"{version:064x}",
            "path": f"adapters/acme/gitops/v{version}", "rank": 8, "alpha": 16.0,
            "target_modules": ["q_proj"], "size_bytes": 1, "base_model": BASE_NAME,
        }  # fmt: skip
        r = ready.client.post("/internal/v1/versions", json=body, headers=SERVICE_H)
        assert r.status_code == 201, r.text
        return r.json()

    record(1)
    assert record(2)["current_version"] == 2
    assert patch(ready, key, 1, name="gitops").status_code == 200
    assert record(3)["current_version"] == 1
    assert served(ready, key, "gitops") == 1
    assert patch(ready, key, None, name="gitops").json()["current_version"] == 3
    assert record(4)["current_version"] == 4
    assert served(ready, key, "gitops") == 4


def test_a_background_upload_answers_the_served_version_and_the_ignored_files(ready: Api) -> None:
    key = ready.keys["acme"]
    push(ready, key, 1)
    patch(ready, key, 1)
    source = ready.adapter_dir(seed=2)
    (source / "training_args.bin").write_bytes(b"\x80\x04not weights")
    (source / "trainer_state.json").write_text("{}")
    r = ready.upload(key, "bot", source, headers=ASYNC)
    assert r.status_code == 202, r.text
    job = ready.wait_upload(key, r.headers["Location"])
    assert job["status"] == "succeeded", job
    result = job["result"]
    assert result["version"]["version"] == 2 and result["current_version"] == 1
    assert result["ignored"] == ["trainer_state.json", "training_args.bin"]
    sync = ready.upload(key, "bot", source)  # the synchronous answer lists the same files
    assert sync.status_code == 200 and sync.json()["ignored"] == result["ignored"]


# -- migration 0005 -------------------------------------------------------------------------------


def fresh_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    admin: str = request.getfixturevalue("pg_admin_url")
    return pg.create_database(admin, f"mig_{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_0005_adapters_serving_their_newest_version_follow_it_others_hold_theirs(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    now = datetime.now(UTC)
    tenant = {
        "name": "acme", "namespace": "acme", "max_adapters": 10, "max_rank": 16,
        "max_bytes": 1 << 20, "requests_per_minute": 60, "tokens_per_minute": 1000,
        "deleted": False, "created_at": now, "updated_at": now, "weight": 1.0,
    }  # fmt: skip
    # name -> (current_version, recorded versions)
    adapters = {"newest": (2, [1, 2]), "older": (1, [1, 2]), "empty": (None, [])}
    try:
        db.upgrade(engine, "0004")
        with engine.begin() as conn:
            meta = MetaData()
            tenants, rows, versions, jobs = (
                Table(t, meta, autoload_with=conn)
                for t in ("tenants", "adapters", "adapter_versions", "upload_jobs")
            )
            made = conn.execute(insert(tenants).values(**tenant)).inserted_primary_key
            assert made is not None
            tenant_id = made[0]
            for name, (current, numbers) in adapters.items():
                added = conn.execute(
                    insert(rows).values(
                        tenant_id=tenant_id, name=name, base_model="m", current_version=current,
                        deleted=False, created_at=now, updated_at=now,
                    )
                ).inserted_primary_key  # fmt: skip
                assert added is not None
                adapter_id = added[0]
                for n in numbers:
                    conn.execute(
                        insert(versions).values(
                            adapter_id=adapter_id, version=n, digest=f"{n:064x}", path=f"p{n}",
                            rank=4, alpha=8.0, target_modules=["q_proj"], size_bytes=1,
                            base_model="m", created_at=now, created_by="t",
                        )
                    )  # fmt: skip
            conn.execute(
                insert(jobs).values(
                    id="a" * 32, tenant_id=tenant_id, adapter="newest", base_model="m",
                    size_bytes=1, status="succeeded", actor="t", version=2, created=True,
                    created_at=now,
                )
            )  # fmt: skip
        db.upgrade(engine)
        with Session(engine) as session:
            follows = {
                n: f for n, f in session.execute(select(Adapter.name, Adapter.follow_latest))
            }
            assert follows == {"newest": True, "older": False, "empty": True}
            serving = {
                n: c for n, c in session.execute(select(Adapter.name, Adapter.current_version))
            }
            assert serving == {"newest": 2, "older": 1, "empty": None}  # nothing else moved
        with engine.connect() as conn:
            job = conn.execute(select(Table("upload_jobs", MetaData(), autoload_with=conn))).one()
            assert job.ignored is None  # a job from before lists nothing
        db.downgrade(engine, "0004")
        assert "follow_latest" not in {c["name"] for c in inspect(engine).get_columns("adapters")}
        assert "ignored" not in {c["name"] for c in inspect(engine).get_columns("upload_jobs")}
        with engine.connect() as conn:
            names = conn.execute(select(Table("adapters", MetaData(), autoload_with=conn).c.name))
            assert sorted(names.scalars()) == ["empty", "newest", "older"]
        db.upgrade(engine)
        assert db.current_revision(engine) == db.head_revision()
    finally:
        engine.dispose()
