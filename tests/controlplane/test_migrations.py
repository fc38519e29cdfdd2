"""Migrations: upgrade, downgrade, upgrade again on SQLite and PostgreSQL, and the models and
the migrated schema agree (autogenerate finds no difference)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from loraplane.controlplane import db
from loraplane.controlplane.models import Base
from tests.controlplane import pg

TABLES = {
    "tenants", "api_keys", "adapters", "adapter_versions", "audit_events", "usage", "pools",
    "upload_jobs",
}  # fmt: skip


def fresh_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    admin: str = request.getfixturevalue("pg_admin_url")
    return pg.create_database(admin, f"mig_{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_upgrade_downgrade_upgrade_and_models_match(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    try:
        db.upgrade(engine)
        assert db.current_revision(engine) == db.head_revision()
        assert set(inspect(engine).get_table_names()) >= TABLES
        db.downgrade(engine, "base")
        assert db.current_revision(engine) is None
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        db.upgrade(engine)
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], diff
    finally:
        engine.dispose()


def test_one_head_and_every_migration_has_a_downgrade() -> None:
    script = ScriptDirectory.from_config(db.alembic_config("sqlite://"))
    assert len(script.get_heads()) == 1
    for rev in script.walk_revisions():
        assert rev.module.downgrade.__code__.co_code != (lambda: None).__code__.co_code
