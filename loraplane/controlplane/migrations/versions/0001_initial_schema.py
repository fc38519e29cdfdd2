"""Initial catalog schema: tenants, API keys, adapters and versions, audit, usage, pools.

Revision ID: 0001
Revises:
Created: 2026-11-29

Reviewed by hand against loraplane/controlplane/models.py (a test checks that the models
and the migrated schema agree on SQLite and PostgreSQL). Constraint names follow the models'
naming convention, so later migrations can address them on both databases.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _times(*names: str, nullable: bool = False) -> list[sa.Column[object]]:
    return [sa.Column(n, sa.DateTime(timezone=True), nullable=nullable) for n in names]


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("namespace", sa.String(length=63), nullable=False),
        sa.Column("max_adapters", sa.Integer(), nullable=False),
        sa.Column("max_rank", sa.Integer(), nullable=False),
        sa.Column("max_bytes", sa.BigInteger(), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=False),
        sa.Column("tokens_per_minute", sa.BigInteger(), nullable=False),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        *_times("created_at", "updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        *_times("created_at"),
        *_times("last_used_at", "revoked_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("prefix", name="uq_api_keys_prefix"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("current_version", sa.Integer(), nullable=True),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        *_times("created_at", "updated_at"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_adapters_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        # also the index of the hot path: (tenant, adapter name) -> adapter
        sa.UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),
    )
    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("path", sa.String(length=512), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        *_times("created_at"),
        sa.Column("created_by", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name="fk_adapter_versions_adapter_id_adapters"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_adapter_versions"),
        # one row per store version number: racing inserts of a number meet here
        sa.UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_id_version"),
    )
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), nullable=False),
        *_times("time"),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=100), nullable=False),
        sa.Column("target", sa.String(length=300), nullable=False),
        sa.Column("outcome", sa.String(length=100), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_audit_events"),
    )
    op.create_index("ix_audit_events_time", "audit_events", ["time"])
    op.create_table(
        "usage",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("adapter", sa.String(length=63), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_usage_tenant_id_tenants"),
        sa.PrimaryKeyConstraint("id", name="pk_usage"),
        # the upsert target of usage reports
        sa.UniqueConstraint("tenant_id", "adapter", "day", name="uq_usage_tenant_id_adapter_day"),
    )
    op.create_table(
        "pools",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("base_model_name", sa.String(length=200), nullable=False),
        sa.Column("base_model_uri", sa.String(length=1024), nullable=False),
        sa.Column("base_model_config", sa.JSON(), nullable=False),
        sa.Column("max_lora_rank", sa.Integer(), nullable=False),
        sa.Column("max_loras", sa.Integer(), nullable=False),
        sa.Column("max_cpu_loras", sa.Integer(), nullable=False),
        sa.Column("pressure", sa.JSON(), nullable=True),
        *_times("pressure_at", nullable=True),
        *_times("created_at", "updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_pools"),
        sa.UniqueConstraint("name", name="uq_pools_name"),
    )
    op.create_index("ix_pools_base_model_name", "pools", ["base_model_name"])


def downgrade() -> None:
    op.drop_index("ix_pools_base_model_name", table_name="pools")
    op.drop_table("pools")
    op.drop_table("usage")
    op.drop_index("ix_audit_events_time", table_name="audit_events")
    op.drop_table("audit_events")
    op.drop_table("adapter_versions")
    op.drop_table("adapters")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
