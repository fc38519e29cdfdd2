"""A pool's host byte limit: `pools.max_cpu_lora_bytes`.

Revision ID: 0010
Revises: 0009
Created: 2026-12-06

`pools.max_cpu_lora_bytes` (ServingPool `spec.lora.maxCpuLoraBytes`, the replicas'
`--max-cpu-lora-bytes`): host bytes a replica's host tier may take. Nullable, null for rows
already there: no byte limit, as before. Added and dropped in place, as 0004 does.

Reviewed by hand against `Pool` in loraplane/controlplane/models.py (the migration test
compares models and migrated schema on SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("max_cpu_lora_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # The limit is lost: below 0010 a pool's replicas have no host byte limit.
    op.drop_column("pools", "max_cpu_lora_bytes")
