"""signatures: the program signatures services compiled, with hit/miss/uncacheable counts;
telemetry.uncacheable: misses of programs JAX never writes.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 08:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signatures",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=False),
        sa.Column("function", sa.String(length=512), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=True),
        sa.Column("leaves", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(length=512), nullable=True),
        sa.Column("statics", sa.JSON(), nullable=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("hits", sa.BigInteger(), nullable=False),
        sa.Column("misses", sa.BigInteger(), nullable=False),
        sa.Column("uncacheable", sa.BigInteger(), nullable=False),
        sa.Column("repeats", sa.BigInteger(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["environment_id"], ["environments.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("signatures", schema=None) as batch_op:
        batch_op.create_index(
            "ix_signatures_env_fn_digest", ["environment_id", "function", "digest"], unique=False
        )
        batch_op.create_index(
            "ix_signatures_env_last", ["environment_id", "last_seen"], unique=False
        )
    with op.batch_alter_table("telemetry", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("uncacheable", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("telemetry", schema=None) as batch_op:
        batch_op.drop_column("uncacheable")
    with op.batch_alter_table("signatures", schema=None) as batch_op:
        batch_op.drop_index("ix_signatures_env_last")
        batch_op.drop_index("ix_signatures_env_fn_digest")
    op.drop_table("signatures")
