"""Signed adapters: tenants' signing keys, the tenant and pool policies, and each version's
signer.

Revision ID: 0006
Revises: 0005
Created: 2026-12-04

`signing_keys`: a tenant's public keys (PEM, key id = the first 16 hex digits of the SHA-256
of the DER SubjectPublicKeyInfo), revoked in place. `tenants.require_signature` and
`pools.require_signed_adapters` (false for rows already there: nothing existing starts to
refuse uploads). `adapter_versions.signing_key_id`, `signed_digest`, `signature`: NULL for
unsigned versions and for every version from before. SQLite adds and drops the columns in
place (ALTER TABLE, SQLite 3.35 or later), as 0004 and 0005 do.

Reviewed by hand against `SigningKey`, `Tenant`, `Pool` and `AdapterVersion` in
loraplane/controlplane/models.py (the migration test compares models and migrated schema on
SQLite and PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

VERSION_COLUMNS = (("signing_key_id", 16), ("signed_digest", 71), ("signature", 512))


def upgrade() -> None:
    op.create_table(
        "signing_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("algorithm", sa.String(length=32), nullable=False),
        sa.Column("public_key", sa.String(length=4096), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_signing_keys_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_signing_keys"),
        sa.UniqueConstraint("tenant_id", "key_id", name="uq_signing_keys_tenant_id_key_id"),
    )
    op.add_column(
        "tenants",
        sa.Column("require_signature", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column(
        "pools",
        sa.Column(
            "require_signed_adapters", sa.Boolean(), nullable=False, server_default=sa.false()
        ),
    )
    for name, length in VERSION_COLUMNS:
        op.add_column("adapter_versions", sa.Column(name, sa.String(length), nullable=True))


def downgrade() -> None:
    # Below 0006 nothing is signed: the policies, the keys and each version's signer are lost
    # (the versions themselves stay, as unsigned ones).
    for name, _ in reversed(VERSION_COLUMNS):
        op.drop_column("adapter_versions", name)
    op.drop_column("pools", "require_signed_adapters")
    op.drop_column("tenants", "require_signature")
    op.drop_table("signing_keys")
