"""A tenant policy: only the admin registers the tenant's signing keys.

Revision ID: 0009
Revises: 0008
Created: 2026-12-05

`tenants.signing_keys_by_admin` (false for rows already there: tenants keep registering
their own keys until the admin says otherwise). Added and dropped in place, as 0004 does.

Reviewed by hand against `Tenant` in loraplane/controlplane/models.py (the migration test
compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "tenants",
        sa.Column("signing_keys_by_admin", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    # The policy is lost: below 0009 every tenant registers its own signing keys.
    op.drop_column("tenants", "signing_keys_by_admin")
