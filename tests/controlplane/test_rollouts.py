"""Weighted rollouts in the catalog: a split set with PATCH, refused in words when it cannot
be served, answered by resolve with every version and its weight (a pin bypasses it),
promoted or rolled back with one call each, audited at each change; migration 0007 up and
down (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, Table, insert, inspect, select

from loraplane.controlplane import db
from tests.controlplane import pg
from tests.controlplane.conftest import SERVICE_H, Api, bearer
from tests.controlplane.test_adapter_lifecycle import audit_events, push, served, state

TARGET = "tenants/acme/adapters/bot"


def resolve(api: Api, key: str, model: str = "bot") -> dict[str, Any]:
    r = api.client.get(
        "/internal/v1/resolve", params={"model": model}, headers={**SERVICE_H, "X-Tenant-Key": key}
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def set_split(api: Api, key: str, split: dict[str, Any], name: str = "bot") -> Any:
    return api.client.patch(f"/v1/adapters/{name}", json={"rollout": split}, headers=bearer(key))


def three_versions(api: Api, key: str) -> None:
    for seed in (1, 2, 3):
        push(api, key, seed)
    r = api.client.patch("/v1/adapters/bot", json={"current_version": 2}, headers=bearer(key))
    assert r.status_code == 200, r.text


def test_a_split_is_shown_resolved_with_every_version_and_a_pin_bypasses_it(ready: Api) -> None:
    key = ready.keys["acme"]
    three_versions(ready, key)
    r = set_split(ready, key, {"2": 90, "3": 10})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["rollout"] == [{"version": 2, "weight": 90}, {"version": 3, "weight": 10}]
    assert (body["current_version"], body["follow_latest"]) == (2, False)

    answer = resolve(ready, key)
    assert answer["version"] == 2  # what a data plane that ignores the split serves
    split = answer["rollout"]
    assert [(v["version"], v["weight"]) for v in split] == [(2, 90), (3, 10)]
    assert all(len(v["digest"]) == 64 and v["path"] and v["rank"] > 0 for v in split)
    assert split[0]["digest"] == answer["digest"]
    pinned = resolve(ready, key, "bot@3")
    assert pinned["version"] == 3 and pinned["rollout"] is None

    push(ready, key, 4)  # a push during a rollout changes nothing served
    assert state(ready, key) == (2, 4, False)
    assert [v["version"] for v in resolve(ready, key)["rollout"]] == [2, 3]
    listed = ready.client.get("/v1/adapters", headers=bearer(key)).json()
    assert listed[0]["rollout"] == body["rollout"]


@pytest.mark.parametrize(
    ("split", "status", "words"),
    [
        (
            {"2": 90, "3": 20},
            400,
            "a rollout's weights sum to 100; these (v2: 90, v3: 20) sum to 110",
        ),
        ({"2": 50, "3": 50, "1": 0, "4": 0, "5": 0}, 400, "at most 4 versions; this one names 5"),
        ({}, 400, "a rollout names at least one version"),
        ({"2": 90, "3": -10}, 400, "rollout.3: must be at least 0 (got -10)"),
        ({"2": 90, "3": 10.5}, 400, "rollout.3: must be an integer"),
        ({"0": 100}, 400, "rollout.0.[key]: must be at least 1"),
        ({"two": 100}, 400, "rollout.two.[key]: must be an integer"),
        ({"2": 90, "9": 10}, 404, "adapter 'bot' has no version 9; its versions: v1-v3"),
    ],
)
def test_a_split_that_cannot_be_served_is_refused_in_words_and_changes_nothing(
    ready: Api, split: dict[str, Any], status: int, words: str
) -> None:
    key = ready.keys["acme"]
    three_versions(ready, key)
    r = set_split(ready, key, split)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert ready.client.get("/v1/adapters/bot", headers=bearer(key)).json()["rollout"] is None
    assert resolve(ready, key)["rollout"] is None


@pytest.mark.parametrize(
    "body",
    [{"rollout": {"2": 100}, "current_version": 2}, {"rollout": None}, {"rollout": [2, 3]}],
)
def test_a_patch_names_exactly_one_choice(ready: Api, body: dict[str, Any]) -> None:
    key = ready.keys["acme"]
    three_versions(ready, key)
    r = ready.client.patch("/v1/adapters/bot", json=body, headers=bearer(key))
    assert r.status_code == 400, r.text


def test_promote_and_rollback_are_one_call_each_and_every_change_is_audited(ready: Api) -> None:
    key = ready.keys["acme"]
    three_versions(ready, key)
    url = "/v1/adapters/bot/rollout"
    assert set_split(ready, key, {"2": 90, "3": 10}).status_code == 200
    assert set_split(ready, key, {"2": 50, "3": 50}).status_code == 200

    r = ready.client.post(f"{url}/rollback", headers=bearer(key))
    assert r.status_code == 200, r.text
    assert (r.json()["current_version"], r.json()["rollout"]) == (2, None)
    assert served(ready, key) == 2 and resolve(ready, key)["rollout"] is None
    again = ready.client.post(f"{url}/rollback", headers=bearer(key))
    assert again.status_code == 409
    assert again.json()["error"]["message"] == "adapter 'bot' has no rollout to roll back"

    assert set_split(ready, key, {"1": 10, "2": 80, "3": 10}).status_code == 200
    ambiguous = ready.client.post(f"{url}/promote", headers=bearer(key))
    assert ambiguous.status_code == 409
    assert "name the version to promote" in ambiguous.json()["error"]["message"]
    outside = ready.client.post(f"{url}/promote", json={"version": 4}, headers=bearer(key))
    assert outside.status_code == 404
    assert set_split(ready, key, {"2": 90, "3": 10}).status_code == 200
    r = ready.client.post(f"{url}/promote", headers=bearer(key))  # the canary, by default
    assert r.status_code == 200, r.text
    assert (r.json()["current_version"], r.json()["rollout"]) == (3, None)
    assert served(ready, key) == 3

    assert set_split(ready, key, {"1": 0, "2": 100}).status_code == 200  # one at 100: promoted
    assert state(ready, key) == (2, 3, False)
    assert set_split(ready, key, {"2": 90, "3": 10}).status_code == 200
    assert (
        ready.client.patch(  # choosing a version ends the split
            "/v1/adapters/bot", json={"current_version": 1}, headers=bearer(key)
        ).json()["rollout"]
        is None
    )
    assert resolve(ready, key)["rollout"] is None
    other = ready.client.post(f"{url}/promote", headers=bearer(ready.keys["globex"]))
    assert other.status_code == 404  # another tenant's adapter

    changes = [(a, d) for a, t, d in audit_events(ready) if t == TARGET and "rollout" in a]
    assert changes == [
        ("adapter.rollout.set", {"from": None, "to": {"2": 90, "3": 10}, "current_version": 2}),
        ("adapter.rollout.set",
         {"from": {"2": 90, "3": 10}, "to": {"2": 50, "3": 50}, "current_version": 2}),
        ("adapter.rollout.rollback", {"rollout": {"2": 50, "3": 50}, "to": 2}),
        ("adapter.rollout.set",
         {"from": None, "to": {"1": 10, "2": 80, "3": 10}, "current_version": 2}),
        ("adapter.rollout.set",
         {"from": {"1": 10, "2": 80, "3": 10}, "to": {"2": 90, "3": 10}, "current_version": 2}),
        ("adapter.rollout.promote",
         {"from": 2, "to": 3, "rollout": {"2": 90, "3": 10}, "via": "promote"}),
        ("adapter.rollout.promote", {"from": 3, "to": 2, "rollout": None, "via": "rollout"}),
        ("adapter.rollout.set", {"from": None, "to": {"2": 90, "3": 10}, "current_version": 2}),
    ]  # fmt: skip
    ended = [d for a, t, d in audit_events(ready) if a == "adapter.set_current_version"]
    assert ended[-1] is not None and ended[-1]["rollout_ended"] == {"2": 90, "3": 10}


def test_a_split_starts_with_its_heaviest_version_as_the_rollback_target(ready: Api) -> None:
    """The GitOps way: the canary is pushed (and, following the latest, served) in the same
    change that sets the split: the stable version is the split's heaviest, not the newest."""
    key = ready.keys["acme"]
    push(ready, key, 1)
    push(ready, key, 2)
    assert state(ready, key) == (2, 2, True)
    assert set_split(ready, key, {"1": 90, "2": 10}).json()["current_version"] == 1
    assert resolve(ready, key)["version"] == 1
    assert set_split(ready, key, {"1": 40, "2": 60}).json()["current_version"] == 1  # running
    assert set_split(ready, key, {"1": 0, "2": 50, "3": 50}).status_code == 404  # no v3
    push(ready, key, 3)
    moved = set_split(ready, key, {"1": 0, "2": 50, "3": 50}).json()  # v1 taken to 0: moves
    assert moved["current_version"] == 2
    r = ready.client.post("/v1/adapters/bot/rollout/rollback", headers=bearer(key))
    assert r.json()["current_version"] == 2 and served(ready, key) == 2
    detail = [d for a, _, d in audit_events(ready) if a == "adapter.rollout.set"]
    assert detail[0] == {"from": None, "to": {"1": 90, "2": 10}, "current_version": 1,
                         "current_before": 2}  # fmt: skip


def test_a_deleted_adapter_pushed_again_starts_without_a_split(ready: Api) -> None:
    key = ready.keys["acme"]
    three_versions(ready, key)
    assert set_split(ready, key, {"2": 90, "3": 10}).status_code == 200
    assert ready.client.delete("/v1/adapters/bot", headers=bearer(key)).status_code == 204
    push(ready, key, 5)
    assert resolve(ready, key)["rollout"] is None
    assert ready.client.get("/v1/adapters/bot", headers=bearer(key)).json()["rollout"] is None


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_0007_adds_no_split_to_existing_adapters_and_downgrades_dropping_it(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'r.db'}"
    else:
        url = pg.create_database(
            request.getfixturevalue("pg_admin_url"), f"ro_{uuid.uuid4().hex[:8]}"
        )
    engine = db.make_engine(url)
    try:
        db.upgrade(engine, "0006")
        meta = MetaData()
        tenants = Table("tenants", meta, autoload_with=engine)
        adapters = Table("adapters", meta, autoload_with=engine)
        with engine.begin() as conn:
            tid = conn.execute(
                insert(tenants).values(
                    name="acme", namespace="acme", max_adapters=5, max_rank=64,
                    max_bytes=1 << 30, requests_per_minute=0, tokens_per_minute=0,
                    deleted=False, created_at=_now(), updated_at=_now(),
                )
            ).inserted_primary_key[0]  # fmt: skip
            conn.execute(
                insert(adapters).values(
                    tenant_id=tid, name="bot", base_model="b", current_version=1,
                    deleted=False, created_at=_now(), updated_at=_now(),
                )
            )  # fmt: skip
        db.upgrade(engine)
        with engine.begin() as conn:
            migrated = Table("adapters", MetaData(), autoload_with=engine)
            assert conn.execute(select(migrated.c.rollout)).scalar_one() is None
            conn.execute(migrated.update().values(rollout={"1": 90, "2": 10}))
        db.downgrade(engine, "0006")
        assert "rollout" not in {c["name"] for c in inspect(engine).get_columns("adapters")}
        with engine.connect() as conn:
            assert conn.execute(select(adapters.c.current_version)).scalar_one() == 1
    finally:
        engine.dispose()


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)
