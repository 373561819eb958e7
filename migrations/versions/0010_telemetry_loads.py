"""Telemetry counts cachectl.serving's loads apart from requests and hits.

``telemetry.loads``: stored executables a serving runtime loaded (JAX never looked them up,
so they are neither requests nor hits); ``miss_seconds`` and ``hit_seconds``: the service's
compile stage for its misses and its hits, what the "saved" estimate is made of. From this
revision on ``uncacheable`` holds only the
requests for JAX-internal staging programs; a program JAX did not write (too fast to compile,
a read-only service) is a miss.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("telemetry") as batch:
        batch.add_column(sa.Column("loads", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("miss_seconds", sa.Double(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("hit_seconds", sa.Double(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("telemetry") as batch:
        batch.drop_column("hit_seconds")
        batch.drop_column("miss_seconds")
        batch.drop_column("loads")
