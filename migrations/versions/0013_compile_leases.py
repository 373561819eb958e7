"""One compile per program across a fleet: a lease per (cache, environment, key).

``compile_leases``: the process that misses a program first holds its row while it compiles
(``expires_at`` pushed out by a heartbeat); others wait for ``state`` to become ``written``
(with the entry's ``sha256``) or ``unwritten``, or hedge. ``compile_ms`` and ``module`` record
how long the program took, which bounds the next waiter's patience (cachectl/service/compile_lease.py).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "compile_leases",
        sa.Column("scope", sa.String(256), nullable=False),
        sa.Column("key", sa.String(512), nullable=False),
        sa.Column("holder", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("module", sa.String(512), nullable=True),
        sa.Column("hedger", sa.String(256), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("compile_ms", sa.BigInteger(), nullable=True),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("scope", "key"),
    )
    op.create_index("ix_compile_leases_module", "compile_leases", ["scope", "module"])
    op.create_index("ix_compile_leases_expires", "compile_leases", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_compile_leases_expires", table_name="compile_leases")
    op.drop_index("ix_compile_leases_module", table_name="compile_leases")
    op.drop_table("compile_leases")
