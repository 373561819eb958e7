"""An SQLite index file as the stdlib driver sees it: its path, its time format, its schema.

Used by the stdlib index driver (cachectl/index/stdlib.py: a service's index and the CLI's read
commands) and the read queries' SqliteReader (cachectl/index/reads.py), which skip SQLAlchemy's
import.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

# The Alembic head the stdlib statements are written for (tests/test_service_sqlite.py fails
# when a migration is added without looking at them).
SCHEMA_REVISION = "0014"
BUSY_TIMEOUT_S = 30.0  # cachectl.index.db.SQLITE_BUSY_TIMEOUT_MS: writers wait, never fail at once
# SQLite's page cache per connection for the index's writers (cachectl.index.db's engines and
# sync's stdlib writer, cachectl.index.sync_stdlib).
SQLITE_CACHE_KIB = 16 * 1024


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


def connect(url: str, *pragmas: str) -> sqlite3.Connection | None:
    """A connection to the index file of ``url`` at SCHEMA_REVISION, with ``pragmas`` set; None
    where the stdlib cannot serve it (not a plain SQLite file, no file, another revision, any
    sqlite3 error): the caller takes the SQLAlchemy path. ``mode=rw`` never creates the file,
    and unlike ``mode=ro`` lets the last connection's close checkpoint the WAL."""
    path = sqlite_path(url)
    if path is None or not path.is_file():
        return None
    conn = None
    try:
        conn = sqlite3.connect(
            f"file:{quote(str(path.resolve()))}?mode=rw",
            uri=True,
            timeout=BUSY_TIMEOUT_S,
            isolation_level=None,
            check_same_thread=False,
        )
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        for pragma in pragmas:
            conn.execute(f"PRAGMA {pragma}")
        if conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (SCHEMA_REVISION,)
        ]:
            return conn
    except sqlite3.Error:
        pass
    if conn is not None:
        conn.close()
    return None
