"""serving_telemetry: cachectl.serving's per-function counters and raw request sizes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 08:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "serving_telemetry",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("process", sa.String(length=256), nullable=False),
        sa.Column("function", sa.String(length=256), nullable=False),
        sa.Column("calls", sa.BigInteger(), nullable=False),
        sa.Column("aot", sa.BigInteger(), nullable=False),
        sa.Column("fallback", sa.BigInteger(), nullable=False),
        sa.Column("out_of_bucket", sa.BigInteger(), nullable=False),
        sa.Column("padded", sa.BigInteger(), nullable=False),
        sa.Column("sizes", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["environment_id"], ["environments.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("serving_telemetry", schema=None) as batch_op:
        batch_op.create_index("ix_serving_telemetry_env_at", ["environment_id", "at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("serving_telemetry", schema=None) as batch_op:
        batch_op.drop_index("ix_serving_telemetry_env_at")
    op.drop_table("serving_telemetry")
