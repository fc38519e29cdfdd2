"""Weighted rollouts: an adapter's traffic split across its versions.

Revision ID: 0007
Revises: 0006
Created: 2026-12-04

`adapters.rollout`: `{"<version>": <weight>, ...}` (weights summing to 100) while a rollout
runs, NULL otherwise (every row already there: the plain name serves `current_version`, as
before). SQLite adds and drops the column in place (ALTER TABLE, SQLite 3.35 or later), as 0004
to 0006 do.

Reviewed by hand against `Adapter` in loraplane/controlplane/models.py (the migration test
compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("rollout", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Below 0007 there are no splits: a running rollout ends as a rollback would (the plain
    # name serves current_version alone).
    op.drop_column("adapters", "rollout")
