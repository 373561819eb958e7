"""Planning indexes: what plans read of every row from an index alone, entries in "last used" order.

``ix_entries_env_plan`` (environment, both sizes, compile time, last access,
creation, warm run, id) replaces ``ix_entries_env_size``: the totals every prune
and gc plan starts from and gc's cost score read only it, never the table. The two
"last used" indexes (``coalesce(last_access_at, created_at)``, then ``id``)
let --unused-for range-scan and gc's lru walk entries in eviction order,
stopping once it has enough.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_LAST_USED = "coalesce(last_access_at, created_at)"


def upgrade() -> None:
    op.create_index(
        "ix_entries_env_plan",
        "entries",
        [
            "environment_id",
            "size_bytes",
            "aot_size_bytes",
            "compile_time_ms",
            "last_access_at",
            "created_at",
            "warm_run_id",
            "id",
        ],
        unique=False,
    )
    op.drop_index("ix_entries_env_size", table_name="entries")
    op.create_index("ix_entries_last_used", "entries", [sa.text(_LAST_USED), "id"], unique=False)
    op.create_index(
        "ix_entries_env_last_used",
        "entries",
        ["environment_id", sa.text(_LAST_USED), "id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_entries_env_last_used", table_name="entries")
    op.drop_index("ix_entries_last_used", table_name="entries")
    op.create_index(
        "ix_entries_env_size", "entries", ["environment_id", "size_bytes"], unique=False
    )
    op.drop_index("ix_entries_env_plan", table_name="entries")
