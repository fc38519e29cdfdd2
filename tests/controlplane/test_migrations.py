"""Migrations: upgrade, downgrade, upgrade again on SQLite and PostgreSQL, and the models and
the migrated schema agree (autogenerate finds no difference)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, MetaData, Table, delete, insert, inspect, select
from sqlalchemy.orm import Session

from loraplane.controlplane import db
from loraplane.controlplane.models import (
    Adapter,
    AdapterPin,
    AdapterVersion,
    Base,
    Pool,
    SigningKey,
    Tenant,
)
from tests.controlplane import pg

TABLES = {
    "tenants", "api_keys", "adapters", "adapter_versions", "audit_events", "usage", "pools",
    "upload_jobs", "signing_keys",
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


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_pool_from_before_0003_is_found_in_namespace_default(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """0003 keys pools by (namespace, name): existing pools move to namespace "default", keep
    their config, and the name is then free in other namespaces; a downgrade that would lose a
    pool is refused."""
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    now = datetime.now(UTC)
    config = {"model_type": "llama", "hidden_size": 64}
    row = {
        "name": "pool-a", "base_model_name": "m", "base_model_uri": "/m",
        "base_model_config": config, "max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 8,
        "created_at": now, "updated_at": now,
    }  # fmt: skip
    try:
        db.upgrade(engine, "0002")
        with engine.begin() as conn:
            conn.execute(insert(Table("pools", MetaData(), autoload_with=conn)).values(**row))
        db.upgrade(engine)
        with Session(engine) as session:
            (pool,) = session.scalars(select(Pool))
            assert (pool.namespace, pool.name, pool.base_model_config) == (
                "default",
                "pool-a",
                config,
            )
            session.add(Pool(**{**row, "namespace": "team-b", "base_model_config": None}))
            session.commit()
        with pytest.raises(RuntimeError, match=r"pool-a \(in several namespaces\).*team-b/pool-a"):
            db.downgrade(engine, "0002")
        # refused as a whole: the later migrations it had undone are back (SQLite too)
        assert db.current_revision(engine) == db.head_revision()
        with Session(engine) as session:
            assert session.scalars(select(Pool.name)).all() == ["pool-a", "pool-a"]
            assert session.scalars(select(Tenant)).all() == []  # every column still there
        with engine.begin() as conn:
            conn.execute(delete(Pool).where(Pool.namespace == "team-b"))
        db.downgrade(engine, "0002")
        assert "namespace" not in {c["name"] for c in inspect(engine).get_columns("pools")}
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_tenant_from_before_0004_has_weight_1_and_a_downgrade_drops_the_column(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """0004 adds the tenant's scheduling weight: rows already there get 1 (equal shares), new
    rows may set another; the downgrade works with tenants (and rows that refer to them)."""
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    now = datetime.now(UTC)
    row = {
        "name": "acme", "namespace": "acme", "max_adapters": 10, "max_rank": 16,
        "max_bytes": 1 << 20, "requests_per_minute": 60, "tokens_per_minute": 1000,
        "deleted": False, "created_at": now, "updated_at": now,
    }  # fmt: skip
    try:
        db.upgrade(engine, "0003")
        with engine.begin() as conn:
            tenants = Table("tenants", MetaData(), autoload_with=conn)
            tenant_id = conn.execute(insert(tenants).values(**row)).inserted_primary_key[0]
            keys = Table("api_keys", MetaData(), autoload_with=conn)
            conn.execute(
                insert(keys).values(
                    tenant_id=tenant_id, name="k", prefix="lp_abc", key_hash="0" * 64,
                    created_at=now,
                )
            )  # fmt: skip
        db.upgrade(engine)
        with Session(engine) as session:
            (acme,) = session.scalars(select(Tenant))
            assert acme.weight == 1.0 and isinstance(acme.weight, float)
            session.add(Tenant(**{**row, "name": "heavy", "namespace": "heavy", "weight": 2.5}))
            session.commit()
            weights = {n: w for n, w in session.execute(select(Tenant.name, Tenant.weight))}
            assert weights == {"acme": 1.0, "heavy": 2.5}
        db.downgrade(engine, "0003")
        assert "weight" not in {c["name"] for c in inspect(engine).get_columns("tenants")}
        with engine.connect() as conn:
            names = conn.execute(select(Table("tenants", MetaData(), autoload_with=conn).c.name))
            assert sorted(names.scalars()) == ["acme", "heavy"]
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_0006_leaves_existing_rows_unsigned_and_unrequired_and_downgrades_with_keys(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """0006 adds signing keys, the tenant and pool policies (false for rows already there:
    nothing existing starts refusing uploads) and each version's signer (NULL before); the
    downgrade drops them all with keys registered and signed versions recorded."""
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    now = datetime.now(UTC)
    try:
        db.upgrade(engine, "0005")
        with engine.begin() as conn:
            meta = MetaData()
            tenants = Table("tenants", meta, autoload_with=conn)
            tenant_id = conn.execute(
                insert(tenants).values(
                    name="acme", namespace="acme", max_adapters=10, max_rank=16,
                    max_bytes=1 << 20, requests_per_minute=60, tokens_per_minute=1000,
                    deleted=False, created_at=now, updated_at=now, weight=1.0,
                )
            ).inserted_primary_key[0]  # fmt: skip
            adapters = Table("adapters", meta, autoload_with=conn)
            adapter_id = conn.execute(
                insert(adapters).values(
                    tenant_id=tenant_id, name="bot", base_model="tiny", current_version=1,
                    deleted=False, follow_latest=True, created_at=now, updated_at=now,
                )
            ).inserted_primary_key[0]  # fmt: skip
            versions = Table("adapter_versions", meta, autoload_with=conn)
            conn.execute(
                insert(versions).values(
                    adapter_id=adapter_id, version=1, digest="ab" * 32, path="p/", rank=4,
                    alpha=8.0, target_modules=["q_proj"], size_bytes=1, base_model="tiny",
                    created_at=now, created_by="t",
                )
            )  # fmt: skip
        db.upgrade(engine)
        with Session(engine) as session:
            (acme,) = session.scalars(select(Tenant))
            assert acme.require_signature is False
            (v1,) = session.scalars(select(AdapterVersion))
            assert (v1.signing_key_id, v1.signed_digest, v1.signature) == (None, None, None)
            session.add(
                SigningKey(tenant_id=acme.id, key_id="0" * 16, algorithm="ed25519",
                           public_key="pem", name="ci")
            )  # fmt: skip
            v1.signing_key_id, v1.signed_digest = "0" * 16, "sha256:" + "ab" * 32
            session.commit()
        db.downgrade(engine, "0005")
        names = inspect(engine)
        assert "signing_keys" not in names.get_table_names()
        assert "signing_key_id" not in {c["name"] for c in names.get_columns("adapter_versions")}
        assert "require_signature" not in {c["name"] for c in names.get_columns("tenants")}
        db.upgrade(engine)
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_0008_gives_existing_tenants_no_pin_quota_and_downgrades_with_pins(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """0008 adds pins and the tenant's max_pinned_bytes (0 for rows already there: only the
    admin pins for them); the downgrade drops both with pins recorded."""
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    try:
        _tenant_row_then_upgrade(engine, "0007")
        with Session(engine) as session:
            (acme,) = session.scalars(select(Tenant))
            assert acme.max_pinned_bytes == 0
            pool = Pool(name="p", base_model_name="b", base_model_uri="/m", max_lora_rank=8,
                        max_loras=4, max_cpu_loras=8)  # fmt: skip
            adapter = Adapter(tenant_id=acme.id, name="bot", base_model="b")
            session.add_all([pool, adapter])
            session.flush()
            version = AdapterVersion(adapter_id=adapter.id, version=1, digest="0" * 64, path="x",
                                     rank=8, alpha=16.0, target_modules=["q_proj"],
                                     size_bytes=100, base_model="b")  # fmt: skip
            session.add(version)
            session.flush()
            session.add(AdapterPin(tenant_id=acme.id, version_id=version.id, pool_id=pool.id,
                                   replicas=2))  # fmt: skip
            session.commit()
        db.downgrade(engine, "0007")
        assert "max_pinned_bytes" not in {c["name"] for c in inspect(engine).get_columns("tenants")}
        assert "adapter_pins" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_0009_lets_existing_tenants_register_their_own_signing_keys(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """0009 adds `signing_keys_by_admin`, false for rows already there; the downgrade drops it."""
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    try:
        _tenant_row_then_upgrade(engine, "0008")
        with Session(engine) as session:
            (acme,) = session.scalars(select(Tenant))
            assert acme.signing_keys_by_admin is False
            acme.signing_keys_by_admin = True
            session.commit()
        db.downgrade(engine, "0008")
        columns = {c["name"] for c in inspect(engine).get_columns("tenants")}
        assert "signing_keys_by_admin" not in columns and "max_pinned_bytes" in columns
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_0010_gives_existing_pools_no_host_byte_limit_and_downgrades_without_it(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """0010 adds `pools.max_cpu_lora_bytes`, null for rows already there (no byte limit, as
    before); a pool keeps a limit as large as a host's memory; the downgrade drops it."""
    engine = db.make_engine(fresh_url(backend, tmp_path, request))
    now = datetime.now(UTC)
    try:
        db.upgrade(engine, "0009")
        with engine.begin() as conn:
            pools = Table("pools", MetaData(), autoload_with=conn)
            conn.execute(insert(pools).values(
                namespace="default", name="old", base_model_name="b", base_model_uri="/m",
                max_lora_rank=8, max_loras=4, max_cpu_loras=8, require_signed_adapters=False,
                created_at=now, updated_at=now,
            ))  # fmt: skip
        db.upgrade(engine)
        with Session(engine) as session:
            (old,) = session.scalars(select(Pool))
            assert old.max_cpu_lora_bytes is None
            old.max_cpu_lora_bytes = 1 << 40  # over 32 bits: a BIGINT
            session.commit()
        with Session(engine) as session:
            assert session.scalars(select(Pool)).one().max_cpu_lora_bytes == 1 << 40
        db.downgrade(engine, "0009")
        assert "max_cpu_lora_bytes" not in {c["name"] for c in inspect(engine).get_columns("pools")}
    finally:
        engine.dispose()


def _tenant_row_then_upgrade(engine: Engine, before: str) -> None:
    """The schema at revision `before`, a tenant row written there, then the head's."""
    now = datetime.now(UTC)
    row = {
        "name": "acme", "namespace": "acme", "max_adapters": 10, "max_rank": 16,
        "max_bytes": 1 << 20, "requests_per_minute": 60, "tokens_per_minute": 1000,
        "deleted": False, "created_at": now, "updated_at": now,
    }  # fmt: skip
    db.upgrade(engine, before)
    with engine.begin() as conn:
        tenants = Table("tenants", MetaData(), autoload_with=conn)
        conn.execute(insert(tenants).values(**row))
    db.upgrade(engine)
