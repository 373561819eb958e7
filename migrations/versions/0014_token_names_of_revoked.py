"""A revoked token's name can be used again: a name is unique among the tokens not revoked.

``tokens.name`` was unique over every row, so a revoked token held its name for ever (its row is
kept: it is what the audit log's rows and ``token list`` name). The unique constraint becomes a
partial unique index over the rows whose ``revoked_at`` is NULL (SQLite and PostgreSQL both have
them); SQLite's table is rebuilt to drop its unnamed constraint.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

ACTIVE = sa.text("revoked_at IS NULL")
# Names the unnamed unique constraint SQLite's reflection finds, so batch mode can drop it.
NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _drop_name_unique() -> None:
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("tokens", naming_convention=NAMING, recreate="always") as batch:
            batch.drop_constraint("uq_tokens_name", type_="unique")
    else:
        op.drop_constraint("tokens_name_key", "tokens", type_="unique")


def upgrade() -> None:
    _drop_name_unique()
    op.create_index(
        "ix_tokens_active_name",
        "tokens",
        ["name"],
        unique=True,
        sqlite_where=ACTIVE,
        postgresql_where=ACTIVE,
    )


def downgrade() -> None:
    op.drop_index("ix_tokens_active_name", table_name="tokens")
    with op.batch_alter_table("tokens") as batch:
        batch.create_unique_constraint("tokens_name_key", ["name"])
