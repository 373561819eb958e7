"""gc's cost cut reads the entry key from the planning index, not the table.

``ix_entries_env_plan`` gains ``key`` (before ``id``): the cost policy's cut scores
every candidate over this index and then looked up each row under its bound in the
table for its key (~1 us a row, the larger part of a 1,000,000-row plan on SQLite);
with the key in the index the cut is one scan and one sort.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_COLUMNS = [
    "environment_id",
    "size_bytes",
    "aot_size_bytes",
    "compile_time_ms",
    "last_access_at",
    "created_at",
    "warm_run_id",
]


def upgrade() -> None:
    op.drop_index("ix_entries_env_plan", table_name="entries")
    op.create_index("ix_entries_env_plan", "entries", [*_COLUMNS, "key", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_entries_env_plan", table_name="entries")
    op.create_index("ix_entries_env_plan", "entries", [*_COLUMNS, "id"], unique=False)
