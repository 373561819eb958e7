"""An SQLite index file as the stdlib driver sees it: its path, its time format, its schema.

Shared by the two stdlib paths (cachectl/service_sqlite.py for services, cachectl/index/reads.py
for the CLI's read commands), which skip SQLAlchemy's import. Kept apart from both, so a service
loads none of the index package's records.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

# The Alembic head the stdlib statements are written for (tests/test_service_sqlite.py fails
# when a migration is added without looking at them).
SCHEMA_REVISION = "0010"


def sqlite_path(url: str) -> Path | None:
    """The file of a plain ``sqlite:///PATH`` URL (the driver and query forms go the SQLAlchemy way)."""
    if not url.startswith("sqlite:///") or "?" in url:
        return None
    path = unquote(url[len("sqlite:///") :])
    if not path or path == ":memory:":
        return None
    return Path(path).expanduser()


def stamp(value: datetime) -> str:
    """A UTC time as SQLAlchemy's SQLite DateTime stores it (so string order is time order)."""
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")


def when(value: Any) -> datetime | None:
    """A time column as either driver returns it (SQLite: naive text; PostgreSQL: a datetime),
    as an aware UTC datetime."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def from_json(value: Any) -> Any:
    """A JSON column as either driver returns it (SQLite: the text; PostgreSQL: the value)."""
    return json.loads(value) if isinstance(value, str) else value
