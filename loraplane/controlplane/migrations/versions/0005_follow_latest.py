"""An adapter follows its latest version unless a version was chosen; a background upload
keeps the files it ignored.

Revision ID: 0005
Revises: 0004
Created: 2026-12-03

`adapters.follow_latest`: a push makes the new version current only while it is true. Rows
already there follow the latest unless they serve another version than their newest (a
tenant chose that one: before 0005 the next push would have moved it anyway, which is the
bug this fixes). `upload_jobs.ignored`: the files of an upload beside the adapter (a Trainer
checkpoint's training_args.bin, optimizer.pt, ...), listed in the job's answer; NULL for jobs
from before. SQLite adds and drops both columns in place (ALTER TABLE, SQLite 3.35 or later),
as 0004 does.

Reviewed by hand against `Adapter` and `UploadJob` in loraplane/controlplane/models.py (the
migration test compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "adapters",
        sa.Column("follow_latest", sa.Boolean(), nullable=False, server_default=sa.true()),
    )
    adapters = sa.table(
        "adapters", sa.column("id"), sa.column("current_version"), sa.column("follow_latest")
    )
    versions = sa.table("adapter_versions", sa.column("adapter_id"), sa.column("version"))
    latest = (
        sa.select(sa.func.max(versions.c.version))
        .where(versions.c.adapter_id == adapters.c.id)
        .scalar_subquery()
    )
    op.execute(
        adapters.update()
        .where(adapters.c.current_version.is_not(None), adapters.c.current_version != latest)
        .values(follow_latest=sa.false())
    )
    op.add_column("upload_jobs", sa.Column("ignored", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Below 0005 a push always serves the newest version: chosen versions are forgotten (they
    # stay current until the next push), and background jobs stop listing ignored files.
    op.drop_column("upload_jobs", "ignored")
    op.drop_column("adapters", "follow_latest")
