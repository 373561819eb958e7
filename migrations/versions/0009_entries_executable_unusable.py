"""Entries record warm-check's verdict on their stored executable (``aot_unusable``).

warm-check calls every stored executable once on dummy inputs in a child process; one that
raises or crashes is marked with the reason, and ``cachectl.serving`` serves that bucket
through ``jax.jit`` instead of calling it. NULL: usable (or never checked).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("entries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("aot_unusable", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("entries", schema=None) as batch_op:
        batch_op.drop_column("aot_unusable")
