"""Entries record the stored executable (``<key>-aot``) kept beside the JAX entry.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 08:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("entries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("aot_size_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("aot_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("entries", schema=None) as batch_op:
        batch_op.drop_column("aot_sha256")
        batch_op.drop_column("aot_size_bytes")
