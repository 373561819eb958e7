"""Index entries by (environment_id, size_bytes) so per-environment totals need no table scan.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 11:40:00
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_entries_env_size", "entries", ["environment_id", "size_bytes"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_entries_env_size", table_name="entries")
