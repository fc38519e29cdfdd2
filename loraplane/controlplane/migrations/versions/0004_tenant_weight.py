"""A tenant's scheduling weight: its share of a contended replica's seats and served tokens.

Revision ID: 0004
Revises: 0003
Created: 2026-12-02

Existing tenants get weight 1 (the server default), so every tenant keeps an equal share
until the admin changes one. SQLite adds and drops the column in place (ALTER TABLE, SQLite
3.35 or later): a batch copy of `tenants` would have to drop a table that every key,
adapter and usage row refers to.

Reviewed by hand against `Tenant` in loraplane/controlplane/models.py (the migration test
compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float(), nullable=False, server_default="1"))


def downgrade() -> None:
    # Weights are lost: below 0004 every tenant has the same share.
    op.drop_column("tenants", "weight")
