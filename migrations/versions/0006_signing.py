"""signing: a cache's trusted Ed25519 public keys, and each environment's signed content list.

Revision ID: 0006
Revises: 0005

"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("caches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("trusted_keys", sa.JSON(), nullable=True))
    with op.batch_alter_table("environments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("content_signature", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("environments", schema=None) as batch_op:
        batch_op.drop_column("content_signature")
    with op.batch_alter_table("caches", schema=None) as batch_op:
        batch_op.drop_column("trusted_keys")
