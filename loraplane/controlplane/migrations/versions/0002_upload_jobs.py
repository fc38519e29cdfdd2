"""Upload jobs: uploads ingested in the background, polled at /v1/uploads/{id}.

Revision ID: 0002
Revises: 0001
Created: 2026-11-29

Reviewed by hand against `UploadJob` in loraplane/controlplane/models.py (the migration test
compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "upload_jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("adapter", sa.String(length=63), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("created", sa.Boolean(), nullable=True),
        sa.Column("error_code", sa.String(length=100), nullable=True),
        sa.Column("error_message", sa.String(length=1000), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_upload_jobs_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_upload_jobs"),
    )
    op.create_index("ix_upload_jobs_tenant_id", "upload_jobs", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_upload_jobs_tenant_id", table_name="upload_jobs")
    op.drop_table("upload_jobs")
