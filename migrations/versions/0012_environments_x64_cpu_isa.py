"""An environment names its x64 mode and, on CPU, the instruction set XLA compiles for.

``environments.enable_x64``: jax_enable_x64 in the process that recorded the environment (a
stored executable refuses a process of the other mode). ``environments.cpu_isa``: on the CPU
backend, the instruction-set level and vector-feature digest XLA:CPU targets
(cachectl.core.cpu_isa); '' elsewhere. Rows of older environments read False and '', the values
their digests were computed without.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("environments") as batch:
        batch.add_column(
            sa.Column("enable_x64", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(
            sa.Column("cpu_isa", sa.String(length=128), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("environments") as batch:
        batch.drop_column("cpu_isa")
        batch.drop_column("enable_x64")
