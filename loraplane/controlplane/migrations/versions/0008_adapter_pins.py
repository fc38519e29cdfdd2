"""Pinned adapters: versions kept resident on k replicas of a pool, and the tenant quota.

Revision ID: 0008
Revises: 0007
Created: 2026-12-04

`adapter_pins`: one row per (version, pool), with the number of replicas to keep it on.
`tenants.max_pinned_bytes`: 0 for rows already there (their tenants pin nothing until the
admin grants a quota; the admin pins regardless). SQLite adds and drops the column in place
(ALTER TABLE, SQLite 3.35 or later), as 0004 to 0006 do.

Reviewed by hand against `AdapterPin` and `Tenant` in loraplane/controlplane/models.py (the
migration test compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_pins",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_adapter_pins_tenant_id_tenants"
        ),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["adapter_versions.id"],
            name="fk_adapter_pins_version_id_adapter_versions",
        ),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"], name="fk_adapter_pins_pool_id_pools"),
        sa.PrimaryKeyConstraint("id", name="pk_adapter_pins"),
        sa.UniqueConstraint("version_id", "pool_id", name="uq_adapter_pins_version_id_pool_id"),
    )
    op.create_index("ix_adapter_pins_tenant_id", "adapter_pins", ["tenant_id"])
    op.create_index("ix_adapter_pins_pool_id", "adapter_pins", ["pool_id"])
    op.add_column(
        "tenants",
        sa.Column("max_pinned_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    # Below 0007 nothing is pinned: the pins and the quota are lost (replicas then evict the
    # versions like any other).
    op.drop_column("tenants", "max_pinned_bytes")
    op.drop_index("ix_adapter_pins_pool_id", table_name="adapter_pins")
    op.drop_index("ix_adapter_pins_tenant_id", table_name="adapter_pins")
    op.drop_table("adapter_pins")
