"""Namespaced pools, and a base model config that may wait for the pool's replicas.

Revision ID: 0003
Revises: 0002
Created: 2026-12-06

A pool mirrors a ServingPool, which is named by (namespace, name): the unique name becomes
unique per namespace, and existing pools land in namespace "default". `base_model_config` may
be NULL: a pool whose base model is only on its pods' volume learns it from their reports.
SQLite alters tables in batch mode (a copy), which keeps the index on `base_model_name`.

Reviewed by hand against `Pool` in loraplane/controlplane/models.py (the migration test
compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.add_column(
            sa.Column("namespace", sa.String(length=63), nullable=False, server_default="default")
        )
        batch.alter_column("base_model_config", existing_type=sa.JSON(), nullable=True)
        batch.drop_constraint("uq_pools_name", type_="unique")
        batch.create_unique_constraint("uq_pools_namespace_name", ["namespace", "name"])


def downgrade() -> None:
    # Refuse rather than drop pools: the older schema can hold neither a name used in two
    # namespaces nor a pool still waiting for its base model config.
    pools = sa.table(
        "pools", sa.column("namespace"), sa.column("name"), sa.column("base_model_config")
    )
    conn = op.get_bind()
    shared = conn.execute(
        sa.select(pools.c.name).group_by(pools.c.name).having(sa.func.count() > 1)
    ).scalars()
    pending = conn.execute(
        sa.select(pools.c.namespace, pools.c.name).where(pools.c.base_model_config.is_(None))
    ).all()
    blocking = [f"{name} (in several namespaces)" for name in shared]
    blocking += [f"{ns}/{name} (base model config pending)" for ns, name in pending]
    if blocking:
        raise RuntimeError(
            "cannot downgrade below 0003 while these pools exist: " + ", ".join(blocking)
        )
    with op.batch_alter_table("pools") as batch:
        batch.drop_constraint("uq_pools_namespace_name", type_="unique")
        batch.create_unique_constraint("uq_pools_name", ["name"])
        batch.alter_column("base_model_config", existing_type=sa.JSON(), nullable=False)
        batch.drop_column("namespace")
