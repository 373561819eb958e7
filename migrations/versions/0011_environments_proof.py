"""The last warm-check of a namespace on a machine of its fingerprint.

``environments.proof``: JSON of cachectl.core.records.Proof (when, the running machine's
fingerprint, devices and host, hits of buckets, stored executables called, the canary's
result). ``ls`` and ``stats`` show whether a namespace was proven on hardware; NULL: never checked.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("environments") as batch:
        batch.add_column(sa.Column("proof", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("environments") as batch:
        batch.drop_column("proof")
